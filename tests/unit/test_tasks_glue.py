"""GLUE from the GLUE distribution's TSV folders and from Hugging Face saved splits (parquet,
JSON lines, the hub's shards), the custom TSV task, their features, errors and scores.

Fixtures are written here in each real layout: the GLUE column orders of its download script
and the hub's nyu-mll/glue column names and ClassLabel ids."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import scipy.stats
import torch
from sklearn.metrics import f1_score, matthews_corrcoef

from megatron_taco.tasks import TASKS, TaskDataError, load_task

# Per task: (text_a, text_b, label as written in the GLUE TSV, the hub's label id). Quotes are
# text (unbalanced on purpose), accents and tabs-free punctuation included.
EXAMPLES = {
    "cola": [
        ("Our friends won't buy this analysis, let alone the next one.", None, "1", 1),
        ('"They drank the pub dry.', None, "1", 1),
        ("The more we study verbs, the crazier they get get.", None, "0", 0),
        ("Café naïve is a sentence.", None, "0", 0),
    ],
    "sst2": [
        ("it 's a charming and often affecting journey . ", None, "1", 1),
        ('unflinchingly bleak and "desperate ', None, "0", 0),
        ("the acting is superb", None, "1", 1),
    ],
    "mrpc": [
        (
            "He said the foodservice pie business doesn't fit.",
            "The pie business does not fit.",
            "1",
            1,
        ),
        ('Magnarelli said Racicot hated the "Iraqi regime.', "Racicot hated it.", "0", 0),
        ("The DVD-CCA then appealed.", "The DVD CCA appealed that decision.", "1", 1),
    ],
    "stsb": [
        ("A plane is taking off.", "An air plane is taking off.", "5.000", 5.0),
        ("A man is playing a flute.", 'A man is playing a "bamboo flute.', "3.800", 3.8),
        ("A woman is dancing.", "A man is talking.", "0.000", 0.0),
    ],
    "qqp": [
        ("How is the life of a math student?", "Which level of math is the hardest?", "0", 0),
        ('What is "Quora"?', "What is Quora for?", "1", 1),
        ("Why are so many questions asked?", "Why do people ask so much?", "1", 1),
    ],
    "mnli": [
        (
            "Conceptually cream skimming has two basic dimensions.",
            "Product and geography matter.",
            "neutral",
            1,
        ),
        ("you know during the season and i guess", "You lose the things.", "entailment", 0),
        (
            'One of our number will carry out your "instructions.',
            "A member will do it.",
            "entailment",
            0,
        ),
        (
            "How do you know? All this is their information again.",
            "This has none.",
            "contradiction",
            2,
        ),
    ],
    "qnli": [
        (
            "When did the third Digimon series begin?",
            "Unlike the two seasons before it, it began.",
            "not_entailment",
            1,
        ),
        (
            "Which missile batteries often have individual launchers?",
            "When the range is short, the launchers are separate.",
            "entailment",
            0,
        ),
    ],
    "rte": [
        (
            "No Weapons of Mass Destruction Found in Iraq Yet.",
            "Weapons were found.",
            "not_entailment",
            1,
        ),
        (
            'A place of "sorrow, after Pope John Paul II died.',
            "Pope Benedict XVI is the new leader.",
            "entailment",
            0,
        ),
        ("Herceptin was already approved.", "Herceptin can be used.", "entailment", 0),
    ],
    "wnli": [
        ("I stuck a pin through a carrot.", "The carrot had a hole.", "1", 1),
        ("John couldn't see the stage with Billy in front of him.", "John is so short.", "0", 0),
    ],
}
GLUE_DIR = {
    "cola": "CoLA",
    "sst2": "SST-2",
    "mrpc": "MRPC",
    "stsb": "STS-B",
    "qqp": "QQP",
    "mnli": "MNLI",
    "qnli": "QNLI",
    "rte": "RTE",
    "wnli": "WNLI",
}
HF_COLUMNS = {
    "cola": ("sentence",),
    "sst2": ("sentence",),
    "mrpc": ("sentence1", "sentence2"),
    "stsb": ("sentence1", "sentence2"),
    "qqp": ("question1", "question2"),
    "mnli": ("premise", "hypothesis"),
    "qnli": ("question", "sentence"),
    "rte": ("sentence1", "sentence2"),
    "wnli": ("sentence1", "sentence2"),
}
MNLI_TRAIN_HEADER = [
    *("index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse"),
    *("sentence1_parse", "sentence2_parse", "sentence1", "sentence2", "label1", "gold_label"),
]
MNLI_DEV_HEADER = MNLI_TRAIN_HEADER[:-1] + ["label2", "label3", "label4", "label5", "gold_label"]


def glue_lines(task, examples, split="train"):
    """The TSV lines of the GLUE distribution for this task."""
    if task == "cola":
        return [f"gj04\t{lab}\t{'' if lab == '1' else '*'}\t{a}" for a, _, lab, _ in examples]
    if task == "sst2":
        return ["sentence\tlabel"] + [f"{a}\t{lab}" for a, _, lab, _ in examples]
    if task == "mrpc":
        return ["\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String"] + [
            f"{lab}\t{100 + i}\t{200 + i}\t{a}\t{b}" for i, (a, b, lab, _) in enumerate(examples)
        ]
    if task == "stsb":
        head = (
            "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore"
        )
        return [head] + [
            f"{i}\tmain-captions\tMSRvid\t2012test\t{i}\tnone\tnone\t{a}\t{b}\t{lab}"
            for i, (a, b, lab, _) in enumerate(examples)
        ]
    if task == "qqp":
        return ["id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate"] + [
            f"{i}\t{2 * i}\t{2 * i + 1}\t{a}\t{b}\t{lab}"
            for i, (a, b, lab, _) in enumerate(examples)
        ]
    if task == "mnli":
        header = MNLI_TRAIN_HEADER if split == "train" else MNLI_DEV_HEADER
        extra = 1 if split == "train" else 5
        return ["\t".join(header)] + [
            "\t".join(
                [
                    str(i),
                    "31193",
                    f"{i}n",
                    "government",
                    "( x )",
                    "( y )",
                    "(ROOT x)",
                    "(ROOT y)",
                    a,
                    b,
                ]
                + [lab] * extra
                + [lab]
            )
            for i, (a, b, lab, _) in enumerate(examples)
        ]
    if task == "qnli":
        return ["index\tquestion\tsentence\tlabel"] + [
            f"{i}\t{a}\t{b}\t{lab}" for i, (a, b, lab, _) in enumerate(examples)
        ]
    return ["index\tsentence1\tsentence2\tlabel"] + [
        f"{i}\t{a}\t{b}\t{lab}" for i, (a, b, lab, _) in enumerate(examples)
    ]


def write_glue(root, task, examples=None):
    folder = root / GLUE_DIR[task]
    folder.mkdir(parents=True)
    examples = examples or EXAMPLES[task]
    dev_names = ["dev_matched", "dev_mismatched"] if task == "mnli" else ["dev"]
    for split in ["train", *dev_names]:
        rows = examples if split != "dev_mismatched" else examples[::-1]
        (folder / f"{split}.tsv").write_text(
            "\n".join(glue_lines(task, rows, split)) + "\n", encoding="utf-8"
        )
    return folder


def hf_table(task, examples):
    cols = HF_COLUMNS[task]
    data = {cols[0]: [e[0] for e in examples]}
    if len(cols) == 2:
        data[cols[1]] = [e[1] for e in examples]
    label_type = pa.float32() if task == "stsb" else pa.int64()
    data["label"] = pa.array([e[3] for e in examples], type=label_type)
    data["idx"] = list(range(len(examples)))
    return pa.table(data)


def write_hf(root, task, layout, examples=None):
    """layout: "parquet" (Dataset.to_parquet per split), "jsonl" (Dataset.to_json), "hub"
    (the hub's own {config}/{split}-00000-of-00001.parquet under the glue root), "converter"
    (the hub's parquet-converter branch, {config}/{split}/0000.parquet)."""
    examples = examples or EXAMPLES[task]
    splits = (
        ["train", "validation_matched", "validation_mismatched"]
        if task == "mnli"
        else ["train", "validation"]
    )
    folder = root / task
    for split in splits:
        rows = examples if split != "validation_mismatched" else examples[::-1]
        table = hf_table(task, rows)
        if layout == "hub":
            (root / task).mkdir(parents=True, exist_ok=True)
            pq.write_table(table, root / task / f"{split}-00000-of-00001.parquet")
            folder = root
        elif layout == "converter":  # the hub's refs/convert/parquet: {config}/{split}/0000.parquet
            (root / task / split).mkdir(parents=True, exist_ok=True)
            pq.write_table(table, root / task / split / "0000.parquet")
            folder = root
        else:
            folder.mkdir(parents=True, exist_ok=True)
            if layout == "parquet":
                pq.write_table(table, folder / f"{split}.parquet")
            else:
                with open(folder / f"{split}.jsonl", "w", encoding="utf-8") as f:
                    for r in table.to_pylist():
                        f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return folder


def _all(dataset):
    return [dataset[i] for i in range(len(dataset))]


@pytest.mark.parametrize("task", list(EXAMPLES))
def test_glue_layout_reads_each_tasks_columns(tmp_path, tokenizer, task):
    folder = write_glue(tmp_path, task)
    # Room to spare: the test tokenizer is trained here, and sentencepiece 0.2.2 (the GPU
    # nodes') cuts QNLI's second pair into 66 pieces where 0.2.3 makes 62.
    seq = 96
    data = load_task(task, folder, tokenizer, seq_length=seq)
    info = TASKS[task]
    assert data.info == info and set(data.dev) == set(info.dev_splits)
    examples = EXAMPLES[task]
    items = _all(data.train)
    assert len(items) == len(examples) == data.stats["examples"]["train"]
    for item, (a, b, _, label) in zip(items, examples):
        # [CLS] A [SEP] (B [SEP]) with no token-type ids; quotes kept as text
        expect = [tokenizer.cls_id, *tokenizer.encode(a), tokenizer.sep_id]
        if b is not None:
            expect += [*tokenizer.encode(b), tokenizer.sep_id]
        n = len(expect)
        assert item["input_ids"].tolist() == expect + [tokenizer.pad_id] * (seq - n)
        assert item["attention_mask"].tolist() == [True] * n + [False] * (seq - n)
        if task == "stsb":
            assert item["labels"].dtype == torch.float32 and item["labels"].item() == pytest.approx(
                label
            )
        else:
            assert item["labels"].dtype == torch.int64 and item["labels"].item() == label
        assert item["input_ids"].dtype == torch.int64 and item["attention_mask"].dtype == torch.bool
    assert [it["index"].item() for it in items] == list(range(len(items)))
    assert data.stats["truncated"]["train"] == 0
    if task == "mnli":
        mm = _all(data.dev["dev_mismatched"])
        assert [it["labels"].item() for it in mm] == [e[3] for e in examples[::-1]]


def test_label_ids_follow_the_hub(tmp_path, tokenizer):
    """Spot checks of the hub's ClassLabel order, written out (not read from TASKS)."""
    assert TASKS["mnli"].labels == ("entailment", "neutral", "contradiction")
    assert TASKS["rte"].labels == ("entailment", "not_entailment")
    assert TASKS["qnli"].labels == ("entailment", "not_entailment")
    assert TASKS["wnli"].labels == ("not_entailment", "entailment")
    assert TASKS["cola"].labels == ("unacceptable", "acceptable")
    mnli = load_task(
        "mnli", write_glue(tmp_path, "mnli"), tokenizer, seq_length=64, splits=("train",)
    )
    # neutral, entailment, entailment, contradiction
    assert [it["labels"].item() for it in _all(mnli.train)] == [1, 0, 0, 2]


@pytest.mark.parametrize("layout", ["parquet", "jsonl", "hub", "converter"])
@pytest.mark.parametrize("task", list(EXAMPLES))
def test_hf_layout_gives_the_same_features_and_labels(tmp_path, tokenizer, task, layout):
    glue = load_task(task, write_glue(tmp_path / "glue", task), tokenizer, seq_length=32)
    hf = load_task(task, write_hf(tmp_path / "hf", task, layout), tokenizer, seq_length=32)
    assert hf.info == glue.info
    for split in ("train", *TASKS[task].dev_splits):
        a = glue.train if split == "train" else glue.dev[split]
        b = hf.train if split == "train" else hf.dev[split]
        np.testing.assert_array_equal(a.input_ids, b.input_ids)
        np.testing.assert_array_equal(a.lengths, b.lengths)
        np.testing.assert_array_equal(a.targets["labels"], b.targets["labels"])
        assert a.targets["labels"].dtype == b.targets["labels"].dtype


def test_truncation_longest_first_is_counted(tmp_path, tokenizer):
    long = "the cat sat on the mat and looked at the dog for a long while " * 3
    examples = [
        (long, "short one.", "entailment", 0),
        ("tiny", "also tiny", "entailment", 0),
        ("short one.", long, "entailment", 0),
    ]
    folder = write_glue(tmp_path, "rte", examples)
    data = load_task("rte", folder, tokenizer, seq_length=16, splits=("train",))
    assert data.stats["truncated"]["train"] == 2
    b = tokenizer.encode("short one.")
    # the long side gives way: the short one stays whole, the long fills the rest of 16 - 3
    assert data.train[0]["input_ids"].tolist() == [
        2,
        *tokenizer.encode(long)[: 13 - len(b)],
        3,
        *b,
        3,
    ]
    assert data.train[2]["input_ids"].tolist() == [
        2,
        *b,
        3,
        *tokenizer.encode(long)[: 13 - len(b)],
        3,
    ]


def test_qqp_malformed_rows_are_counted_and_skipped(tmp_path, tokenizer):
    folder = write_glue(tmp_path, "qqp")
    path = folder / "train.tsv"
    lines = path.read_text().splitlines()
    # the released file's kind of damage: a question broken by a newline
    lines.insert(2, "77\t154\t155\tHow do I")
    lines.insert(3, "learn?\tWhat is it?\t0")
    path.write_text("\n".join(lines) + "\n")
    data = load_task("qqp", folder, tokenizer, seq_length=32)
    assert data.stats["skipped"]["train"] == {"malformed_row": 2}
    assert len(data.train) == len(EXAMPLES["qqp"])
    # The same damage in the dev split is an error: its score would be on a subset.
    dev = folder / "dev.tsv"
    lines = dev.read_text().splitlines()
    lines.insert(3, "77\t154\t155\tHow do I")
    dev.write_text("\n".join(lines) + "\n")
    with pytest.raises(
        TaskDataError,
        match=r"dev\.tsv:4: 4 tab-separated columns, the qqp layout has 6 .*"
        r"rows of the dev split are never skipped$",
    ):
        load_task("qqp", folder, tokenizer, seq_length=32)


def test_stsb_tab_inside_a_sentence_and_score_out_of_range_name_the_line(tmp_path, tokenizer):
    folder = write_glue(tmp_path, "stsb")
    path = folder / "dev.tsv"
    good = path.read_text()
    lines = good.splitlines()
    # a tab inside sentence2: reading columns from the end would keep a fragment of it
    lines[2] = lines[2].replace("bamboo", "bam\tboo")
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(
        TaskDataError,
        match=r"dev\.tsv:3: 11 tab-separated columns, the stsb layout has 10 \(index, .*\); "
        "a tab inside a field",
    ):
        load_task("stsb", folder, tokenizer, seq_length=32)
    lines = good.splitlines()
    lines[3] = lines[3].rsplit("\t", 1)[0] + "\t17"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TaskDataError, match=r"dev\.tsv:4: score '17' is outside stsb's range 0-5$"):
        load_task("stsb", folder, tokenizer, seq_length=32)
    folder = write_hf(tmp_path / "hf", "stsb", "jsonl")
    with open(folder / "validation.jsonl", "a") as f:
        f.write('{"sentence1": "x", "sentence2": "y", "label": -0.5, "idx": 9}\n')
    with pytest.raises(TaskDataError, match=r"validation\.jsonl:4: score -0\.5 is outside"):
        load_task("stsb", folder, tokenizer, seq_length=32)


@pytest.mark.parametrize(
    ("task", "edit", "message"),
    [
        (
            "rte",
            lambda ls: ls[:2] + ["5\tonly two columns"] + ls[2:],
            r"train\.tsv:3: 2 tab-separated columns, the rte layout has 4",
        ),
        (
            "mnli",
            lambda ls: ls[:3] + [ls[3].rsplit("\t", 1)[0] + "\tmaybe"] + ls[4:],
            r"train\.tsv:4: unknown label 'maybe' for mnli",
        ),
        (
            "cola",
            lambda ls: ls + ["gj04\t2\t\tA sentence."],
            r"train\.tsv:5: unknown label '2' for cola",
        ),
        (
            "stsb",
            lambda ls: ls[:1] + [ls[1].rsplit("\t", 1)[0] + "\tfive"] + ls[2:],
            r"train\.tsv:2: score 'five' is not a number",
        ),
        (
            "sst2",
            lambda ls: ["sentence\tscore"] + ls[1:],
            r"train\.tsv:1: header lacks column\(s\) \['label'\]",
        ),
    ],
)
def test_malformed_glue_lines_name_file_and_line(tmp_path, tokenizer, task, edit, message):
    folder = write_glue(tmp_path, task)
    path = folder / "train.tsv"
    path.write_text("\n".join(edit(path.read_text().splitlines())) + "\n")
    with pytest.raises(TaskDataError, match=message):
        load_task(task, folder, tokenizer, seq_length=32)


def test_undecodable_line_is_named(tmp_path, tokenizer):
    folder = write_glue(tmp_path, "sst2")
    with open(folder / "dev.tsv", "ab") as f:
        f.write(b"caf\xe9\t1\n")
    with pytest.raises(TaskDataError, match=r"dev\.tsv:5: not UTF-8"):
        load_task("sst2", folder, tokenizer, seq_length=32)


def test_missing_split_names_what_was_looked_for(tmp_path, tokenizer):
    folder = write_glue(tmp_path, "rte")
    (folder / "dev.tsv").unlink()
    with pytest.raises(
        TaskDataError, match=r"no dev split of rte: looked for dev\.tsv .*validation\.parquet"
    ):
        load_task("rte", folder, tokenizer, seq_length=32)
    # a split not requested is not needed
    assert load_task("rte", folder, tokenizer, seq_length=32, splits=("train",)).dev == {}


def test_hf_errors_name_file_and_record(tmp_path, tokenizer):
    folder = write_hf(tmp_path / "a", "rte", "jsonl")
    with open(folder / "train.jsonl", "a") as f:
        f.write('{"sentence1": "x", "sentence2": "y", "label": -1, "idx": 9}\n')
    with pytest.raises(
        TaskDataError, match=r"train\.jsonl:4: unknown label -1 .*unlabelled test split"
    ):
        load_task("rte", folder, tokenizer, seq_length=32)
    with open(folder / "train.jsonl", "w") as f:
        f.write('{"sentence1": "x", "label": 0}\n')
    with pytest.raises(
        TaskDataError, match=r"train\.jsonl:1: needs keys \['sentence1', 'sentence2', 'label'\]"
    ):
        load_task("rte", folder, tokenizer, seq_length=32)
    with open(folder / "train.jsonl", "w") as f:
        f.write('{"sentence1": "x", "sentence2": \n')
    with pytest.raises(TaskDataError, match=r"train\.jsonl:1: not a JSON object"):
        load_task("rte", folder, tokenizer, seq_length=32)
    folder = write_hf(tmp_path / "b", "mrpc", "parquet")
    pq.write_table(pa.table({"premise": ["a"], "label": [0]}), folder / "validation.parquet")
    with pytest.raises(
        TaskDataError, match=r"validation\.parquet: no column\(s\) \['sentence1', 'sentence2'\]"
    ):
        load_task("mrpc", folder, tokenizer, seq_length=32)


def test_stsb_refuses_boolean_labels(tmp_path, tokenizer):
    # float(True) == 1.0: a JSON true (or a parquet bool column) must not read as score 1
    folder = write_hf(tmp_path / "a", "stsb", "jsonl")
    with open(folder / "validation.jsonl", "a") as f:
        f.write('{"sentence1": "x", "sentence2": "y", "label": true, "idx": 9}\n')
    with pytest.raises(
        TaskDataError, match=r"validation\.jsonl:4: score True is a boolean, not a number"
    ):
        load_task("stsb", folder, tokenizer, seq_length=32)
    folder = write_hf(tmp_path / "b", "stsb", "parquet")
    table = pa.table({"sentence1": ["a", "b"], "sentence2": ["c", "d"], "label": [False, True]})
    pq.write_table(table, folder / "train.parquet")
    with pytest.raises(
        TaskDataError, match=r"train\.parquet: row 0: score False is a boolean, not a number"
    ):
        load_task("stsb", folder, tokenizer, seq_length=32)


def _logits(rng, n, c):
    return rng.normal(size=(n, c))


@pytest.mark.parametrize(
    "task", ["cola", "sst2", "mrpc", "qqp", "qnli", "rte", "wnli", "mnli", "stsb"]
)
def test_scores_match_sklearn_and_scipy(tmp_path, tokenizer, task):
    rng = np.random.default_rng(0)
    base = EXAMPLES[task]
    # a bigger dev set: the fixture's rows with random labels of the task
    n = 60
    if task == "stsb":
        rows = [
            (base[i % 3][0], base[i % 3][1], f"{v:.3f}", float(f"{v:.3f}"))
            for i, v in enumerate(rng.uniform(0, 5, n))
        ]
    else:
        names = TASKS[task].labels
        numeric = task in ("cola", "sst2", "mrpc", "qqp", "wnli")
        ids = rng.integers(0, len(names), n)
        rows = [
            (
                base[i % len(base)][0],
                base[i % len(base)][1],
                str(k) if numeric else names[k],
                int(k),
            )
            for i, k in enumerate(ids)
        ]
    data = load_task(task, write_glue(tmp_path, task, rows), tokenizer, seq_length=48)
    gold = np.array([r[3] for r in rows])
    for split in data.info.dev_splits:
        g = gold if split != "dev_mismatched" else gold[::-1]
        if task == "stsb":
            pred = g + rng.normal(0, 1.5, n)
            out = data.score(split, {"predictions": pred})
            assert out["pearson"] == pytest.approx(100 * scipy.stats.pearsonr(g, pred)[0])
            assert out["spearman"] == pytest.approx(100 * scipy.stats.spearmanr(g, pred)[0])
            assert out["pearson_spearman_mean"] == pytest.approx(
                (out["pearson"] + out["spearman"]) / 2
            )
            continue
        logits = _logits(rng, n, data.info.num_labels)
        pred = logits.argmax(-1)
        out = data.score(split, {"logits": logits})
        assert list(out) == list(data.info.metrics)
        if task == "cola":
            assert out["mcc"] == pytest.approx(100 * matthews_corrcoef(g, pred))
        elif task in ("mrpc", "qqp"):
            assert out["f1"] == pytest.approx(100 * f1_score(g, pred))
            assert out["acc"] == pytest.approx(100 * np.mean(g == pred))
            assert out["f1_acc_mean"] == pytest.approx((out["f1"] + out["acc"]) / 2)
        else:
            assert out["acc"] == pytest.approx(100 * np.mean(g == pred))
    with pytest.raises(ValueError, match="shape"):
        key = "predictions" if task == "stsb" else "logits"
        data.score(data.info.dev_splits[0], {key: np.zeros((n - 1, data.info.num_labels))})


def test_custom_task_discovers_sorted_labels(tmp_path, tokenizer):
    (tmp_path / "train.tsv").write_text(
        "sentence\tlabel\nthe cat sat\tswapped\nthe dog ran\toriginal\nit rained\tswapped\n"
    )
    (tmp_path / "dev.tsv").write_text(
        "sentence\tlabel\ncat the sat\tswapped\nthe dog ran\toriginal\n"
    )
    data = load_task("custom", tmp_path, tokenizer, seq_length=16)
    assert data.info.labels == ("original", "swapped") and data.info.num_labels == 2
    assert [it["labels"].item() for it in _all(data.train)] == [1, 0, 1]
    assert data.score("dev", {"logits": np.array([[0.0, 1.0], [0.0, 1.0]])}) == {"acc": 50.0}
    (tmp_path / "dev.tsv").write_text("sentence1\tsentence2\tlabel\na\tb\ty\n")
    (tmp_path / "train.tsv").write_text("sentence1\tsentence2\tlabel\na\tb\tx\nc\td\ty\n")
    pair = load_task("custom", tmp_path, tokenizer, seq_length=16)
    (tmp_path / "dev.tsv").write_text("sentence1\tsentence2\tlabel\na\tb\tswapped\n")
    row = [2, *tokenizer.encode("a"), 3, *tokenizer.encode("b"), 3]
    assert pair.train[0]["input_ids"].tolist() == row + [0] * (16 - len(row))
    with pytest.raises(
        TaskDataError, match=r"dev\.tsv:2: label 'swapped' does not occur in train\.tsv"
    ):
        load_task("custom", tmp_path, tokenizer, seq_length=16)
    (tmp_path / "train.tsv").write_text("text\tlabel\na\tb\n")
    with pytest.raises(TaskDataError, match=r"train\.tsv:1: header must name 'sentence'"):
        load_task("custom", tmp_path, tokenizer, seq_length=16)


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (
            "sentence\tsentence\tlabel",
            r"train\.tsv:1: the header names column 'sentence' 2 times \(columns 1, 2\)",
        ),
        ("sentence\tlabel\tlabel", r"train\.tsv:1: the header names column 'label' 2 times"),
        ("id\tsentence\tid\tlabel", r"train\.tsv:1: the header names column 'id' 2 times"),
        (
            "sentence1\tsentence2\tsentence2\tlabel",
            r"train\.tsv:1: the header names column 'sentence2' 2 times \(columns 2, 3\)",
        ),
        ("sentence\tsentence1\tlabel", r"train\.tsv:1: header names both 'sentence' and"),
    ],
)
def test_custom_header_must_name_each_column_once(tmp_path, tokenizer, header, message):
    # two "sentence" columns used to read as a single-sentence task from the first of them
    ncol = header.count("\t") + 1
    row = "\t".join(["a"] * (ncol - 1) + ["x"])
    for split in ("train", "dev"):
        (tmp_path / f"{split}.tsv").write_text(f"{header}\n{row}\n")
    with pytest.raises(TaskDataError, match=message):
        load_task("custom", tmp_path, tokenizer, seq_length=16)


