"""SQuAD v1.1 and v2.0: the official JSON files, BERT-style sliding-window features, n-best span
decoding with the v2.0 null score, and the official evaluation scripts' metrics.

Features: ``[CLS] question [SEP] context-window [SEP]``; the question is cut to
max_query_length tokens, the context tokenised once per paragraph and cut into windows of
``seq_length - len(question) - 3`` tokens every ``min(window, doc_stride)`` tokens (BERT's
run_squad). Answers are located through sentencepiece's own piece offsets into the original
context, so normalisation (NFKC, collapsed spaces) never shifts them; predicted text is the
original context between the first and last predicted pieces' offsets.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import string
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatron_taco import io
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
    read_json,
    tokenize,
)

logger = logging.getLogger(__name__)

FILES = {
    "squad_v1": {"train": "train-v1.1.json", "dev": "dev-v1.1.json"},
    "squad_v2": {"train": "train-v2.0.json", "dev": "dev-v2.0.json"},
}


# ---------------------------------------------------------------------------------------
# The official evaluation scripts (v1.1: evaluate-v1.1.py; v2.0: evaluate-v2.0.py, published on
# the SQuAD explorer; read from the copies vendored in google-research/electra,
# finetune/qa/squad_official_eval_v1.py, and in other repositories' copies of "Official
# evaluation script for SQuAD version 2.0", whose functions make_qid_to_has_ans,
# get_raw_scores, apply_no_ans_threshold, make_eval_dict and find_best_thresh are reproduced
# here as facts, not code). Definitions:
# normalize_answer lower-cases, drops string.punctuation, the articles a/an/the (as words) and
# collapses whitespace; exact and token F1 take the max over the gold answers.
# v1.1: F1 is 0 when no token is shared (so an empty prediction scores 0); a question without
#   a prediction scores 0 and still counts in the total.
# v2.0: gold answers that normalise to "" are dropped and a question left with none has the
#   single gold answer "" (unanswerable); F1 with an empty side is 1 iff both are empty; a
#   question without a prediction is left out of the totals. With no-answer probabilities
#   (--na-prob-file; here the null odds), a prediction whose na_prob > na_prob_thresh (default
#   1.0) becomes "no answer", and find_best_thresh walks the questions in increasing na_prob
#   order from "answer nothing" (score = number of unanswerable questions), adding each
#   answerable question's raw score and -1 for an unanswerable one that was answered: the best
#   running total over the number of scored questions is best_exact/best_f1, and the na_prob
#   at which it is first reached is the threshold (0.0 when answering nothing is best).


def normalize_answer(s: str) -> str:
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


_PUNCT = frozenset(string.punctuation)


def _tokens(s: str) -> list[str]:
    return normalize_answer(s).split() if s else []


def _f1(gold_toks: list[str], pred_toks: list[str], empty_matches: bool) -> float:
    if empty_matches and (not gold_toks or not pred_toks):
        return float(gold_toks == pred_toks)
    same = sum((Counter(gold_toks) & Counter(pred_toks)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_toks), same / len(gold_toks)
    return 2 * precision * recall / (precision + recall)


def _qas(data: list) -> list[dict]:
    return [qa for article in data for p in article["paragraphs"] for qa in p["qas"]]


def squad_v1_evaluate(data: list, predictions: dict[str, str]) -> dict[str, float]:
    """evaluate-v1.1.py's evaluate(dataset, predictions): {"exact_match", "f1"} in 0-100."""
    exact = f1 = 0.0
    qas = _qas(data)
    for qa in qas:
        if qa["id"] not in predictions:
            logger.warning("Unanswered question %s will receive score 0.", qa["id"])
            continue
        pred = predictions[qa["id"]]
        golds = [a["text"] for a in qa["answers"]]
        exact += max(float(normalize_answer(pred) == normalize_answer(g)) for g in golds)
        f1 += max(_f1(_tokens(g), normalize_answer(pred).split(), False) for g in golds)
    total = len(qas)
    return {"exact_match": 100.0 * exact / total, "f1": 100.0 * f1 / total}


