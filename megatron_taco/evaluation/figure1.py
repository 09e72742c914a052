"""The word-order probe of the TACO paper's Figure 1 (taco-word-order-probe,
tools/word_order_probe.py): how much the last-layer vector of the same word, and of [CLS],
changes between sentences that reorder the same words.

    python tools/word_order_probe.py --load taco_ckpt --load sas_ckpt --load bert-base-dir \\
        [--sentences sentences.txt] [--output-dir probe]

For every pair of sentences and every word they share: the paper's Distance
d(v1, v2) = |v1 - v2| / min(|v1|, |v2|) and Angle arccos(v1.v2 / (|v1| |v2|)) (radians; the
table gives degrees too), and the same two numbers for the first token ([CLS]) of each pair.
Written: a table on stdout, word_order_probe.json and .csv, and word_order_probe.png in the
style of Figure 1, one column per model (words of --plot-pair on top, [CLS] of every pair
below).

Models: our checkpoints (TACO, SAS; any tensor-parallel size and ZeRO stage; the latest
iteration) and transformers model directories (BERT, DeBERTa, an exported TACO with
--trust-remote-code), read from disk only.

Which vector (the paper's Figure 1 probes BERT and DeBERTa only; for TACO it says "TACO
concatenates WE and PE output vector of each token as its complete representation" and that
the complete representations of the last layer feed the task layers): --taco-stream both
(default) is that complete representation [h_WE; h_PE]; we / pe probe one stream alone.

Words and shared words: a word is a run of letters/digits or one punctuation character (as
BERT's basic tokenizer splits); its vector is the mean (--subword mean, default) or the
first (--subword first) of the last-layer vectors of the subword pieces that overlap its
characters (a piece spanning two words counts for both; specials count for none). Two
sentences share a word when it occurs in both, spelt the same (--case-insensitive: up to
case, "Once" matches "once"); the k-th occurrence in one sentence is paired with the k-th
in the other, and occurrences beyond the smaller count are left out. A shared word is
compared only when the tokenizer gives it the same pieces in both sentences, as the paper's
Figure 1 compares the same token: otherwise ("once" is "▁once" in one sentence and "▁On",
"ce" in the other with a cased tokenizer) the row would mix a change of token with the
change of order, and it is listed as skipped with both tokenisations (so is a word that
matches only up to case without --case-insensitive, among the words not paired as written).
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json
import logging
import math
import os
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from megatron_taco.arguments import option, require
from megatron_taco.checkpoint.errors import CheckpointError
from megatron_taco.errors import ConfigError
from megatron_taco.evaluation.encoders import (
    FrozenEncoder,
    OurEncoder,
    load_transformers_encoder,
)

log = logging.getLogger(__name__)

# The TACO paper's three sentences (its introduction; Figure 1).
PAPER_SENTENCES = (
    "Bob once asked Alice to borrow a book.",
    "Once, Bob asked Alice to borrow a book.",
    "Bob once borrow Alice to asked a book.",
)
_WORD = re.compile(r"\w+|[^\w\s]")
OUTPUT_NAME = "word_order_probe"


@dataclass(frozen=True)
class ProbeConfig:
    load: tuple[str, ...] = option((), "Models to probe.", cli=False)
    sentences: str | None = option(
        None, "Text file of sentences, one per line (default: the TACO paper's three)."
    )
    taco_stream: str = option(
        "both",
        "TACO's vector: both = the complete representation [h_WE; h_PE]; we / pe = one stream.",
        choices=("both", "we", "pe"),
    )
    subword: str = option(
        "mean",
        "A word's vector from its subword pieces: their mean, or the first piece's.",
        choices=("mean", "first"),
    )
    plot_pair: tuple[int, ...] = option(
        (1, 2), "The two sentences (1-based) whose shared words the PNG shows."
    )
    tokenizer_model: str | None = option(
        None, "Sentencepiece model of our checkpoints (default: the one each metadata names)."
    )
    case_insensitive: bool = option(
        False,
        'Match words up to case ("Once" with "once"); they are still compared only when '
        "the tokenizer gives them the same pieces in both sentences.",
    )
    trust_remote_code: bool = option(
        False, "Run the modeling code of transformers directories that ship their own."
    )
    output_dir: str = option(OUTPUT_NAME, "Directory for the JSON, CSV and PNG files.")

    def __post_init__(self) -> None:
        cls = type(self)
        require(len(self.load) > 0, cls, "load", "give at least one model")
        pair = self.plot_pair
        require(
            len(pair) == 2 and pair[0] != pair[1] and min(pair) >= 1,
            cls,
            "plot_pair",
            f"needs two different sentence numbers >= 1, got {list(pair)}",
        )


# ---------------------------------------------------------------------------------------
# Measures


def distance(v1: np.ndarray, v2: np.ndarray) -> float:
    """|v1 - v2| / min(|v1|, |v2|)."""
    v1, v2 = np.asarray(v1, np.float64), np.asarray(v2, np.float64)
    return float(np.linalg.norm(v1 - v2) / min(np.linalg.norm(v1), np.linalg.norm(v2)))


def angle(v1: np.ndarray, v2: np.ndarray) -> float:
    """arccos(v1.v2 / (|v1| |v2|)) in radians; the cosine is clipped to [-1, 1], which
    rounding can leave by an ulp for (anti)parallel vectors."""
    v1, v2 = np.asarray(v1, np.float64), np.asarray(v2, np.float64)
    cos = np.dot(v1, v2) / (np.linalg.norm(v1) * np.linalg.norm(v2))
    return float(np.arccos(np.clip(cos, -1.0, 1.0)))


# ---------------------------------------------------------------------------------------
# Words, pieces, shared words

Span = tuple[int, int]  # [start, end) in characters


@dataclass(frozen=True)
class Word:
    text: str  # as written
    key: str  # what matches it with another sentence's word: the text, or case-folded
    occurrence: int  # 0 for the first time ``key`` occurs in the sentence, 1 next, ...
    span: Span
    pieces: tuple[str, ...] = ()  # the subword pieces that cover it (set by word_vectors)


def words_of(text: str, case_insensitive: bool = False) -> list[Word]:
    words = [Word(m.group(), m.group(), 0, m.span()) for m in _WORD.finditer(text)]
    return _keyed(words, str.casefold if case_insensitive else str)


def _keyed(words: Sequence[Word], key: Callable[[str], str]) -> list[Word]:
    """The words keyed by ``key(text)``, the occurrences of each key counted again."""
    seen: dict[str, int] = defaultdict(int)
    out = []
    for w in words:
        k = key(w.text)
        out.append(dataclasses.replace(w, key=k, occurrence=seen[k]))
        seen[k] += 1
    return out


def word_vectors(
    words: Sequence[Word],
    pieces: Sequence[Span],
    hidden: np.ndarray,
    rule: str,
    names: Sequence[str] | None = None,
) -> tuple[list[Word], np.ndarray]:
    """(the words some piece covers, with the pieces ``names`` (row i's piece) that cover
    them; their vectors [n, H]). ``pieces[i]`` is the character span of row i of
    ``hidden``; empty spans (specials) cover nothing."""
    kept, vectors = [], []
    for word in words:
        start, end = word.span
        rows = [i for i, (s, e) in enumerate(pieces) if s < e and s < end and e > start]
        if not rows:
            log.warning("no subword piece covers %r; left out", word.text)
            continue
        covering = tuple(names[i] for i in rows) if names is not None else ()
        kept.append(dataclasses.replace(word, pieces=covering))
        vectors.append(hidden[rows[0]] if rule == "first" else hidden[rows].mean(axis=0))
    return kept, np.stack(vectors) if vectors else np.zeros((0, hidden.shape[-1]))


def shared_words(a: Sequence[Word], b: Sequence[Word]) -> list[tuple[int, int]]:
    """Index pairs (i in a, j in b) of the same word, k-th occurrence with k-th, in a's order."""
    in_b = {(w.key, w.occurrence): j for j, w in enumerate(b)}
    return [
        (i, in_b[w.key, w.occurrence]) for i, w in enumerate(a) if (w.key, w.occurrence) in in_b
    ]


def compared_words(
    a: Sequence[Word], b: Sequence[Word], case_insensitive: bool = False
) -> tuple[list[tuple[int, int]], list[dict]]:
    """(the shared words whose pieces are the same in both sentences, as index pairs in a's
    order; the others as skipped rows saying why). Without ``case_insensitive``, words
    that match only up to case are listed as skipped too."""
    compared, skipped = [], []
    shared = shared_words(a, b)
    for i, j in shared:
        if a[i].pieces == b[j].pieces:
            compared.append((i, j))
        else:
            skipped.append(_skip(a[i], b[j], "tokenised differently"))
    if not case_insensitive:
        # Among the words left unpaired only: "Once upon once" and "once upon Once" pair
        # both spellings as written, and neither is also a skipped case-only match.
        paired_a, paired_b = {i for i, _ in shared}, {j for _, j in shared}
        rest_a = [i for i in range(len(a)) if i not in paired_a]
        rest_b = [j for j in range(len(b)) if j not in paired_b]
        folded_a = _keyed([a[i] for i in rest_a], str.casefold)
        folded_b = _keyed([b[j] for j in rest_b], str.casefold)
        for p, q in shared_words(folded_a, folded_b):
            i, j = rest_a[p], rest_b[q]
            skipped.append(_skip(a[i], b[j], "differs in case (see --case-insensitive)"))
    return compared, skipped


def _skip(a: Word, b: Word, reason: str) -> dict:
    return {
        "word": a.text,
        "other": b.text,
        "occurrence": a.occurrence,
        "reason": reason,
        "pieces": [list(a.pieces), list(b.pieces)],
    }


def char_spans_from_bytes(text: str, spans: Sequence[Span]) -> list[Span]:
    """Sentencepiece reports UTF-8 byte offsets; the words are found in characters."""
    # [bytes + 1]: the character of each byte, then the end
    n_bytes = [len(ch.encode("utf-8")) for ch in text]
    char_at = np.append(np.repeat(np.arange(len(text)), n_bytes), len(text))
    return [(int(char_at[s]), int(char_at[e])) for s, e in spans]


# ---------------------------------------------------------------------------------------
# Models: text -> (piece spans, last-layer vectors [n, H] float64, [CLS] vector [H],
# the pieces' names [n])

Encoded = tuple[list[Span], np.ndarray, np.ndarray, list[str]]
Pieces = tuple[list[int], list[Span], list[str]]  # ids with [CLS] and [SEP], spans, names


@dataclass
class ProbedModel:
    label: str
    encoder: FrozenEncoder
    pieces: Callable[[str], Pieces]  # the model's own tokenizer, with character spans
    stream: str  # TACO's vector: "both", "we" or "pe"
    where: str  # its --load

    def encode(self, text: str) -> Encoded:
        import torch

        ids, spans, names = self.pieces(text)
        limit = self.encoder.max_positions
        if limit is not None and len(ids) > limit:
            short = repr(text if len(text) <= 40 else text[:37] + "...")
            raise ConfigError(
                f"--sentences: {short} has {len(ids)} tokens; {self.where} takes {limit}"
            )
        x = torch.tensor([ids])
        mask = torch.ones_like(x, dtype=torch.bool)
        with torch.no_grad():
            hidden = self.encoder.hidden(x, mask, torch.arange(len(ids))[None])
        hidden = _stream(hidden, self.encoder.we_width, self.stream)[0].double().numpy()
        return spans, hidden, hidden[0], names


def _stream(hidden, we_width: int | None, stream: str):
    # [..., d_WE + d_PE] -> the chosen part (one-stream encoders: all of it).
    if we_width is None or stream == "both":
        return hidden
    return hidden[..., :we_width] if stream == "we" else hidden[..., we_width:]


def our_model(path: str, config: ProbeConfig) -> ProbedModel:
    import sentencepiece as spm

    from megatron_taco.recipes.registry import checkpoint_tokenizer, load_pretraining_model

    try:
        model, info = load_pretraining_model(path, config.tokenizer_model)
    except CheckpointError as e:
        raise CheckpointError(
            f"--load: {path} is neither a transformers model directory (no config.json) nor a "
            f"checkpoint we can read ({e})"
        ) from None
    tokenizer_path, tokenizer_type = checkpoint_tokenizer(info, config.tokenizer_model)
    if tokenizer_type != "SentencePiece":
        raise ConfigError(
            f"--load: {path} was trained with a {tokenizer_type} vocabulary; the probe reads "
            "sentencepiece pieces only"
        )
    sp = spm.SentencePieceProcessor(model_file=tokenizer_path)

    def pieces(text: str) -> Pieces:
        proto = sp.encode(text, return_type="proto")
        spans = char_spans_from_bytes(text, [(p.begin, p.end) for p in proto.pieces])
        names = ["[CLS]", *(p.piece for p in proto.pieces), "[SEP]"]
        return [2, *(p.id for p in proto.pieces), 3], [(0, 0), *spans, (0, 0)], names

    kind = f"TACO ({config.taco_stream})" if info.model == "TACO" else "SAS"
    label = f"{kind}: {_name(path)} iter {info.iteration}"
    return ProbedModel(label, OurEncoder(model, info.model), pieces, config.taco_stream, path)


def transformers_model(path: str, config: ProbeConfig) -> ProbedModel:
    encoder = load_transformers_encoder(path, config.trust_remote_code)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(
        path, trust_remote_code=config.trust_remote_code, local_files_only=True
    )
    if not tok.is_fast:
        raise ConfigError(f"--load: {path}: the probe needs a fast tokenizer (character offsets)")

    def pieces(text: str) -> Pieces:
        enc = tok(text, return_offsets_mapping=True)
        ids = enc["input_ids"]
        spans = [(int(s), int(e)) for s, e in enc["offset_mapping"]]
        return ids, spans, tok.convert_ids_to_tokens(ids)

    kind = encoder.kind + (f" ({config.taco_stream})" if encoder.we_width is not None else "")
    return ProbedModel(f"{kind}: {_name(path)}", encoder, pieces, config.taco_stream, path)


def _name(path: str) -> str:
    return os.path.basename(os.path.normpath(path))


def load_model(path: str, config: ProbeConfig) -> ProbedModel:
    if not os.path.isdir(path):
        raise ConfigError(f"--load: {path} is not a directory")
    if os.path.isfile(os.path.join(path, "config.json")):
        return transformers_model(path, config)
    return our_model(path, config)


# ---------------------------------------------------------------------------------------
# The probe


def _measures(v1, v2) -> dict[str, float]:
    a = angle(v1, v2)
    return {"distance": distance(v1, v2), "angle_rad": a, "angle_deg": math.degrees(a)}


def probe(
    model: ProbedModel, sentences: Sequence[str], rule: str, case_insensitive: bool = False
) -> dict:
    """{"label", "tokens": [per pair and compared word], "cls": [per pair], "skipped": [per
    pair and shared word not compared, with why]}."""
    per_sentence = []
    for text in sentences:
        spans, hidden, cls, names = model.encode(text)
        words = words_of(text, case_insensitive)
        words, vectors = word_vectors(words, spans, hidden, rule, names)
        per_sentence.append((words, vectors, cls))
    tokens, cls_rows, skipped = [], [], []
    for i, j in itertools.combinations(range(len(sentences)), 2):
        (wa, va, ca), (wb, vb, cb) = per_sentence[i], per_sentence[j]
        pair = [i + 1, j + 1]
        compared, left_out = compared_words(wa, wb, case_insensitive)
        for a, b in compared:
            w = wa[a]
            row = dict(word=w.text, occurrence=w.occurrence, pieces=list(w.pieces))
            tokens.append({"pair": pair, **row, **_measures(va[a], vb[b])})
        skipped += [{"pair": pair, **row} for row in left_out]
        cls_rows.append({"pair": pair, **_measures(ca, cb)})
    return {"label": model.label, "tokens": tokens, "cls": cls_rows, "skipped": skipped}


def read_sentences(path: str | None) -> list[str]:
    if path is None:
        return list(PAPER_SENTENCES)
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.strip() for line in f]
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--sentences: cannot read {path} ({e})") from None
    sentences = [line for line in lines if line]
    if len(sentences) < 2:
        raise ConfigError(f"--sentences: {path} has {len(sentences)} sentences; give at least 2")
    return sentences