def test_glue_header_naming_a_used_column_twice_is_refused(tmp_path, tokenizer):
    folder = write_glue(tmp_path, "qnli")
    path = folder / "train.tsv"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(["index\tquestion\tquestion\tlabel"] + lines[1:]) + "\n")
    with pytest.raises(
        TaskDataError,
        match=r"train\.tsv:1: the header names column 'question' 2 times \(columns 2, 3\)",
    ):
        load_task("qnli", folder, tokenizer, seq_length=32)
    # an unused column named twice is harmless in a GLUE file
    path.write_text(
        "\n".join(
            ["index\tquestion\tsentence\tlabel\tx\tx"] + [line + "\t\t" for line in lines[1:]]
        )
        + "\n"
    )
    assert len(load_task("qnli", folder, tokenizer, seq_length=32).train) == len(lines) - 1


def test_empty_split_and_bad_arguments(tmp_path, tokenizer):
    folder = write_glue(tmp_path, "qnli")
    (folder / "dev.tsv").write_text("index\tquestion\tsentence\tlabel\n")
    with pytest.raises(TaskDataError, match=r"dev\.tsv: no examples in the dev split"):
        load_task("qnli", folder, tokenizer, seq_length=32)
    with pytest.raises(ValueError, match="unknown task 'glue'"):
        load_task("glue", folder, tokenizer, seq_length=32)
    with pytest.raises(
        ValueError, match=r"splits \['validation'\] must be among \['train', 'dev', 'test'\]"
    ):
        load_task("qnli", folder, tokenizer, seq_length=32, splits=("validation",))
    with pytest.raises(TaskDataError, match="no such directory"):
        load_task("qnli", tmp_path / "nowhere", tokenizer, seq_length=32)
    with pytest.raises(ValueError, match="seq_length must be at least 4"):
        load_task("qnli", folder, tokenizer, seq_length=3)