def squad_v2_raw_scores(data: list, predictions: dict[str, str]):
    exact, f1 = {}, {}
    for qa in _qas(data):
        qid = qa["id"]
        golds = [a["text"] for a in qa["answers"] if normalize_answer(a["text"])] or [""]
        if qid not in predictions:
            logger.warning("Missing prediction for %s", qid)
            continue
        pred = predictions[qid]
        exact[qid] = max(int(normalize_answer(g) == normalize_answer(pred)) for g in golds)
        f1[qid] = max(_f1(_tokens(g), _tokens(pred), True) for g in golds)
    return exact, f1


def _find_best_thresh(preds, scores, na_probs, has_ans) -> tuple[float, float]:
    cur = best = sum(1 for v in has_ans.values() if not v)
    best_thresh = 0.0
    for qid in sorted(na_probs, key=lambda k: na_probs[k]):
        if qid not in scores:
            continue
        if has_ans[qid]:
            diff = scores[qid]
        else:
            diff = -1 if preds[qid] else 0
        cur += diff
        if cur > best:
            best, best_thresh = cur, na_probs[qid]
    return 100.0 * best / len(scores), best_thresh


def squad_v2_evaluate(
    data: list,
    predictions: dict[str, str],
    na_probs: dict[str, float] | None = None,
    na_prob_thresh: float = 1.0,
) -> dict[str, float]:
    """evaluate-v2.0.py's main(): exact, f1, total, HasAns_*, NoAns_* (when such questions
    exist), and with na_probs best_exact, best_exact_thresh, best_f1, best_f1_thresh."""
    has_ans = {qa["id"]: bool(qa["answers"]) for qa in _qas(data)}
    exact_raw, f1_raw = squad_v2_raw_scores(data, predictions)
    probs = na_probs if na_probs is not None else {k: 0.0 for k in predictions}

    def thresholded(scores):
        return {
            k: float(not has_ans[k]) if probs[k] > na_prob_thresh else v for k, v in scores.items()
        }

    exact, f1 = thresholded(exact_raw), thresholded(f1_raw)

    def summary(qids) -> dict[str, float]:
        return {
            "exact": 100.0 * sum(exact[k] for k in qids) / len(qids),
            "f1": 100.0 * sum(f1[k] for k in qids) / len(qids),
            "total": float(len(qids)),
        }

    out = summary(list(exact))
    for prefix, wanted in (("HasAns", True), ("NoAns", False)):
        # the script selects these from the dataset's questions and so raises KeyError when a
        # prediction is missing; here they are the scored questions (the same when none is)
        qids = [k for k in exact if has_ans[k] == wanted]
        if qids:
            out.update({f"{prefix}_{k}": v for k, v in summary(qids).items()})
    if na_probs is not None:
        out["best_exact"], out["best_exact_thresh"] = _find_best_thresh(
            predictions, exact_raw, na_probs, has_ans
        )
        out["best_f1"], out["best_f1_thresh"] = _find_best_thresh(
            predictions, f1_raw, na_probs, has_ans
        )
    return out


# ---------------------------------------------------------------------------------------
# Reading


@dataclass
class SquadSet:
    path: str
    data: list  # the file's "data", as the official scripts evaluate it
    contexts: list[str]  # one per paragraph
    para: np.ndarray  # int64 [n] paragraph of each question
    qids: list[str]
    questions: list[str]
    answer_start: np.ndarray  # int64 [n] first answer's character start; -1: none/impossible
    answer_end: np.ndarray  # int64 [n] exclusive
    skipped: Counter = field(default_factory=Counter)


def _need(obj, key, kind, where):
    if not isinstance(obj, dict) or key not in obj:
        raise TaskDataError(f"{where}: missing {key!r}")
    value = obj[key]
    # bool is an int to Python: a JSON true would read as 1
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TaskDataError(
            f"{where}: {key!r} is {json.dumps(value)} ({type(value).__name__}), "
            f"expected {kind.__name__}"
        )
    return value


