"""RACE from its released directory: ``{split}/{middle,high}/*.txt``, each file one JSON object
with ``article``, ``questions``, ``options`` (four per question) and ``answers`` (letters A-D).

Each question gives four rows ``[CLS] article [SEP] question-with-option [SEP]``. The question
and option are joined as Megatron-LM's tasks/race/data.py does: a question with "_" blanks has
every "_" replaced by the option, any other is followed by a space and the option. The article
is truncated first; the question+option part keeps at least half of the room (cut from its
start, so that the option, which tells the four rows apart, survives).
"""

from __future__ import annotations

import glob
import os

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
    read_json,
    tokenize,
)

LEVELS = ("middle", "high")
NUM_CHOICES = 4


def qa_text(question: str, option: str) -> str:
    return question.replace("_", option) if "_" in question else f"{question} {option}"


def read_race(data_dir: str, split: str) -> dict:
    """-> articles, per question: its article, qa texts [n * 4], label, level; files."""
    articles: list[str] = []
    article_of: list[int] = []
    qa: list[str] = []
    labels: list[int] = []
    level: list[int] = []
    files: list[str] = []
    for lv, name in enumerate(LEVELS):
        folder = os.path.join(data_dir, split, name)
        if not os.path.isdir(folder):
            raise TaskDataError(f"{folder}: missing (RACE layout: {split}/middle, {split}/high)")
        paths = sorted(glob.glob(os.path.join(glob.escape(folder), "*.txt")))
        if not paths:
            raise TaskDataError(f"{folder}: no *.txt files")
        for path in paths:
            files.append(path)
            doc = read_json(path)
            fields = ("article", "questions", "options", "answers")
            if not isinstance(doc, dict) or any(k not in doc for k in fields):
                found = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
                raise TaskDataError(f"{path}: needs keys {list(fields)}, found {found}")
            article, questions, options, answers = (doc[k] for k in fields)
            for key in fields[1:]:
                if not isinstance(doc[key], list):
                    raise TaskDataError(
                        f"{path}: {key!r} is {type(doc[key]).__name__}, expected a list with "
                        "one entry per question"
                    )
            if not len(questions) == len(options) == len(answers):
                raise TaskDataError(
                    f"{path}: questions, options and answers must be lists of one length, got "
                    f"{len(questions)}, {len(options)}, {len(answers)}"
                )
            if not isinstance(article, str):
                raise TaskDataError(f"{path}: article is {type(article).__name__}, not text")
            articles.append(" ".join(article.split("\n")))
            for i, (question, opts, answer) in enumerate(zip(questions, options, answers)):
                where = f"{path}: question {i}"
                if not isinstance(question, str):
                    raise TaskDataError(f"{where}: question is not text")
                if not (
                    isinstance(opts, list)
                    and len(opts) == NUM_CHOICES
                    and all(isinstance(o, str) for o in opts)
                ):
                    raise TaskDataError(f"{where}: needs {NUM_CHOICES} text options, got {opts!r}")
                if answer not in ("A", "B", "C", "D"):
                    raise TaskDataError(f"{where}: answer {answer!r} is not one of A, B, C, D")
                qa.extend(qa_text(question, o) for o in opts)
                labels.append(ord(answer) - ord("A"))
                level.append(lv)
                article_of.append(len(articles) - 1)
    if not labels:
        raise TaskDataError(
            f"{os.path.join(data_dir, split)}: no questions in the {split} split "
            f'(its {len(files)} files all have "questions": [])'
        )
    return {
        "articles": articles,
        "article_of": np.asarray(article_of, dtype=np.int64),
        "qa": qa,
        "labels": np.asarray(labels, dtype=np.int64),
        "level": np.asarray(level, dtype=np.int64),
        "files": files,
    }


def featurize(raw: dict, tokenizer, seq_length: int) -> tuple[FeatureDataset, dict]:
    art = tokenize(tokenizer, raw["articles"])
    qa = tokenize(tokenizer, raw["qa"])
    row_article = np.repeat(raw["article_of"], NUM_CHOICES)  # [n * 4]
    art_len = art.length[row_article]
    budget = seq_length - 3
    # the qa part keeps its length, or at least half the budget when both do not fit
    qa_keep = np.minimum(qa.length, np.maximum(budget // 2, budget - art_len))
    art_keep = np.minimum(art_len, budget - qa_keep)
    ids, lengths = assemble(
        [
            Segment(art.flat, art.start[row_article], art_keep),
            Segment(qa.flat, qa.start + qa.length - qa_keep, qa_keep),  # keep qa's end
        ],
        seq_length,
        tokenizer,
        ids_dtype(tokenizer.vocab_size),
    )
    n = len(raw["labels"])
    features = FeatureDataset(
        ids.reshape(n, NUM_CHOICES, seq_length),
        lengths.astype(np.int32).reshape(n, NUM_CHOICES),
        {"labels": raw["labels"]},
    )
    stats = {
        "examples": n,
        "features": n,
        "truncated": int(
            np.sum(((art_keep < art_len) | (qa_keep < qa.length)).reshape(n, -1).any(1))
        ),
        "qa_truncated": int(np.sum((qa_keep < qa.length).reshape(n, -1).any(1))),
        "files": len(raw["files"]),
        "skipped": {},  # nothing is skipped: a bad file is an error
        "middle": int(np.sum(raw["level"] == 0)),
        "high": int(np.sum(raw["level"] == 1)),
    }
    return features, stats


def load(info: TaskInfo, data_dir: str, tokenizer, options: FeatureOptions, splits) -> TaskData:
    def one(split: str):
        raw = read_race(data_dir, split)
        features, split_stats = featurize(raw, tokenizer, options.seq_length)
        gold = (raw["labels"], raw["level"])
        return features, gold, [os.path.join(data_dir, split)], split_stats

    datasets, gold, stats = load_splits(info.name, splits, one)

    def score(split: str, outputs: dict[str, np.ndarray]) -> dict[str, float]:
        labels, level = gold[split]
        pred = check_outputs(info, split, outputs, "logits", (len(labels), NUM_CHOICES)).argmax(-1)
        out = {"acc": metrics.accuracy(pred, labels)}
        for lv, name in enumerate(LEVELS):
            sel = level == lv
            out[f"acc_{name}"] = metrics.accuracy(pred[sel], labels[sel])
        return out

    return TaskData(
        info=info, train=datasets.pop("train", None), dev=datasets, stats=stats, scorer=score
    )