# ---------------------------------------------------------------------------------------
# Test splits and the GLUE server's files

# The test files' headers as the GLUE distribution has them (download_glue_data.py): an
# index column ("index", QQP's "id") and the text columns, no label; CoLA's test file has a
# header although its train and dev files do not.
TEST_HEADERS = {
    "cola": ["index", "sentence"],
    "sst2": ["index", "sentence"],
    "mrpc": ["index", "#1 ID", "#2 ID", "#1 String", "#2 String"],
    "stsb": ["index", "genre", "filename", "year", "old_index", "source1", "source2",
             "sentence1", "sentence2"],
    "qqp": ["id", "question1", "question2"],
    "mnli": ["index", "promptID", "pairID", "genre", "sentence1_binary_parse",
             "sentence2_binary_parse", "sentence1_parse", "sentence2_parse", "sentence1",
             "sentence2"],
    "qnli": ["index", "question", "sentence"],
    "rte": ["index", "sentence1", "sentence2"],
    "wnli": ["index", "sentence1", "sentence2"],
}  # fmt: skip
TEXT_COLUMNS = {
    "cola": ("sentence",), "sst2": ("sentence",), "mrpc": ("#1 String", "#2 String"),
    "stsb": ("sentence1", "sentence2"), "qqp": ("question1", "question2"),
    "mnli": ("sentence1", "sentence2"), "qnli": ("question", "sentence"),
    "rte": ("sentence1", "sentence2"), "wnli": ("sentence1", "sentence2"),
}  # fmt: skip
# What the server reads (the GLUE sample submission): ids for CoLA, SST-2, MRPC, QQP, WNLI;
# names for MNLI (and AX), QNLI, RTE; STS-B a score.
SERVER_LABELS = {
    "cola": ["0", "1"], "sst2": ["0", "1"], "mrpc": ["0", "1"], "qqp": ["0", "1"],
    "wnli": ["0", "1"], "mnli": ["entailment", "neutral", "contradiction"],
    "qnli": ["entailment", "not_entailment"], "rte": ["entailment", "not_entailment"],
}  # fmt: skip
FILES = {"cola": "CoLA.tsv", "sst2": "SST-2.tsv", "mrpc": "MRPC.tsv", "stsb": "STS-B.tsv",
         "qqp": "QQP.tsv", "qnli": "QNLI.tsv", "rte": "RTE.tsv", "wnli": "WNLI.tsv"}  # fmt: skip


