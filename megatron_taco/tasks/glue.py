"""GLUE (from the GLUE distribution's TSV folders or Hugging Face ``datasets`` saved splits)
and the generic ``custom`` TSV classification task.

Label ids follow the hub's nyu-mll/glue ClassLabel order (its glue.py ``label_classes``), so a
model fine-tuned on either layout has the same head. The hub's column names and ids are:
cola/sst2 ``sentence``; mrpc/stsb/rte/wnli ``sentence1, sentence2``; qqp ``question1,
question2``; mnli ``premise, hypothesis``; qnli ``question, sentence``; ``label`` an int
(stsb float32; -1 for the unlabelled test splits) and ``idx``.
"""

from __future__ import annotations

import glob
import json
import math
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import numpy as np

from megatron_taco.tasks import metrics
from megatron_taco.tasks.base import (
    FeatureDataset,
    FeatureOptions,
    Segment,
    TaskData,
    TaskDataError,
    TaskInfo,
    assemble,
    check_outputs,
    ids_dtype,
    load_splits,
    tokenize,
    truncate_pair,
)


@dataclass(frozen=True)
class GlueFormat:
    tsv_text: tuple[str, ...]  # the TSV header's names of the text columns (1 or 2)
    tsv_label: str
    tsv_label_kind: str = "names"  # "names" (label strings), "ids" ("0"/"1"), "float"
    hf_text: tuple[str, ...] = ()  # the hub's column names, where they differ from tsv_text
    # CoLA's train/dev files have no header: their four columns are named here
    headerless: tuple[str, ...] = ()
    # QQP's released train.tsv has rows broken by stray newlines inside questions; the hub's
    # loader drops them too (its "corrupted rows" filter). They are counted as skipped, in
    # the training split only: a dev or test split is never silently subset.
    skip_malformed: bool = False
    # regression: the range of the score (STS-B's similarity is 0-5)
    score_range: tuple[float, float] | None = None


FORMATS = {
    "cola": GlueFormat(
        ("sentence",), "label", "ids", headerless=("source", "label", "original_label", "sentence")
    ),
    "sst2": GlueFormat(("sentence",), "label", "ids"),
    "mrpc": GlueFormat(("#1 String", "#2 String"), "Quality", "ids", ("sentence1", "sentence2")),
    "stsb": GlueFormat(("sentence1", "sentence2"), "score", "float", score_range=(0.0, 5.0)),
    "qqp": GlueFormat(("question1", "question2"), "is_duplicate", "ids", skip_malformed=True),
    "mnli": GlueFormat(("sentence1", "sentence2"), "gold_label", hf_text=("premise", "hypothesis")),
    "qnli": GlueFormat(("question", "sentence"), "label"),
    "rte": GlueFormat(("sentence1", "sentence2"), "label"),
    "wnli": GlueFormat(("sentence1", "sentence2"), "label", "ids"),
}


def _hub_split(split: str) -> str:
    # the hub names our dev splits "validation" (dev_matched: validation_matched); the others
    # as we do
    return split.replace("dev", "validation")


# The GLUE server's file of each test split (the leaderboard's names, as its sample
# submission has them). MNLI's model also predicts the diagnostic set AX.
SUBMISSION_FILES = {
    "cola": {"test": "CoLA.tsv"},
    "sst2": {"test": "SST-2.tsv"},
    "mrpc": {"test": "MRPC.tsv"},
    "stsb": {"test": "STS-B.tsv"},
    "qqp": {"test": "QQP.tsv"},
    "mnli": {
        "test_matched": "MNLI-m.tsv",
        "test_mismatched": "MNLI-mm.tsv",
        "diagnostic": "AX.tsv",
    },
    "qnli": {"test": "QNLI.tsv"},
    "rte": {"test": "RTE.tsv"},
    "wnli": {"test": "WNLI.tsv"},
}
# The index column of the test files: "index", QQP's "id"; the hub's "idx".
_INDEX_COLUMNS = ("index", "id")


@dataclass
class Examples:
    text_a: list[str]
    text_b: list[str] | None
    labels: np.ndarray | None  # int64 [n] class ids, float32 [n] for regression; None: test
    sources: list[str]
    skipped: Counter = field(default_factory=Counter)
    index: list[str] | None = None  # test splits: each row's index, as the file writes it

    def __len__(self) -> int:
        return len(self.text_a)


