"""RACE from its released layout: rows per option, blank filling, truncation, per-level
accuracy, bad files."""

import json

import numpy as np
import pytest

from megatron_taco.tasks import TaskDataError, load_task

ARTICLE = "Tom had a red kite. He flew it in the park with his sister every day after school."
DOC = {
    "id": "middle1.txt",
    "article": ARTICLE,
    "questions": ["Tom flew the kite with _ .", "What colour was the kite?"],
    "options": [["his sister", "his dog", "a friend", "nobody"], ["red", "blue", "green", "white"]],
    "answers": ["A", "A"],
}
DOC_HIGH = {
    "article": "The park was \n closed on Sunday.",
    "questions": ["When was the park closed?"],
    "options": [["Monday", "Sunday", "Friday", "never"]],
    "answers": ["B"],
}


def write_race(root, splits=("train", "dev")):
    for split in splits:
        for level, doc in (("middle", DOC), ("high", DOC_HIGH)):
            folder = root / split / level
            folder.mkdir(parents=True)
            (folder / "1.txt").write_text(json.dumps(doc))
    return root


def test_rows_fill_blanks_and_append_options(tmp_path, tokenizer):
    data = load_task("race", write_race(tmp_path), tokenizer, seq_length=64)
    assert len(data.train) == 3 and set(data.dev) == {"dev"}
    item = data.train[0]
    assert item["input_ids"].shape == (4, 64) and item["attention_mask"].shape == (4, 64)
    art = tokenizer.encode(ARTICLE)
    for c, option in enumerate(DOC["options"][0]):
        # Megatron-LM's rule: every "_" replaced by the option
        qa = tokenizer.encode(f"Tom flew the kite with {option} .")
        row = [2, *art, 3, *qa, 3]
        assert item["input_ids"][c].tolist() == row + [0] * (64 - len(row))
        assert item["attention_mask"][c].sum().item() == len(row)
    second = data.train[1]["input_ids"][2].tolist()
    qa = tokenizer.encode("What colour was the kite? green")  # no blank: question + " " + option
    assert second[len(art) + 2 : len(art) + 2 + len(qa)] == qa
    # the high-school article's newline is a space
    high = data.train[2]["input_ids"][0].tolist()
    assert high[
        1 : 1 + len(tokenizer.encode("The park was closed on Sunday."))
    ] == tokenizer.encode("The park was closed on Sunday.")
    assert [data.train[i]["labels"].item() for i in range(3)] == [0, 0, 1]
    assert data.stats["truncated"]["train"] == 0
    assert data.stats["middle"]["train"] == 2 and data.stats["high"]["train"] == 1


def test_article_truncated_first_and_option_kept(tmp_path, tokenizer):
    data = load_task("race", write_race(tmp_path), tokenizer, seq_length=48, splits=("train",))
    art = tokenizer.encode(ARTICLE)
    budget = 48 - 3
    for c, option in enumerate(DOC["options"][0]):
        qa = tokenizer.encode(f"Tom flew the kite with {option} .")
        assert len(qa) <= budget // 2, "the qa part fits in its half of the fixture's budget"
        row = data.train[0]["input_ids"][c].tolist()
        assert row == [2, *art[: budget - len(qa)], 3, *qa, 3]
    # a question+option longer than half the room keeps its end (the option) and half the room
    data = load_task(
        "race", write_race(tmp_path / "b"), tokenizer, seq_length=12, splits=("train",)
    )
    qa = tokenizer.encode("Tom flew the kite with his sister .")
    row = data.train[0]["input_ids"][0].tolist()
    assert row == [2, *art[: 9 - 4], 3, *qa[-4:], 3]
    assert data.stats["truncated"]["train"] == 3 and data.stats["qa_truncated"]["train"] >= 1


def test_accuracy_overall_and_per_level(tmp_path, tokenizer):
    data = load_task(
        "race",
        write_race(tmp_path, ("train", "dev", "test")),
        tokenizer,
        seq_length=64,
        splits=("dev", "test"),
    )
    assert data.train is None and set(data.dev) == {"dev", "test"}
    # gold: middle A, A; high B. Predictions: A (right), C (wrong), B (right)
    logits = np.array([[3.0, 0, 0, 0], [0, 0, 2.0, 0], [0, 1.0, 0, 0]])
    assert data.score("dev", {"logits": logits}) == pytest.approx(
        {"acc": 100 * 2 / 3, "acc_middle": 50.0, "acc_high": 100.0}
    )
    with pytest.raises(ValueError, match=r"logits has shape \(3, 3\), expected \(3, 4\)"):
        data.score("dev", {"logits": logits[:, :3]})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda d: d.update(answers=["A", "E"]),
            r"middle/1\.txt: question 1: answer 'E' is not one of A, B, C, D",
        ),
        (lambda d: d["options"][0].pop(), r"middle/1\.txt: question 0: needs 4 text options"),
        (
            lambda d: d.pop("article"),
            r"middle/1\.txt: needs keys \['article', 'questions', 'options', 'answers'\]",
        ),
        (
            lambda d: d.update(answers=["A"]),
            r"middle/1\.txt: questions, options and answers must be lists of one length",
        ),
    ],
)
def test_bad_race_files_name_file_and_question(tmp_path, tokenizer, change, message):
    root = write_race(tmp_path)
    doc = json.loads(json.dumps(DOC))
    change(doc)
    (root / "train" / "middle" / "1.txt").write_text(json.dumps(doc))
    with pytest.raises(TaskDataError, match=message):
        load_task("race", root, tokenizer, seq_length=64)


def test_missing_folders_and_invalid_json(tmp_path, tokenizer):
    root = write_race(tmp_path)
    with pytest.raises(TaskDataError, match=r"test/middle: missing \(RACE layout"):
        load_task("race", root, tokenizer, seq_length=64, splits=("test",))
    (root / "dev" / "high" / "1.txt").write_text('{"article": "x",\n "questions": [}')
    with pytest.raises(TaskDataError, match=r"dev/high/1\.txt:2:\d+: not valid JSON"):
        load_task("race", root, tokenizer, seq_length=64)