def write_test_tsv(path, header, text_columns, examples, first_index=100):
    rows = []
    for k, (a, b, _, _) in enumerate(examples):
        values = {c: f"x{k}" for c in header}
        values[header[0]] = str(first_index + 3 * k)  # indices as written, not row numbers
        values[text_columns[0]] = a
        if len(text_columns) > 1:
            values[text_columns[1]] = b
        rows.append("\t".join(values[c] for c in header))
    path.write_text("\n".join(["\t".join(header), *rows]) + "\n", encoding="utf-8")


@pytest.mark.parametrize("task", list(EXAMPLES))
def test_test_split_gives_the_glue_servers_file(tmp_path, tokenizer, task):
    folder = write_glue(tmp_path, task)
    examples = EXAMPLES[task]
    info = TASKS[task]
    splits = info.test_splits
    files = {"test": FILES.get(task)}
    if task == "mnli":
        write_test_tsv(folder / "test_matched.tsv", TEST_HEADERS[task], TEXT_COLUMNS[task],
                       examples)  # fmt: skip
        write_test_tsv(folder / "test_mismatched.tsv", TEST_HEADERS[task], TEXT_COLUMNS[task],
                       examples[::-1], first_index=0)  # fmt: skip
        (tmp_path / "diagnostic").mkdir()
        write_test_tsv(tmp_path / "diagnostic" / "diagnostic.tsv",
                       ["index", "sentence1", "sentence2"], ("sentence1", "sentence2"),
                       examples[:2], first_index=0)  # fmt: skip
        files = {"test_matched": "MNLI-m.tsv", "test_mismatched": "MNLI-mm.tsv",
                 "diagnostic": "AX.tsv"}  # fmt: skip
    else:
        write_test_tsv(folder / "test.tsv", TEST_HEADERS[task], TEXT_COLUMNS[task], examples)
    data = load_task(task, folder, tokenizer, seq_length=32, splits=("train", *splits))
    assert set(data.test) == set(splits) and set(data.dev) == set()
    rng = np.random.default_rng(0)
    for split in splits:
        rows = {"test_mismatched": examples[::-1], "diagnostic": examples[:2]}.get(split, examples)
        first = 0 if split in ("test_mismatched", "diagnostic") else 100
        features = data.test[split]
        assert len(features) == len(rows) and "labels" not in features[0]
        # feature k is the labelled layout's feature of row k's texts: the predictions the
        # server file pairs with row k's index are of row k's example
        for k, example in enumerate(rows):
            same = data.train[examples.index(example)]["input_ids"]
            assert features[k]["input_ids"].tolist() == same.tolist(), (split, k)
        if task == "stsb":
            outputs = {"predictions": rng.uniform(0, 5, len(rows))}
            want = [f"{v:.3f}" for v in outputs["predictions"]]
        else:
            outputs = {"logits": rng.normal(size=(len(rows), info.num_labels))}
            want = [SERVER_LABELS[task][i] for i in outputs["logits"].argmax(-1)]
        name, text = data.submission(split, outputs)
        assert name == files[split]
        lines = text.splitlines()
        assert lines[0] == "index\tprediction" and text.endswith("\n")
        assert lines[1:] == [f"{first + 3 * k}\t{v}" for k, v in enumerate(want)]


