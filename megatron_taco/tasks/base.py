"""The downstream tasks' contract: what a task is (TaskInfo), what loading one gives (TaskData),
the task table (TASKS) and load_task.

A task module (glue.py, squad.py, race.py) reads its benchmark's released files, builds
fixed-length features with numpy and returns TaskData whose ``score`` applies the benchmark's
own metrics. Everything here sits at the data layer: numpy, torch.utils.data and the
sentencepiece Tokenizer, nothing of parallel/, models/ or training/.
"""

from __future__ import annotations

import importlib
import itertools
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

logger = logging.getLogger(__name__)


class TaskDataError(ValueError):
    """A task's data is unusable; the message names the file (and line or record)."""


@dataclass(frozen=True)
class TaskInfo:
    name: str
    kind: str  # "classification" | "regression" | "span" | "multiple_choice"
    num_labels: int  # classes; regression 1; span 2; multiple_choice: choices per question
    labels: tuple[str, ...]  # class names in label-id order (GLUE: the Hugging Face hub's order)
    dev_splits: tuple[str, ...]  # evaluation splits, the first one chooses the best epoch
    metrics: tuple[str, ...]  # names score() returns
    main_metric: str  # the metric (of dev_splits[0]) that chooses the best epoch / lr
    description: str = ""
    # unlabelled splits whose predictions go to the benchmark's server (GLUE's test sets;
    # MNLI's also the diagnostic set AX, predicted by the MNLI model)
    test_splits: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"task {self.name}: kind {self.kind!r} is not one of {KINDS}")
        if self.main_metric not in self.metrics:
            raise ValueError(f"task {self.name}: main metric {self.main_metric} not in metrics")


KINDS = ("classification", "regression", "span", "multiple_choice")


class FeatureDataset(Dataset):
    """Fixed-length features held as compact numpy arrays; items are torch tensors.

    input_ids is [N, s] (multiple choice [N, C, s]) in the smallest integer type that holds
    the vocabulary; the mask is rebuilt from lengths ([N] or [N, C]) per item, so MNLI's 393k
    x 128 features take 100 MB instead of 500.
    """

    def __init__(
        self, input_ids: np.ndarray, lengths: np.ndarray, targets: dict[str, np.ndarray]
    ) -> None:
        if input_ids.shape[:-1] != lengths.shape:
            raise ValueError(f"input_ids {input_ids.shape} and lengths {lengths.shape} differ")
        for k, v in targets.items():
            if len(v) != len(input_ids):
                raise ValueError(f"target {k} has {len(v)} rows, input_ids {len(input_ids)}")
        self.input_ids = input_ids
        self.lengths = lengths
        self.targets = targets
        self._positions = np.arange(input_ids.shape[-1])

    @property
    def seq_length(self) -> int:
        return self.input_ids.shape[-1]

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        i = int(i)
        item = {
            "input_ids": torch.from_numpy(self.input_ids[i].astype(np.int64)),
            "attention_mask": torch.from_numpy(self._positions < self.lengths[i][..., None]),
        }
        for k, v in self.targets.items():
            item[k] = torch.from_numpy(np.asarray(v[i]))
        item["index"] = torch.tensor(i, dtype=torch.int64)
        return item


# Feature tensors whose last dimension is the sequence: a batch cuts them to its longest row.
SEQUENCE_KEYS = ("input_ids", "attention_mask")
PAD_MULTIPLE = 8


def row_lengths(dataset) -> np.ndarray:
    """int64 [N]: each feature's real tokens (a multiple-choice feature's longest option)."""
    lengths = np.asarray(dataset.lengths, dtype=np.int64)
    return lengths.reshape(len(lengths), -1).max(axis=1)


