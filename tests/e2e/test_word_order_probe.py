"""tools/word_order_probe.py as users run it, on a TACO and a SAS checkpoint trained briefly
by the real driver (TACO's: the session's taco_checkpoint), TACO's transformers export (remote code) and a tiny BERT
directory: the table on stdout, the JSON, CSV and PNG files. TACO's checkpoint and its
export, two independent implementations read through two tokenizers, give the same numbers;
BERT's [CLS] and final "." numbers are recomputed here from the model's outputs."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_taco.cli.export_hf import main as export_main
from megatron_taco.cli.export_hf import save_tokenizer
from megatron_taco.evaluation.figure1 import PAPER_SENTENCES, ProbeConfig, run
from tests.helpers import launch
from tests.helpers import run as run_command

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.e2e

WORDS = ["Bob", "once", "asked", "Alice", "to", "borrow", "a", "book", "."]
PAIRS = [[1, 2], [1, 3], [2, 3]]


def pretrain(script: str, data, save: Path, *extra: str) -> Path:
    launch(
        script, "--model-size", "tiny", "--seq-length", "64",
        "--data-path", data["prefix"], "--tokenizer-model", data["tokenizer"],
        "--data-cache-path", str(data["dir"] / "cache"), "--split", "80,10,10",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2",
        "--lr", "1e-3", "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters", "0",
        "--num-workers", "0", "--save", str(save), "--save-interval", "2", *extra,
        timeout=240,
    )  # fmt: skip
    return save


@pytest.fixture(scope="module")
def models(botchan_dataset, taco_checkpoint, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("probe_models")
    data = botchan_dataset
    taco = taco_checkpoint  # read only
    sas = pretrain("pretrain_sas.py", data, root / "sas")
    assert export_main(["--load", str(taco), "--output", str(root / "taco_hf")]) == 0
    # A tiny BERT (random weights) with our exported tokenizer: any transformers directory.
    bert = root / "bert"
    bert.mkdir()
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=800, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64,
    )  # fmt: skip
    transformers.BertModel(config).save_pretrained(str(bert))
    save_tokenizer(data["tokenizer"], str(bert), 64)
    return {"taco": taco, "sas": sas, "taco_hf": root / "taco_hf", "bert": bert}


def measures(v1: np.ndarray, v2: np.ndarray) -> tuple[float, float]:
    """The paper's formulas, written again: (|v1 - v2| / min(|v1|, |v2|), arccos(cos))."""
    n1, n2 = np.linalg.norm(v1), np.linalg.norm(v2)
    cos = min(max(v1 @ v2 / (n1 * n2), -1.0), 1.0)
    return np.linalg.norm(v1 - v2) / min(n1, n2), float(np.arccos(cos))


def bert_last_layer(path: Path, text: str) -> np.ndarray:
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    model = transformers.AutoModel.from_pretrained(str(path)).eval()
    with torch.no_grad():
        return model(**tok(text, return_tensors="pt")).last_hidden_state[0].double().numpy()


def by_label(report: dict, prefix: str) -> dict:
    (model,) = [m for m in report["models"] if m["label"].startswith(prefix)]
    return model


def assert_same_measures(a: dict, b: dict, rel: float = 1e-5) -> None:
    rows_a, rows_b = [*a["tokens"], *a["cls"]], [*b["tokens"], *b["cls"]]
    assert len(rows_a) == len(rows_b)
    for ra, rb in zip(rows_a, rows_b):
        assert (ra["pair"], ra.get("word")) == (rb["pair"], rb.get("word"))
        for key in ("distance", "angle_rad"):
            assert ra[key] == pytest.approx(rb[key], rel=rel, abs=1e-6), (ra, rb)