def read_squad(path: str, version: int, training: bool) -> SquadSet:
    if not os.path.isfile(path):
        raise TaskDataError(f"{path}: missing (SQuAD v{'1.1' if version == 1 else '2.0'} file)")
    data = _need(read_json(path), "data", list, path)
    out = SquadSet(path, data, [], np.zeros(0), [], [], np.zeros(0), np.zeros(0))
    para, starts, ends = [], [], []
    first_seen: dict[str, str] = {}  # question id -> where (dev: predictions are keyed by id)
    for ai, article in enumerate(data):
        for pi, paragraph in enumerate(_need(article, "paragraphs", list, f"{path}: data[{ai}]")):
            where = f"{path}: data[{ai}].paragraphs[{pi}]"
            context = _need(paragraph, "context", str, where)
            out.contexts.append(context)
            for qi, qa in enumerate(_need(paragraph, "qas", list, where)):
                qwhere = f"{where}.qas[{qi}]"
                qid = _need(qa, "id", str, qwhere)
                if not training and qid in first_seen:
                    raise TaskDataError(
                        f"{qwhere}: id {qid!r} repeats {first_seen[qid]}; predictions are "
                        "keyed by id, so one answer would be scored for both questions"
                    )
                first_seen.setdefault(qid, qwhere[len(path) + 2 :])  # without the path
                qwhere += f" (id {qid})"
                question = _need(qa, "question", str, qwhere)
                answers = _need(qa, "answers", list, qwhere)
                for k, a in enumerate(answers):
                    _need(a, "text", str, f"{qwhere}.answers[{k}]")
                    _need(a, "answer_start", int, f"{qwhere}.answers[{k}]")
                impossible = version == 2 and qa.get("is_impossible", not answers)
                if not isinstance(impossible, bool):  # "false" would read as True
                    raise TaskDataError(
                        f"{qwhere}: 'is_impossible' is {impossible!r} "
                        f"({type(impossible).__name__}), expected true or false"
                    )
                if impossible and answers and training:
                    raise TaskDataError(f"{qwhere}: is_impossible but has answers")
                start = end = -1
                if not impossible and answers:
                    text, start = answers[0]["text"], answers[0]["answer_start"]
                    # BERT's reader drops training answers it cannot find at answer_start
                    if context[start : start + len(text)] != text or not text.strip():
                        if training:
                            out.skipped["answer_not_at_answer_start"] += 1
                            continue
                        start = -1
                    else:
                        stripped = text.lstrip()
                        start += len(text) - len(stripped)
                        end = start + len(stripped.rstrip())
                elif not impossible and training:
                    out.skipped["no_answer"] += 1
                    continue
                elif not impossible:
                    raise TaskDataError(
                        f"{qwhere}: no answers (an answerable dev question needs at least one)"
                    )
                out.qids.append(qid)
                out.questions.append(question)
                para.append(len(out.contexts) - 1)
                starts.append(start)
                ends.append(end)
    if not para:
        raise TaskDataError(
            f"{path}: no usable questions ({dict(out.skipped) or 'none in the file'})"
        )
    out.para = np.asarray(para, dtype=np.int64)
    out.answer_start = np.asarray(starts, dtype=np.int64)
    out.answer_end = np.asarray(ends, dtype=np.int64)
    return out


# ---------------------------------------------------------------------------------------
# Features


@dataclass
class ContextTokens:
    """Every paragraph's pieces in one flat array, with their character offsets."""

    ids: np.ndarray  # int32 [total]
    begin: np.ndarray  # int64 [total] character offsets into the paragraph's context
    end: np.ndarray
    start: np.ndarray  # int64 [paragraphs] first token of each paragraph
    length: np.ndarray


def tokenize_contexts(tokenizer, contexts: list[str], chunk: int = 4096) -> ContextTokens:
    ids, offsets = [], []
    for lo in range(0, len(contexts), chunk):
        for i, o in tokenizer.encode_with_offsets(contexts[lo : lo + chunk]):
            ids.append(i)
            offsets.append(o)
    length = np.asarray([len(i) for i in ids], dtype=np.int64)
    off = np.concatenate(offsets) if offsets else np.zeros((0, 2), np.int64)
    return ContextTokens(
        ids=np.concatenate(ids).astype(np.int32) if ids else np.zeros(0, np.int32),
        begin=off[:, 0],
        end=off[:, 1],
        start=np.cumsum(length) - length,
        length=length,
    )