# ---------------------------------------------------------------------------------------
# GLUE distribution layout


def read_tsv(path: str) -> Iterator[tuple[int, list[str]]]:
    """(line number, fields) per line, split on tabs only: GLUE's quotes are text, not TSV
    quoting (csv.QUOTE_NONE), and only "\\n" ends a line (a stray "\\r" inside a sentence
    would otherwise split it)."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TaskDataError(
                    f"{path}:{lineno}: not UTF-8 ({e.reason} at byte {e.start})"
                ) from None
            line = line.rstrip("\n").rstrip("\r")
            if lineno == 1:
                line = line.lstrip("\ufeff")  # MRPC's source files start with a BOM
            yield lineno, line.split("\t")


def check_unique(path: str, header: list[str], names=None) -> None:
    """Refuse a header naming a column twice (among ``names``, or any): which of the two holds
    the text would be a guess."""
    counts = Counter(header)
    for name in header:
        if counts[name] > 1 and (names is None or name in names):
            where = [i + 1 for i, h in enumerate(header) if h == name]
            raise TaskDataError(
                f"{path}:1: the header names column {name!r} {counts[name]} times (columns "
                f"{', '.join(map(str, where))}); column names must be unique"
            )


def read_glue_tsv(path: str, info: TaskInfo, fmt: GlueFormat, split: str = "train") -> Examples:
    """A split's TSV file. A test file's header (CoLA's too) names an index column ("index";
    QQP "id") and the text columns; it has no labels."""
    test = split in info.test_splits
    rows = read_tsv(path)
    if fmt.headerless and not test:
        header = list(fmt.headerless)
    else:
        first = next(rows, None)
        if first is None:
            raise TaskDataError(f"{path}: empty file (expected a header line)")
        header = first[1]
    text = ("sentence1", "sentence2") if split == "diagnostic" else fmt.tsv_text
    last = next((c for c in _INDEX_COLUMNS if c in header), None) if test else fmt.tsv_label
    wanted = (*text, last)
    layout = f"{info.name} {split}" if test else info.name
    check_unique(path, header, wanted)
    missing = [c or "index" for c in wanted if c not in header]
    if missing:
        raise TaskDataError(
            f"{path}:1: header lacks column(s) {missing} of the GLUE {layout} layout "
            f"(found {header})"
        )
    ncol = len(header)
    cols = [header.index(c) for c in wanted]
    label_map = {
        "float": None,
        "names": {name: i for i, name in enumerate(info.labels)},
        "ids": {str(i): i for i in range(len(info.labels))},
    }[fmt.tsv_label_kind]
    texts: list[list[str]] = [[] for _ in text]
    lasts: list = []  # the labels, or a test file's indices
    seen: dict[str, str] = {}
    skipped: Counter = Counter()
    for lineno, row in rows:
        if row == [""]:
            if not test:
                skipped["blank_line"] += 1
            continue
        if len(row) != ncol:
            if fmt.skip_malformed and split == "train":
                skipped["malformed_row"] += 1
                continue
            raise TaskDataError(
                f"{path}:{lineno}: {len(row)} tab-separated columns, the {layout} layout has "
                f"{ncol} ({', '.join(header)})"
                + ("; a tab inside a field?" if len(row) > ncol and not test else "")
                + ("" if split == "train" else f"; rows of the {split} split are never skipped")
            )
        values = [row[c] for c in cols]
        if test:
            _check_index(seen, values[-1], f"{path}:{lineno}", f"line {lineno}")
            lasts.append(values[-1])
        else:
            lasts.append(_parse_label(values[-1], label_map, f"{path}:{lineno}", info, fmt))
        for t, v in zip(texts, values):
            t.append(v)
    return _examples(info, texts, lasts, test, [path], skipped)


def _check_index(seen: dict[str, str], value: str, where: str, name: str) -> None:
    """The server matches predictions to test examples by index: each must be there, once."""
    if not value.strip():
        raise TaskDataError(f"{where}: empty index; every test example needs its own")
    if value in seen:
        raise TaskDataError(
            f"{where}: index {value!r} repeats {seen[value]}; the GLUE server needs every test "
            "example's index once"
        )
    seen[value] = name


def submission_text(info: TaskInfo, split: str, index: list[str], outputs) -> tuple[str, str]:
    """(file name, text) of the GLUE server's file: a header "index\tprediction", then one
    row per test example in the file's order, the prediction as the server reads it: the
    label id for tasks whose files give ids (CoLA, SST-2, MRPC, QQP, WNLI), the label name
    for the others (MNLI, AX, QNLI, RTE), STS-B's score with 3 decimals."""
    fmt = FORMATS[info.name]
    pred = _predictions(info, split, outputs, len(index))
    if info.kind == "regression":
        values = [f"{v:.3f}" for v in pred]
    else:
        values = [str(i) if fmt.tsv_label_kind == "ids" else info.labels[i] for i in pred]
    lines = ["index\tprediction", *(f"{i}\t{v}" for i, v in zip(index, values))]
    return SUBMISSION_FILES[info.name][split], "\n".join(lines) + "\n"