def test_probe_tool_on_our_checkpoints_and_transformers_directories(models, tmp_path):
    out = tmp_path / "probe"
    loads = [str(models[k]) for k in ("taco", "sas", "taco_hf", "bert")]
    res = run_command([
        sys.executable, "tools/word_order_probe.py", *[a for p in loads for a in ("--load", p)],
        "--trust-remote-code", "--output-dir", str(out),
    ], timeout=300)  # fmt: skip

    report = json.loads((out / "word_order_probe.json").read_text())
    assert report["sentences"] == list(PAPER_SENTENCES)
    assert [m["source"] for m in report["models"]] == loads
    for model in report["models"]:
        assert f"== {model['label']}" in res.stdout
        assert [r["pair"] for r in model["cls"]] == PAIRS
        for pair in PAIRS:  # "Once" (sentence 2) is "once" only with --case-insensitive
            shared = [w for w in WORDS if 2 not in pair or w != "once"]
            words = [r["word"] for r in model["tokens"] if r["pair"] == pair]
            skipped = [r for r in model["skipped"] if r["pair"] == pair]
            by_case = [(r["word"], r["other"]) for r in skipped if r["word"] != r["other"]]
            assert by_case == ([] if 2 not in pair else [("once", "Once")] if pair[0] == 1
                               else [("Once", "once")]), pair  # fmt: skip
            # every shared word is compared (one tokenisation in both) or skipped, with why
            retokenised = [r["word"] for r in skipped if r["word"] == r["other"]]
            assert {r["reason"] for r in skipped if r["word"] == r["other"]} <= {
                "tokenised differently"
            }
            assert sorted(words + retokenised) == sorted(shared), pair
            assert [w for w in shared if w in words] == words  # the first sentence's order
        values = [r[k] for r in model["tokens"] + model["cls"] for k in ("distance", "angle_rad")]
        assert all(np.isfinite(values)) and all(v >= 0 for v in values)

    # Our TACO checkpoint and its transformers export agree (float32 on both sides).
    assert_same_measures(by_label(report, "TACO (both)"), by_label(report, "taco (both)"))
    # BERT: [CLS] (first row) and "." (last piece before [SEP]) recomputed from its outputs.
    bert = by_label(report, "bert")
    h = [bert_last_layer(models["bert"], s) for s in PAPER_SENTENCES]
    for row in bert["cls"]:
        i, j = (k - 1 for k in row["pair"])
        d, a = measures(h[i][0], h[j][0])
        assert (row["distance"], row["angle_rad"]) == pytest.approx((d, a), rel=1e-6)
    dot = [r for r in bert["tokens"] if r["word"] == "." and r["pair"] == [1, 2]][0]
    d, a = measures(h[0][-2], h[1][-2])
    assert (dot["distance"], dot["angle_rad"]) == pytest.approx((d, a), rel=1e-6)

    with open(out / "word_order_probe.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == sum(len(m["tokens"]) + len(m["cls"]) for m in report["models"])
    assert {r["token"] for r in rows} >= {"Bob", "asked", "[CLS]"}
    from matplotlib.image import imread

    image = imread(out / "word_order_probe.png")
    assert image.ndim == 3 and image.shape[1] > 2 * image.shape[0]  # four columns side by side
    assert image[..., :3].std() > 0.05  # not blank


def test_taco_streams(models, tmp_path):
    """--taco-stream we / pe probe one stream: checkpoint and export still agree, and the
    streams differ from each other and from the complete representation."""
    loads = (str(models["taco"]), str(models["taco_hf"]))
    results = {}
    for stream in ("we", "pe", "both"):
        config = ProbeConfig(
            load=loads, taco_stream=stream, trust_remote_code=True,
            output_dir=str(tmp_path / stream),
        )  # fmt: skip
        ours, theirs = run(config)["models"]
        assert_same_measures(ours, theirs)
        results[stream] = [r["distance"] for r in ours["tokens"]]
    for a, b in (("we", "pe"), ("we", "both"), ("pe", "both")):
        assert not np.allclose(results[a], results[b], rtol=1e-3), (a, b)