# ---------------------------------------------------------------------------------------
# Output


def _token_label(row: dict) -> str:
    return row["word"] + (f"#{row['occurrence'] + 1}" if row["occurrence"] else "")


def format_table(results: Sequence[dict], sentences: Sequence[str]) -> str:
    lines = [f"  {i}. {s}" for i, s in enumerate(sentences, 1)]
    for model in results:
        lines += [
            "",
            f"== {model['label']}",
            f"{'pair':<6}{'token':<16}{'distance':>10}{'angle':>10}",
        ]
        for row in [*model["tokens"], *({**r, "word": "[CLS]"} for r in model["cls"])]:
            pair = "{}-{}".format(*row["pair"])
            token = row["word"] if "occurrence" not in row else _token_label(row)
            lines.append(f"{pair:<6}{token:<16}{row['distance']:>10.4f}{row['angle_deg']:>9.2f}°")
        for row in model.get("skipped", ()):
            pieces = " | ".join(" ".join(p) or "-" for p in row["pieces"])
            lines.append(
                "{}-{}".format(*row["pair"]).ljust(6)
                + f"{row['word']}/{row['other']}: skipped, {row['reason']} ({pieces})"
            )
    return "\n".join(lines)


def write_csv(path: str, results: Sequence[dict]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        out = csv.writer(f)
        out.writerow(["model", "pair", "token", "occurrence", "distance", "angle_rad", "angle_deg"])
        for model in results:
            cls = ({**r, "word": "[CLS]", "occurrence": 0} for r in model["cls"])
            for r in [*model["tokens"], *cls]:
                row = [model["label"], "{}-{}".format(*r["pair"]), r["word"], r["occurrence"] + 1]
                out.writerow(row + [r["distance"], r["angle_rad"], r["angle_deg"]])


def plot(path: str, results: Sequence[dict], pair: Sequence[int]) -> None:
    """Figure 1's style: bars of Distance and Angle (radians) per shared word of ``pair``,
    and per sentence pair for [CLS]; one column per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    fig, axes = plt.subplots(
        2, n, figsize=(4.2 * n + 0.6, 6.0), squeeze=False, height_ratios=(2, 1)
    )
    for col, model in enumerate(results):
        rows = [r for r in model["tokens"] if r["pair"] == list(pair)]
        title = f"({chr(97 + col)}) {model['label']}\nsentence {pair[0]} vs {pair[1]}"
        cls_labels = ["{}-{}".format(*r["pair"]) for r in model["cls"]]
        panels = (
            (axes[0, col], [_token_label(r) for r in rows], rows, title),
            (axes[1, col], cls_labels, model["cls"], "[CLS], every pair of sentences"),
        )
        for ax, labels, data, title in panels:
            x = np.arange(len(labels))
            ax.bar(x - 0.2, [r["distance"] for r in data], 0.4, label="Distance")
            ax.bar(x + 0.2, [r["angle_rad"] for r in data], 0.4, label="Angle (rad)")
            ax.set_xticks(x, labels, rotation=45, ha="right", fontsize=8)
            ax.set_title(title, fontsize=9)
            ax.grid(axis="y", alpha=0.3)
        axes[0, col].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(config: ProbeConfig) -> dict:
    sentences = read_sentences(config.sentences)
    if max(config.plot_pair) > len(sentences):
        raise ConfigError(
            f"--plot-pair: {list(config.plot_pair)} but there are {len(sentences)} sentences"
        )
    models = [load_model(path, config) for path in config.load]
    results = [probe(m, sentences, config.subword, config.case_insensitive) for m in models]
    labels = [r["label"] for r in results]
    for i, r in enumerate(results):  # two --load of the same name stay apart
        if labels.count(r["label"]) > 1:
            r["label"] += f" [{i + 1}]"
    os.makedirs(config.output_dir, exist_ok=True)
    base = os.path.join(config.output_dir, OUTPUT_NAME)
    report = {
        "sentences": sentences,
        "representation": {
            "layer": "last",
            "taco_stream": config.taco_stream,
            "subword": config.subword,
            "case_insensitive": config.case_insensitive,
            "words": "shared words tokenised to the same pieces in both sentences",
        },
        "models": [{"source": p, **r} for p, r in zip(config.load, results)],
    }
    with open(base + ".json", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    write_csv(base + ".csv", results)
    plot(base + ".png", results, config.plot_pair)
    print(format_table(results, sentences))
    print(f"\nwrote {base}.json, {base}.csv, {base}.png")
    return report