def _parse_label(value, label_map, where: str, info: TaskInfo, fmt: GlueFormat):
    if label_map is None:
        if isinstance(value, bool):  # float(True) is 1.0: a bool column is not a score
            raise TaskDataError(f"{where}: score {value!r} is a boolean, not a number")
        try:
            score = float(value)
        except (TypeError, ValueError):
            score = math.nan
        if not math.isfinite(score):
            raise TaskDataError(f"{where}: score {value!r} is not a number")
        low, high = fmt.score_range or (-math.inf, math.inf)
        if not low <= score <= high:
            raise TaskDataError(
                f"{where}: score {value!r} is outside {info.name}'s range {low:g}-{high:g}"
            )
        return score
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        if 0 <= value < len(info.labels):
            return int(value)
    elif isinstance(value, str) and value.strip() in label_map:
        return label_map[value.strip()]
    elif isinstance(value, str) and value in info.labels:
        return info.labels.index(value)
    hint = " (-1 marks the unlabelled test split)" if value in (-1, "-1") else ""
    expected = sorted(label_map) if label_map else list(info.labels)
    raise TaskDataError(
        f"{where}: unknown label {value!r} for {info.name} (expected one of "
        f"{', '.join(map(str, expected))}){hint}"
    )


def _examples(info: TaskInfo, texts, lasts, test: bool, sources, skipped) -> Examples:
    """``lasts``: each row's label, or (``test``) its index."""
    dtype = np.float32 if info.kind == "regression" else np.int64
    return Examples(
        text_a=texts[0],
        text_b=texts[1] if len(texts) > 1 else None,
        labels=None if test else np.asarray(lasts, dtype=dtype),
        sources=sources,
        skipped=skipped,
        index=lasts if test else None,
    )


# ---------------------------------------------------------------------------------------
# Hugging Face layout: Dataset.to_parquet / to_json, or the hub's own parquet files


def hf_files(data_dir: str, config: str, split: str) -> list[str]:
    """The files of one hub split: {split}.parquet|.jsonl|.json, the hub's shards
    {split}-00000-of-0000N.parquet, its parquet-converter {split}/*.parquet, each either in
    data_dir or in data_dir/{config}/."""
    for base in (data_dir, os.path.join(data_dir, config)):
        for name in (f"{split}.parquet", f"{split}.jsonl", f"{split}.json"):
            if os.path.isfile(os.path.join(base, name)):
                return [os.path.join(base, name)]
        for pattern in (f"{split}-*.parquet", os.path.join(split, "*.parquet")):
            found = sorted(glob.glob(os.path.join(glob.escape(base), pattern)))
            if found:
                return found
    return []