def test_test_splits_are_read_whole_or_refused(tmp_path, tokenizer):
    folder = write_glue(tmp_path, "rte")
    path = folder / "test.tsv"
    write_test_tsv(path, TEST_HEADERS["rte"], TEXT_COLUMNS["rte"], EXAMPLES["rte"])
    lines = path.read_text().splitlines()
    path.write_text("\n".join([*lines, "9\tonly one"]) + "\n")
    with pytest.raises(TaskDataError, match=r"test\.tsv:5: 2 tab-separated columns.*never skipped"):
        load_task("rte", folder, tokenizer, seq_length=32, splits=("test",))
    path.write_text("\n".join(["sentence1\tsentence2", *(x.split("\t", 1)[1] for x in lines[1:])]))
    with pytest.raises(TaskDataError, match=r"test\.tsv:1: header lacks column\(s\) \['index'\]"):
        load_task("rte", folder, tokenizer, seq_length=32, splits=("test",))
    # The server pairs predictions with examples by index: a repeated or empty one is refused.
    path.write_text("\n".join([*lines, lines[2].replace("103", "100", 1)]) + "\n")
    with pytest.raises(TaskDataError, match=r"test\.tsv:5: index '100' repeats line 2; the GLUE"):
        load_task("rte", folder, tokenizer, seq_length=32, splits=("test",))
    path.write_text("\n".join([*lines, "\tone\ttwo"]) + "\n")
    with pytest.raises(TaskDataError, match=r"test\.tsv:5: empty index"):
        load_task("rte", folder, tokenizer, seq_length=32, splits=("test",))
    path.unlink()
    with pytest.raises(TaskDataError, match=r"no test split of rte \(--predict-test\)"):
        load_task("rte", folder, tokenizer, seq_length=32, splits=("test",))
    mnli = write_glue(tmp_path, "mnli")
    with pytest.raises(TaskDataError, match=r"no diagnostic split of mnli.*diagnostic\.tsv"):
        load_task("mnli", mnli, tokenizer, seq_length=32, splits=("diagnostic",))