@dataclass(frozen=True)
class Collate:
    """Features -> one batch. ``dynamic``: the sequence tensors are cut to the batch's longest
    row rounded up to a multiple of ``multiple`` (transformers' DataCollatorWithPadding with
    pad_to_multiple_of=8), never past the features' own length; otherwise every batch keeps
    the features' full --seq-length. Cutting is exact: the columns dropped are padding in
    every row, which attention never reads. A batch depends only on its features, so the
    tensor-parallel ranks of a group, which read the same features, get the same shapes."""

    dynamic: bool = True
    multiple: int = PAD_MULTIPLE

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in samples[0]}
        if self.dynamic and "attention_mask" in batch:
            full = batch["attention_mask"].shape[-1]
            longest = int(batch["attention_mask"].sum(-1).max())  # CPU tensor: no device sync
            width = min(full, -(-max(longest, 1) // self.multiple) * self.multiple)
            for key in SEQUENCE_KEYS:
                if key in batch:
                    batch[key] = batch[key][..., :width].contiguous()
        return batch


@dataclass
class TaskData:
    info: TaskInfo
    train: FeatureDataset | None  # None when "train" is not among the loaded splits
    dev: dict[str, FeatureDataset]  # by split name
    stats: dict[str, Any]
    # (split, outputs) -> metrics; set by the task module
    scorer: Callable[[str, dict[str, np.ndarray]], dict[str, float]] = field(repr=False)
    # span tasks: (split, outputs) -> dict with "predictions", "null_odds" (v2), "nbest"
    predictor: Callable[[str, dict[str, np.ndarray]], dict[str, Any]] | None = field(
        default=None, repr=False
    )
    # unlabelled test splits (TaskInfo.test_splits) when loaded, by split name
    test: dict[str, FeatureDataset] = field(default_factory=dict)
    # (test split, outputs) -> (file name, text) of the benchmark server's file
    submitter: Callable[[str, dict[str, np.ndarray]], tuple[str, str]] | None = field(
        default=None, repr=False
    )

    def score(self, split: str, outputs: dict[str, np.ndarray]) -> dict[str, float]:
        """outputs: the model's outputs for every feature of ``split`` in feature order
        (feature i = self.dev[split][i]): "logits" float [N, C] (classification; multiple
        choice [N, num_choices]), "predictions" float [N] (regression), "start_logits" and
        "end_logits" float [N, s] (span)."""
        if split not in self.dev:
            raise KeyError(f"{self.info.name}: no loaded split {split!r} (have {list(self.dev)})")
        return self.scorer(split, outputs)

    def submission(self, split: str, outputs: dict[str, np.ndarray]) -> tuple[str, str]:
        """(file name, text) of the benchmark server's predictions file for a test split,
        from the model's outputs for every feature of ``self.test[split]`` in order."""
        if self.submitter is None or split not in self.test:
            raise KeyError(f"{self.info.name}: no loaded test split {split!r}")
        return self.submitter(split, outputs)

    def predict(self, split: str, outputs: dict[str, np.ndarray]) -> dict[str, Any]:
        """Span tasks: the decoded answers per question id (see squad.py)."""
        if self.predictor is None:
            raise NotImplementedError(f"{self.info.name}: predictions are for span tasks")
        if split not in self.dev:
            raise KeyError(f"{self.info.name}: no loaded split {split!r} (have {list(self.dev)})")
        return self.predictor(split, outputs)


def _glue(name, labels, metrics, main, dev=("dev",), test=("test",)):
    kind = "regression" if not labels else "classification"
    return TaskInfo(name, kind, max(len(labels), 1), labels, dev, metrics, main, test_splits=test)


_ACC = ("acc",)
# squad_v2_evaluate's: exact, f1, total of all questions, of the answerable (HasAns_) and the
# unanswerable ones (NoAns_), then the best no-answer thresholds
_SQUAD_V2_METRICS = (
    *(f"{part}{m}" for part in ("", "HasAns_", "NoAns_") for m in ("exact", "f1", "total")),
    *("best_exact", "best_exact_thresh", "best_f1", "best_f1_thresh"),
)
TASKS: dict[str, TaskInfo] = {
    info.name: info
    for info in (
        # GLUE; labels in the order of the Hugging Face hub's nyu-mll/glue ClassLabels
        _glue("cola", ("unacceptable", "acceptable"), ("mcc",), "mcc"),
        _glue("sst2", ("negative", "positive"), _ACC, "acc"),
        # MRPC and QQP: accuracy chooses the epoch / lr, as the GLUE score reports it (both
        # conventions, metrics.py); choosing by f1_acc_mean would report an accuracy from an
        # epoch that accuracy did not choose
        _glue("mrpc", ("not_equivalent", "equivalent"), ("f1", "acc", "f1_acc_mean"), "acc"),
        _glue(
            "stsb", (), ("pearson", "spearman", "pearson_spearman_mean"), "pearson_spearman_mean"
        ),
        _glue("qqp", ("not_duplicate", "duplicate"), ("f1", "acc", "f1_acc_mean"), "acc"),
        _glue(
            "mnli",
            ("entailment", "neutral", "contradiction"),
            _ACC,
            "acc",
            dev=("dev_matched", "dev_mismatched"),
            test=("test_matched", "test_mismatched", "diagnostic"),
        ),
        _glue("qnli", ("entailment", "not_entailment"), _ACC, "acc"),
        _glue("rte", ("entailment", "not_entailment"), _ACC, "acc"),
        _glue("wnli", ("not_entailment", "entailment"), _ACC, "acc"),
        # labels are read from train.tsv at load time (sorted): TaskData.info has them
        TaskInfo("custom", "classification", 0, (), ("dev",), _ACC, "acc", "train.tsv/dev.tsv"),
        TaskInfo("squad_v1", "span", 2, (), ("dev",), ("exact", "f1", "total"), "f1", "SQuAD v1.1"),
        TaskInfo("squad_v2", "span", 2, (), ("dev",), _SQUAD_V2_METRICS, "f1", "SQuAD v2.0"),
        TaskInfo(
            "race",
            "multiple_choice",
            4,
            ("A", "B", "C", "D"),
            ("dev",),
            ("acc", "acc_middle", "acc_high"),
            "acc",
            "RACE",
        ),
    )
}
GLUE_TASKS = ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "wnli")

# Splits a task's release has beyond train and dev that load_task accepts on request.
_EXTRA_SPLITS = {"race": ("test",)}


@dataclass(frozen=True)
class FeatureOptions:
    seq_length: int
    doc_stride: int = 128
    max_query_length: int = 64
    max_answer_length: int = 30
    n_best_size: int = 20
    null_score_diff_threshold: float = 0.0

    def __post_init__(self) -> None:
        for name in ("seq_length", "doc_stride", "max_query_length", "max_answer_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.seq_length < 4:
            raise ValueError(
                f"seq_length must be at least 4 ([CLS] a [SEP] b [SEP]), got {self.seq_length}"
            )
        if self.n_best_size < 1:
            raise ValueError(f"n_best_size must be positive, got {self.n_best_size}")


def load_task(
    name: str,
    data_dir: str | os.PathLike,
    tokenizer,
    *,
    splits: Sequence[str] | None = None,
    **options,
) -> TaskData:
    """Read task ``name`` from its released layout in ``data_dir`` and build its features.

    options: FeatureOptions' fields (seq_length is required). splits: which of "train", the
    task's dev splits and its test splits to load (default: train and the dev splits). Bad
    data raises TaskDataError naming the file and line or record."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(TASKS)}")
    info = TASKS[name]
    options = FeatureOptions(**options)
    allowed = ("train", *info.dev_splits, *info.test_splits, *_EXTRA_SPLITS.get(name, ()))
    splits = tuple(splits) if splits is not None else ("train", *info.dev_splits)
    unknown = [s for s in splits if s not in allowed]
    if unknown or not splits:
        raise ValueError(f"task {name}: splits {list(splits)} must be among {list(allowed)}")
    data_dir = os.fspath(data_dir)
    if not os.path.isdir(data_dir):
        raise TaskDataError(f"{data_dir}: no such directory (the {name} data directory)")
    # span tasks are squad.py's, multiple choice race.py's, GLUE and custom glue.py's
    module = {"span": "squad", "multiple_choice": "race"}.get(info.kind, "glue")
    return importlib.import_module(f"megatron_taco.tasks.{module}").load(
        info, data_dir, tokenizer, options, splits
    )


def load_splits(name: str, splits: Sequence[str], one: Callable) -> tuple[dict, dict, dict]:
    """one(split) -> (features, what scoring the split needs, its source files, its stats) for
    each split -> (features by split, the needs by split, the load's stats: "sources" and each
    stat keyed by split, "seconds")."""
    start = time.perf_counter()
    stats: dict = {"sources": {}}
    datasets, needs = {}, {}
    for split in splits:
        datasets[split], needs[split], sources, split_stats = one(split)
        stats["sources"][split] = sources
        for k, v in split_stats.items():
            stats.setdefault(k, {})[split] = v
        logger.info("%s %s: %s from %s", name, split, split_stats, ", ".join(sources))
    stats["seconds"] = time.perf_counter() - start
    return datasets, needs, stats


def read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise TaskDataError(f"{path}:{e.lineno}:{e.colno}: not valid JSON ({e.msg})") from None
    except UnicodeDecodeError as e:
        raise TaskDataError(f"{path}: not UTF-8 ({e.reason} at byte {e.start})") from None


# ---------------------------------------------------------------------------------------
# Feature building shared by the task modules


def ids_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.int32)


@dataclass
class Segment:
    """Many token sequences in one flat array: sequence i is flat[start[i]:start[i]+length[i]]
    (tokenize's: sequences of equal texts share their tokens; assemble's: one part of every
    row, row i copying sequence i)."""

    flat: np.ndarray  # int32 [total]
    start: np.ndarray  # int64 [n]
    length: np.ndarray  # int64 [n]


def tokenize(tokenizer, texts: Sequence[str], chunk: int = 32768) -> Segment:
    """encode_batch in chunks into one flat int32 array (python lists of ids for all of MNLI at
    once would take gigabytes). Each distinct text is encoded once: MNLI pairs every premise
    with three hypotheses, QNLI repeats its questions."""
    first: dict[str, int] = {}
    inverse = np.fromiter(
        (first.setdefault(t, len(first)) for t in texts), dtype=np.int64, count=len(texts)
    )
    unique = list(first)
    flats, lengths = [], []
    for lo in range(0, len(unique), chunk):
        enc = tokenizer.encode_batch(unique[lo : lo + chunk])
        n = np.fromiter(map(len, enc), dtype=np.int64, count=len(enc))
        flats.append(
            np.fromiter(itertools.chain.from_iterable(enc), dtype=np.int32, count=int(n.sum()))
        )
        lengths.append(n)
    length = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    flat = np.concatenate(flats) if flats else np.zeros(0, np.int32)
    start = np.cumsum(length) - length
    return Segment(flat, start[inverse], length[inverse])


def truncate_pair(la: np.ndarray, lb: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """BERT's longest-first truncation, vectorised: while la + lb > budget, drop a token from
    the longer (from b on a tie). Closed form: if the shorter fits in half the budget it stays
    and the longer gets the rest; otherwise a gets ceil(budget / 2) and b floor(budget / 2)."""
    la, lb = la.astype(np.int64), lb.astype(np.int64)
    over = la + lb > budget
    short = np.minimum(la, lb)
    keep_short = over & (2 * short <= budget)
    halve = over & ~keep_short
    a = np.where(keep_short & (la > lb), budget - lb, la)
    b = np.where(keep_short & (lb > la), budget - la, lb)
    a = np.where(halve, (budget + 1) // 2, a)
    b = np.where(halve, budget // 2, b)
    return a, b


def assemble(
    segments: Sequence[Segment],
    seq_length: int,
    tokenizer,
    dtype: np.dtype,
    chunk: int = 16384,
) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``[CLS] seg0 [SEP] seg1 [SEP] ...`` padded to seq_length -> (ids [N, s], lengths [N]).

    The caller has truncated the segments to fit; copies are vectorised per chunk of rows
    (the index arrays of a chunk are [chunk, s] int64)."""
    n = len(segments[0].start)
    lengths = 1 + sum(seg.length.astype(np.int64) + 1 for seg in segments)
    if n and int(lengths.max()) > seq_length:
        raise AssertionError(f"row of {int(lengths.max())} tokens > seq_length {seq_length}")
    ids = np.full((n, seq_length), tokenizer.pad_id, dtype=dtype)
    col = np.arange(seq_length)[None, :]
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        out = ids[lo:hi]
        rows = np.arange(hi - lo)
        out[:, 0] = tokenizer.cls_id
        pos = np.ones(hi - lo, dtype=np.int64)  # where the next segment starts
        for seg in segments:
            length = seg.length[lo:hi].astype(np.int64)
            offset = col - pos[:, None]  # [chunk, s] position inside the segment
            inside = (offset >= 0) & (offset < length[:, None])
            out[inside] = seg.flat[(seg.start[lo:hi, None] + offset)[inside]]
            out[rows, pos + length] = tokenizer.sep_id
            pos = pos + length + 1
    return ids, lengths


def check_outputs(
    info: TaskInfo, split: str, outputs: dict[str, np.ndarray], key: str, shape: tuple
) -> np.ndarray:
    """The model output ``key`` as float64 of the expected shape, or a ValueError saying why."""
    if key not in outputs:
        raise ValueError(f"{info.name} {split}: outputs need {key!r}, got {sorted(outputs)}")
    value = np.asarray(outputs[key], dtype=np.float64)
    if value.shape != shape:
        raise ValueError(
            f"{info.name} {split}: {key} has shape {value.shape}, expected {shape} "
            "(one row per feature, in feature order)"
        )
    return value