def _hf_records(path: str, columns: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    """(where, record) per row with the wanted columns."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as e:  # pyarrow raises several types for a damaged file
            raise TaskDataError(f"{path}: not a readable parquet file ({e})") from None
        missing = [c for c in columns if c not in table.column_names]
        if missing:
            raise TaskDataError(
                f"{path}: no column(s) {missing} (found {table.column_names}); "
                "expected the Hugging Face hub's column names"
            )
        for i, record in enumerate(table.select(list(columns)).to_pylist()):
            yield f"{path}: row {i}", record
        return
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskDataError(f"{path}:{lineno}: not a JSON object ({e.msg})") from None
            if not isinstance(record, dict) or any(c not in record for c in columns):
                found = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise TaskDataError(f"{path}:{lineno}: needs keys {list(columns)}, found {found}")
            yield f"{path}:{lineno}", record


def read_hf(paths: list[str], info: TaskInfo, fmt: GlueFormat, split: str = "train") -> Examples:
    test = split in info.test_splits
    text = ("premise", "hypothesis") if split == "diagnostic" else fmt.hf_text or fmt.tsv_text
    last = "idx" if test else "label"
    label_map = None if info.kind == "regression" else {n: i for i, n in enumerate(info.labels)}
    texts: list[list[str]] = [[] for _ in text]
    lasts: list = []  # the labels, or a test split's indices
    seen: dict[str, str] = {}
    for path in paths:
        for where, record in _hf_records(path, (*text, last)):
            for c in text:
                if not isinstance(record[c], str):
                    raise TaskDataError(f"{where}: {c} is {record[c]!r}, not text")
            if test:
                _check_index(seen, str(record["idx"]), where, where)
                lasts.append(str(record["idx"]))
            else:
                lasts.append(_parse_label(record["label"], label_map, where, info, fmt))
            for t, c in zip(texts, text):
                t.append(record[c])
    return _examples(info, texts, lasts, test, list(paths), Counter())


def read_split(data_dir: str, info: TaskInfo, split: str) -> Examples:
    """A split in the GLUE layout ({split}.tsv; the diagnostic set's diagnostic.tsv beside the
    task's folder or in it) or the hub's."""
    fmt = FORMATS[info.name]
    if split == "diagnostic":
        parent = os.path.dirname(os.path.normpath(data_dir))
        tsvs = [
            os.path.join(data_dir, "diagnostic.tsv"),
            os.path.join(parent, "diagnostic", "diagnostic.tsv"),
        ]
        hubs = [(os.path.join(d, "ax"), "", "test") for d in (data_dir, parent)]
    else:
        tsvs = [os.path.join(data_dir, f"{split}.tsv")]
        hubs = [(data_dir, info.name, _hub_split(split))]
    for tsv in tsvs:
        if os.path.isfile(tsv):
            return read_glue_tsv(tsv, info, fmt, split)
    for hub in hubs:
        paths = hf_files(*hub)
        if paths:
            return read_hf(paths, info, fmt, split)
    hf = hubs[0][2] if split != "diagnostic" else "ax/test"
    if split in info.test_splits:
        raise TaskDataError(
            f"{data_dir}: no {split} split of {info.name} (--predict-test): looked for "
            + ", ".join(tsvs)
            + f" (GLUE layout) and {hf}.parquet/.jsonl (Hugging Face layout)"
        )
    raise TaskDataError(
        f"{data_dir}: no {split} split of {info.name}: looked for {os.path.basename(tsvs[0])} "
        f"(GLUE layout) and {hf}.parquet, {hf}.jsonl, {hf}-*.parquet, {hf}/*.parquet, also "
        f"under {info.name}/ (Hugging Face layout)"
    )


# ---------------------------------------------------------------------------------------
# Features and scoring


def featurize(examples: Examples, tokenizer, seq_length: int) -> tuple[FeatureDataset, int]:
    """-> (features, number of truncated examples). Rows: [CLS] a [SEP] (b [SEP])."""
    a = tokenize(tokenizer, examples.text_a)
    if examples.text_b is None:
        la = np.minimum(a.length, seq_length - 2)
        truncated = int(np.sum(la < a.length))
        segments = [Segment(a.flat, a.start, la)]
    else:
        b = tokenize(tokenizer, examples.text_b)
        la, lb = truncate_pair(a.length, b.length, seq_length - 3)
        truncated = int(np.sum((la < a.length) | (lb < b.length)))
        segments = [Segment(a.flat, a.start, la), Segment(b.flat, b.start, lb)]
    ids, lengths = assemble(segments, seq_length, tokenizer, ids_dtype(tokenizer.vocab_size))
    targets = {} if examples.labels is None else {"labels": examples.labels}
    return FeatureDataset(ids, lengths.astype(np.int32), targets), truncated


def _predictions(info: TaskInfo, split: str, outputs: dict[str, np.ndarray], n: int):
    """[n]: the scores (regression) or the class ids that the model's outputs predict."""
    if info.kind == "regression":
        return check_outputs(info, split, outputs, "predictions", (n,))
    return check_outputs(info, split, outputs, "logits", (n, info.num_labels)).argmax(-1)


def build(info: TaskInfo, read, tokenizer, options: FeatureOptions, splits) -> TaskData:
    """read(split) -> Examples of a split (test splits: with the rows' indices, no labels);
    shared by GLUE and custom."""

    def one(split: str):
        examples = read(split)
        if not len(examples):
            raise TaskDataError(f"{', '.join(examples.sources)}: no examples in the {split} split")
        features, truncated = featurize(examples, tokenizer, options.seq_length)
        split_stats = {
            "examples": len(examples),
            "features": len(features),
            "truncated": truncated,
            "skipped": dict(examples.skipped),
        }
        # test splits: the rows' indices, which the server's file names; others: the labels
        need = examples.index if examples.labels is None else examples.labels
        return features, need, examples.sources, split_stats

    datasets, needs, stats = load_splits(info.name, splits, one)
    index = {s: needs[s] for s in splits if s in info.test_splits}

    def score(split: str, outputs: dict[str, np.ndarray]) -> dict[str, float]:
        pred = _predictions(info, split, outputs, len(needs[split]))
        return metrics.compute(info.metrics, pred, needs[split])

    def submit(split: str, outputs: dict[str, np.ndarray]) -> tuple[str, str]:
        return submission_text(info, split, index[split], outputs)

    return TaskData(
        info=info,
        train=datasets.pop("train", None),
        dev={s: d for s, d in datasets.items() if s not in index},
        stats=stats,
        scorer=score,
        test={s: d for s, d in datasets.items() if s in index},
        submitter=submit if index else None,
    )


def load(info: TaskInfo, data_dir: str, tokenizer, options: FeatureOptions, splits) -> TaskData:
    if info.name == "custom":
        return load_custom(info, data_dir, tokenizer, options, splits)
    return build(info, lambda split: read_split(data_dir, info, split), tokenizer, options, splits)


# ---------------------------------------------------------------------------------------
# custom: train.tsv / dev.tsv with a header "sentence label" or "sentence1 sentence2 label"


def _read_custom(path: str) -> tuple[list[list[str]], list[str], list[int]]:
    """-> (texts per column, label strings, line numbers)."""
    if not os.path.isfile(path):
        raise TaskDataError(f"{path}: missing (the custom task reads train.tsv and dev.tsv)")
    rows = read_tsv(path)
    first = next(rows, None)
    header = first[1] if first else []
    check_unique(path, header)
    if "sentence" in header and ("sentence1" in header or "sentence2" in header):
        raise TaskDataError(
            f"{path}:1: header names both 'sentence' and 'sentence1'/'sentence2', found "
            f"{header}; name one text column 'sentence' or two 'sentence1' and 'sentence2'"
        )
    text = ["sentence"] if "sentence" in header else ["sentence1", "sentence2"]
    if any(c not in header for c in (*text, "label")):
        raise TaskDataError(
            f"{path}:1: header must name 'sentence' (or 'sentence1' and 'sentence2') and "
            f"'label', found {header}"
        )
    cols = [header.index(c) for c in (*text, "label")]
    texts: list[list[str]] = [[] for _ in text]
    labels: list[str] = []
    lines: list[int] = []
    for lineno, row in rows:
        if row == [""]:
            continue
        if len(row) != len(header):
            raise TaskDataError(
                f"{path}:{lineno}: {len(row)} tab-separated columns, the header has {len(header)}"
            )
        for t, c in zip(texts, cols):
            t.append(row[c])
        labels.append(row[cols[-1]])
        lines.append(lineno)
    return texts, labels, lines


def load_custom(info, data_dir, tokenizer, options, splits) -> TaskData:
    paths = {s: os.path.join(data_dir, f"{s}.tsv") for s in splits}
    read = {s: _read_custom(p) for s, p in paths.items()}
    # labels are discovered from train (sorted); when train is not loaded, from the splits given
    found = read["train"][1] if "train" in read else [x for r in read.values() for x in r[1]]
    names = tuple(sorted(set(found)))
    if not names:
        raise TaskDataError(f"{paths.get('train', data_dir)}: no examples")
    info = replace(info, num_labels=len(names), labels=names)
    label_map = {n: i for i, n in enumerate(names)}

    def examples(split: str) -> Examples:
        texts, labels, lines = read[split]
        ids = []
        for label, lineno in zip(labels, lines):
            if label not in label_map:
                raise TaskDataError(
                    f"{paths[split]}:{lineno}: label {label!r} does not occur in train.tsv "
                    f"(labels: {', '.join(names)})"
                )
            ids.append(label_map[label])
        return _examples(info, texts, ids, False, [paths[split]], Counter())

    return build(info, examples, tokenizer, options, splits)