def test_hf_test_splits_use_the_hubs_idx(tmp_path, tokenizer):
    folder = write_hf(tmp_path, "qnli", "parquet")
    table = hf_table("qnli", EXAMPLES["qnli"]).to_pydict()
    table["label"] = [-1] * len(EXAMPLES["qnli"])
    table["idx"] = [7, 8]
    pq.write_table(pa.table(table), folder / "test.parquet")
    data = load_task("qnli", folder, tokenizer, seq_length=32, splits=("test",))
    _, text = data.submission("test", {"logits": np.array([[0.0, 1.0], [1.0, 0.0]])})
    assert text == "index\tprediction\n7\tnot_entailment\n8\tentailment\n"
    table["idx"] = [7, 7]
    pq.write_table(pa.table(table), folder / "test.parquet")
    with pytest.raises(TaskDataError, match=r"test\.parquet: row 1: index '7' repeats .*row 0"):
        load_task("qnli", folder, tokenizer, seq_length=32, splits=("test",))


# A test split is read as the server's input: no row of it is skipped or counted as such,
# and its errors keep their own line (the merged reader must not give it the train split's).
class _WordTok:
    cls_id, sep_id, pad_id, vocab_size = 1, 2, 0, 100

    def encode_batch(self, texts):
        return [[3 + len(w) % 90 for w in t.split()] for t in texts]