def answer_tokens(ctx: ContextTokens, para, char_start, char_end) -> tuple[np.ndarray, np.ndarray]:
    """Paragraph-local [first, last] tokens covering characters [char_start, char_end): the
    first piece ending after char_start and the last piece beginning before char_end (pieces
    are ordered, so both are searchsorted over (paragraph, offset) keys). -1 where there is no
    answer or it covers no piece."""
    key = int(max(ctx.end.max(initial=0), char_end.max(initial=0))) + 1
    tok_para = np.repeat(np.arange(len(ctx.start)), ctx.length)
    end_key = tok_para * key + ctx.end
    begin_key = tok_para * key + ctx.begin
    has = char_start >= 0
    first = np.searchsorted(end_key, para * key + char_start, side="right")
    last = np.searchsorted(begin_key, para * key + char_end, side="left") - 1
    lo, hi = ctx.start[para], ctx.start[para] + ctx.length[para]
    ok = has & (first >= lo) & (first < hi) & (last >= first) & (last < hi)
    return np.where(ok, first - lo, -1), np.where(ok, last - lo, -1)


@dataclass
class Windows:
    example: np.ndarray  # int64 [F] example of each feature (features are grouped by example)
    doc_start: np.ndarray  # int64 [F] first context token (paragraph-local) of the window
    doc_len: np.ndarray  # int64 [F]
    q_len: np.ndarray  # int64 [F] question tokens; the window starts at row position q_len + 2