def _rte(tmp_path, test_rows):
    d = tmp_path / "rte"
    d.mkdir()
    (d / "train.tsv").write_text("index\tsentence1\tsentence2\tlabel\n0\ta b\tc\tentailment\n")
    (d / "test.tsv").write_text("index\tsentence1\tsentence2\n" + test_rows)
    return d


def test_a_split_named_twice_still_loads(tmp_path):
    d = _rte(tmp_path, "0\ta b\tc d\n1\te\tf\n")
    data = load_task("rte", d, _WordTok(), seq_length=16, splits=("train", "test", "test"))
    assert set(data.test) == {"test"}


def test_a_test_row_with_too_many_columns_keeps_its_line(tmp_path):
    d = _rte(tmp_path, "0\ta b\tc d\n1\te\tf\textra\n")
    with pytest.raises(TaskDataError) as e:
        load_task("rte", d, _WordTok(), seq_length=16, splits=("test",))
    assert "a tab inside a field" not in str(e.value)


def test_a_test_split_counts_no_skipped_rows(tmp_path):
    d = _rte(tmp_path, "0\ta b\tc d\n\n1\te\tf\n")
    data = load_task("rte", d, _WordTok(), seq_length=16, splits=("test",))
    assert data.stats["skipped"]["test"] == {}