def make_windows(ctx_len, q_len, seq_length, doc_stride) -> Windows:
    """BERT's doc spans: windows of max_doc = s - q - 3 tokens starting every
    min(max_doc, doc_stride) tokens until one reaches the end (one empty window for an empty
    context, so that every question gets a prediction)."""
    max_doc = seq_length - q_len - 3
    step = np.minimum(max_doc, doc_stride)
    count = 1 + np.maximum(-(-(ctx_len - max_doc) // step), 0)
    example = np.repeat(np.arange(len(ctx_len)), count)
    first = np.cumsum(count) - count
    w = np.arange(len(example)) - first[example]
    doc_start = w * step[example]
    doc_len = np.minimum(ctx_len[example] - doc_start, max_doc[example])
    return Windows(example, doc_start, doc_len, q_len[example])


def max_context(doc_start: np.ndarray, doc_len: np.ndarray, ctx_len: int) -> list[np.ndarray]:
    """Per window of one example, bool [doc_len]: the window gives this token its most context,
    score min(left, right) + 0.01 * window length, first window on ties (BERT's
    _check_is_max_context)."""
    j = np.arange(ctx_len)[None, :]
    ds, dl = doc_start[:, None], doc_len[:, None]
    score = np.minimum(j - ds, ds + dl - 1 - j) + 0.01 * dl
    score = np.where((j >= ds) & (j < ds + dl), score, -np.inf)
    best = np.argmax(score, axis=0) if ctx_len else np.zeros(0, np.int64)
    return [best[s : s + n] == w for w, (s, n) in enumerate(zip(doc_start, doc_len))]


@dataclass
class SplitState:
    """What decoding a dev split's outputs needs."""

    squad: SquadSet
    ctx: ContextTokens
    windows: Windows
    feature_start: np.ndarray  # int64 [n + 1] features of example e: [fs[e], fs[e+1])


def featurize(
    squad: SquadSet, tokenizer, options: FeatureOptions
) -> tuple[FeatureDataset, SplitState, dict]:
    s = options.seq_length
    q = tokenize(tokenizer, squad.questions)
    q_len = np.minimum(q.length, options.max_query_length)
    if len(q_len) and int(q_len.max()) + 3 >= s:
        worst = int(np.argmax(q_len))
        need = int(q_len[worst]) + 4  # [CLS] question [SEP] >= 1 context token [SEP]
        fix = f"--seq-length {need} or more"
        if s > 4:
            fix += f", or --max-query-length {s - 4} or less"
        raise TaskDataError(
            f"{squad.path}: question id {squad.qids[worst]} has {int(q_len[worst])} tokens "
            f"(kept by --max-query-length {options.max_query_length}), which leave no room for "
            f"the context in --seq-length {s}; use {fix}"
        )
    ctx = tokenize_contexts(tokenizer, squad.contexts)
    ans_first, ans_last = answer_tokens(ctx, squad.para, squad.answer_start, squad.answer_end)
    win = make_windows(ctx.length[squad.para], q_len, s, options.doc_stride)
    ex = win.example
    ids, lengths = assemble(
        [
            Segment(q.flat, q.start[ex], win.q_len),
            Segment(ctx.ids, ctx.start[squad.para[ex]] + win.doc_start, win.doc_len),
        ],
        s,
        tokenizer,
        ids_dtype(tokenizer.vocab_size),
    )
    first, last = ans_first[ex], ans_last[ex]
    inside = (first >= win.doc_start) & (last < win.doc_start + win.doc_len) & (first >= 0)
    offset = win.q_len + 2 - win.doc_start  # paragraph token -> row position
    start_pos = np.where(inside, first + offset, 0)
    end_pos = np.where(inside, last + offset, 0)
    features = FeatureDataset(
        ids, lengths.astype(np.int32), {"start_positions": start_pos, "end_positions": end_pos}
    )
    answerable = squad.answer_start >= 0
    stats = {
        "examples": len(squad.qids),
        "features": len(ex),
        "truncated": int(np.sum(q.length > q_len)),  # questions cut to max_query_length
        "multi_window": int(np.sum(np.bincount(ex, minlength=len(q_len)) > 1)),
        "answer_outside_window": int(np.sum(answerable[ex] & ~inside)),
        "answer_not_in_pieces": int(np.sum(answerable & (ans_first < 0))),
        "skipped": dict(squad.skipped),
    }
    feature_start = np.searchsorted(ex, np.arange(len(q_len) + 1))
    return features, SplitState(squad, ctx, win, feature_start), stats


# ---------------------------------------------------------------------------------------
# Decoding


def decode(
    state: SplitState,
    start_logits: np.ndarray,
    end_logits: np.ndarray,
    options: FeatureOptions,
    version: int,
) -> dict[str, Any]:
    """n-best decoding as BERT's run_squad write_predictions: per feature the n_best_size
    highest start and end logits (over the whole row), kept when both fall in the window's
    context, the start token has its max context there, end >= start and the span has at most
    max_answer_length tokens; candidates ranked by start + end logit, deduplicated by text.
    v2: the null score is the smallest [CLS] start + end over the question's windows; the
    answer is "" when null - best non-null > null_score_diff_threshold, and that difference is
    the question's null odds. A question with no valid span predicts "" (BERT writes "empty")."""
    squad, ctx, win = state.squad, state.ctx, state.windows
    n_best, max_len = options.n_best_size, options.max_answer_length
    # [F, n] the n best start/end positions of every feature's row, best first (stable: ties
    # in row order, as a sort of the list of positions by logit)
    top_starts = np.argsort(-start_logits, axis=1, kind="stable")[:, :n_best]
    top_ends = np.argsort(-end_logits, axis=1, kind="stable")[:, :n_best]
    null_scores = start_logits[:, 0] + end_logits[:, 0]  # [F] the [CLS] span
    predictions, null_odds, nbest_out = {}, {}, {}
    for e, qid in enumerate(squad.qids):
        p = squad.para[e]
        context = squad.contexts[p]
        begin = ctx.begin[ctx.start[p] : ctx.start[p] + ctx.length[p]]
        end = ctx.end[ctx.start[p] : ctx.start[p] + ctx.length[p]]
        f0, f1 = state.feature_start[e], state.feature_start[e + 1]
        is_max = max_context(win.doc_start[f0:f1], win.doc_len[f0:f1], int(ctx.length[p]))
        firsts, lasts, s_logit, e_logit = [], [], [], []  # candidates, feature by feature
        for w, f in enumerate(range(f0, f1)):
            if win.doc_len[f] == 0:
                continue
            lo = win.q_len[f] + 2  # the window's context occupies row positions [lo, hi)
            hi = lo + win.doc_len[f]
            top_s, top_e = top_starts[f][:, None], top_ends[f][None, :]  # [n, 1], [1, n]
            ok = (top_s >= lo) & (top_s < hi) & (top_e >= lo) & (top_e < hi)
            ok &= (top_e >= top_s) & (top_e - top_s + 1 <= max_len)
            ok &= is_max[w][np.clip(top_s - lo, 0, hi - lo - 1)]  # the start's own window
            si, ei = np.nonzero(ok)
            a, b = top_s[si, 0], top_e[0, ei]
            shift = win.doc_start[f] - lo  # row position -> paragraph token
            firsts.append(a + shift)
            lasts.append(b + shift)
            s_logit.append(start_logits[f, a])
            e_logit.append(end_logits[f, b])
        nbest, seen = [], set()
        if firsts:
            s_logit, e_logit = np.concatenate(s_logit), np.concatenate(e_logit)
            firsts, lasts = np.concatenate(firsts), np.concatenate(lasts)
            for k in np.argsort(-(s_logit + e_logit), kind="stable"):
                text = context[begin[firsts[k]] : end[lasts[k]]].strip()
                if not text or text in seen:  # a span of whitespace pieces answers nothing
                    continue
                seen.add(text)
                nbest.append(
                    {"text": text, "start_logit": float(s_logit[k]), "end_logit": float(e_logit[k])}
                )
                if len(nbest) >= n_best:
                    break
        best = nbest[0] if nbest else None
        answer = best["text"] if best else ""
        if version == 2:
            null = float(null_scores[f0:f1].min())
            nbest.append({"text": "", "start_logit": null, "end_logit": 0.0})
            diff = null - best["start_logit"] - best["end_logit"] if best else math.inf
            null_odds[qid] = diff
            if diff > options.null_score_diff_threshold:
                answer = ""
        totals = np.array([c["start_logit"] + c["end_logit"] for c in nbest])
        probs = np.exp(totals - totals.max()) if len(totals) else totals
        for c, prob in zip(nbest, probs / probs.sum() if len(totals) else probs):
            c["probability"] = float(prob)
        predictions[qid] = answer
        nbest_out[qid] = nbest
    out = {"predictions": predictions, "nbest": nbest_out}
    if version == 2:
        out["null_odds"] = null_odds
    return out


def write_squad_predictions(output_dir: str | os.PathLike, decoded: dict[str, Any]) -> list[str]:
    """predictions.json ({question id: answer text}, the official scripts' input),
    null_odds.json for v2.0 (their --na-prob-file) and nbest_predictions.json."""
    os.makedirs(output_dir, exist_ok=True)
    written = []
    for name, key in (
        ("predictions.json", "predictions"),
        ("null_odds.json", "null_odds"),
        ("nbest_predictions.json", "nbest"),
    ):
        if key in decoded:
            path = os.path.join(output_dir, name)
            io.atomic_write(path, json.dumps(decoded[key], indent=2, ensure_ascii=False) + "\n")
            written.append(path)
    return written


# ---------------------------------------------------------------------------------------


def load(info: TaskInfo, data_dir: str, tokenizer, options: FeatureOptions, splits) -> TaskData:
    version = 1 if info.name == "squad_v1" else 2

    def one(split: str):
        path = os.path.join(data_dir, FILES[info.name][split])
        squad = read_squad(path, version, training=split == "train")
        features, state, split_stats = featurize(squad, tokenizer, options)
        return features, state, [path], split_stats

    datasets, states, stats = load_splits(info.name, splits, one)

    def predict(split: str, outputs: dict[str, np.ndarray]) -> dict[str, Any]:
        shape = (len(datasets[split]), options.seq_length)
        start = check_outputs(info, split, outputs, "start_logits", shape)
        end = check_outputs(info, split, outputs, "end_logits", shape)
        return decode(states[split], start, end, options, version)

    def score(split: str, outputs: dict[str, np.ndarray]) -> dict[str, float]:
        decoded = predict(split, outputs)
        data = states[split].squad.data
        if version == 1:
            result = squad_v1_evaluate(data, decoded["predictions"])
            return {
                "exact": result["exact_match"],
                "f1": result["f1"],
                "total": float(len(states[split].squad.qids)),
            }
        return squad_v2_evaluate(data, decoded["predictions"], decoded["null_odds"])

    return TaskData(
        info=info,
        train=datasets.pop("train", None),
        dev=datasets,
        stats=stats,
        scorer=score,
        predictor=predict,
    )
