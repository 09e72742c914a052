"""tools/finetune.py as users run it: a briefly pretrained tiny TACO / SAS checkpoint
fine-tuned on learnable synthetic tasks written in the benchmarks' own layouts (the custom
TSV classification task, SQuAD's JSON, RACE's folders), through plain python, the deepspeed
launcher (tensor parallel 2 from a tensor-parallel-1 checkpoint) and torchrun (a sweep in
one process group).

* the tasks are learnt: dev accuracy >= 90% (classification), F1 and accuracy well above
  chance (span, multiple choice), while the same head on a randomly initialised encoder
  stays where the comparison says;
* a run killed mid-epoch and started again resumes and reports the same dev metrics, epoch
  by epoch, as the uninterrupted run;
* a sweep never reruns a finished run and writes its score table;
* bad input is one line naming the file or flag.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    BIN,
    deepspeed_command,
    free_port,
    kill_when,
    launch,
    run,
    write_marker_task,
    write_place_race,
    write_place_squad,
)

pytestmark = pytest.mark.e2e
PY = sys.executable


def pretrain_args(dataset, save: Path, iters: int) -> list[str]:
    return [
        "--model-size", "tiny",  # its sequence length: the preset's 64 positions
        "--data-path", dataset["prefix"], "--tokenizer-model", dataset["tokenizer"],
        "--data-cache-path", str(dataset["dir"] / "cache"), "--split", "90,5,5",
        "--micro-batch-size", "8", "--global-batch-size", "8", "--train-iters", str(iters),
        "--lr", "1e-3", "--lr-warmup-iters", "5", "--log-interval", "10", "--eval-iters", "0",
        "--num-workers", "0", "--save", str(save),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def pretrained(botchan_dataset, tmp_path_factory) -> dict[str, Path]:
    """Tiny SAS and TACO checkpoints, pretrained for 40 iterations by the real driver."""
    root = tmp_path_factory.mktemp("pretrained")
    out = {}
    for model in ("sas", "taco"):
        out[model] = root / model
        launch(f"pretrain_{model}.py", *pretrain_args(botchan_dataset, out[model], 40),
               timeout=600)  # fmt: skip
    return out


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tasks")
    write_marker_task(root / "marker")
    write_place_squad(root / "squad", version="v1.1", copies=3)
    write_place_squad(root / "squad2", version="v2.0")
    write_place_race(root / "race")
    return {p.name: p for p in root.iterdir()}


def finetune_args(load, task: str, data: Path, output: Path, *extra: str) -> list[str]:
    return [
        "tools/finetune.py", "--load", str(load), "--task", task, "--data-dir", str(data),
        # No --seq-length: each task's default (128, SQuAD 384, RACE 512) is capped at the
        # tiny model's 64 positions.
        "--output", str(output), "--micro-batch-size", "16",
        "--global-batch-size", "16", "--lr", "2e-3", "--num-workers", "0",
        "--log-interval", "10", *extra,
    ]  # fmt: skip


def results(output: Path) -> dict:
    return json.loads((output / "results.json").read_text())


@pytest.mark.parametrize("model", ["sas", "taco"])
def test_classification_is_learnt(pretrained, tasks, tmp_path, model):
    out = tmp_path / "run"
    res = run([PY, *finetune_args(pretrained[model], "custom", tasks["marker"], out,
                                  "--epochs", "3")], timeout=600)  # fmt: skip
    assert f"fine-tuning {model.upper()} on custom" in res.stdout
    # The pretrained weights were loaded: no "training from scratch" warning.
    assert "training from scratch" not in res.stderr
    assert f"starting from the pretrained {model.upper()} encoder" in res.stdout
    # Each epoch's dev line follows the train line of its iteration.
    lines = res.stdout.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(" dev at iteration "):
            iteration = int(line.split()[3])
            assert any(re.match(rf" iteration +{iteration}/", p) for p in lines[:i]), line
    r = results(out)
    assert r["finished"] and r["pretrained"]["model"] == model.upper()
    assert [e["epoch"] for e in r["epochs"]] == [1, 2, 3]
    assert r["dev"]["acc"] >= 90.0, r["epochs"]
    assert r["dev"] == {"acc": max(e["acc"] for e in r["epochs"])}  # best epoch chosen
    assert r["hyperparameters"]["lr"] == 2e-3 and r["data"]["examples"]["dev"] == 221
    assert r["hyperparameters"]["seq_length"] == 64  # the task's 128, capped
    assert (out / "loss_curve.png").stat().st_size > 0
    dev = [json.loads(line) for line in (out / "metrics.jsonl").open() if '"dev"' in line]
    assert [d["epoch"] for d in dev] == [1, 2, 3]
    assert_pipeline_reproduces_dev_accuracy(out, tasks["marker"], tmp_path / "hf", model)


# ---------------------------------------------------------------------------------------
# Fine-tuned runs exported (tools/export_hf.py) and served by transformers


def export_run(output: Path, dest: Path) -> dict:
    """OUTPUT/checkpoints exported to ``dest``; the results.json entry of the epoch whose
    checkpoint it is (the run keeps only the newest)."""
    from megatron_taco.cli.export_hf import main as export_main

    assert export_main(["--load", str(output / "checkpoints"), "--output", str(dest)]) == 0
    iteration = int((output / "checkpoints" / "latest_checkpointed_iteration.txt").read_text())
    (epoch,) = [e for e in results(output)["epochs"] if e["iteration"] == iteration]
    card = (dest / "README.md").read_text()
    assert "| this model |" in card and f"--load {output / 'checkpoints'}" in card
    return epoch


def assert_pipeline_reproduces_dev_accuracy(output: Path, data: Path, dest: Path, model: str):
    """pipeline("text-classification") on the exported folder labels dev.tsv's sentences
    with the run's own dev accuracy for that epoch (its label names are the task's)."""
    import csv

    transformers = pytest.importorskip("transformers")
    epoch = export_run(output, dest)
    with open(data / "dev.tsv", encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    pipe = transformers.pipeline("text-classification", model=str(dest),
                                 trust_remote_code=model == "taco")  # fmt: skip
    # --seq-length 64: the features were cut there
    got = pipe([r["sentence"] for r in rows], truncation=True, max_length=64)
    right = sum(g["label"] == r["label"] for g, r in zip(got, rows))
    assert {g["label"] for g in got} <= {"neg", "pos"}
    # fp32 on both sides, summed in other orders: a near-tie may flip one sentence
    assert abs(100.0 * right / len(rows) - epoch["acc"]) <= 100.0 / len(rows) + 1e-9, epoch


def test_zero3_fine_tunes_the_pretrained_weights(pretrained, tasks, tmp_path):
    """ZeRO-3 partitions the parameters after the pretrained encoder was copied in: its
    first steps must be ZeRO-0's (the marker task is learnt from a random encoder too, so
    the dev accuracy alone would not show the pretrained weights were kept)."""

    def losses(out: Path, *extra: str) -> list[float]:
        res = launch(*finetune_args(pretrained["sas"], "custom", tasks["marker"], out,
                                      "--epochs", "1", "--log-interval", "1", *extra),
                  timeout=600)  # fmt: skip
        assert results(out)["finished"]
        return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").open())
                if r["split"] == "train"][:5], res.stdout  # fmt: skip

    zero3, stdout = losses(tmp_path / "z3", "--deepspeed-config", "ds_configs/zero3_fp32.json")
    assert "ZeRO stage 3" in stdout
    zero0, _ = losses(tmp_path / "z0", "--deepspeed-config", "ds_configs/zero0_fp32.json")
    random, _ = losses(tmp_path / "r0", "--random-init")
    assert zero3 == pytest.approx(zero0, rel=1e-5)
    assert zero0[0] != pytest.approx(random[0], rel=1e-3)  # the comparison can tell them apart
    # Its ZeRO-3 checkpoint exports (zero_to_fp32's reassembly) and serves its dev accuracy.
    assert_pipeline_reproduces_dev_accuracy(
        tmp_path / "z3", tasks["marker"], tmp_path / "hf", "sas"
    )


def test_span_task_is_learnt(pretrained, tasks, tokenizer, tmp_path):
    out = tmp_path / "squad"
    launch(*finetune_args(pretrained["sas"], "squad_v1", tasks["squad"], out,
                            "--doc-stride", "24", "--epochs", "2", "--lr", "3e-3"),
        timeout=900)  # fmt: skip
    r = results(out)
    assert r["dev"]["f1"] >= 85.0, r["epochs"]
    assert set(r["dev"]) >= {"exact", "f1"}
    predictions = json.loads(
        (out / "predictions" / "dev" / "epoch2" / "predictions.json").read_text()
    )
    assert len(predictions) == r["dev"]["total"]
    # Exported (epoch 2's checkpoint): AutoModelForQuestionAnswering's logits on the dev
    # features, decoded as the run decodes them, give its answers. (transformers 5 has no
    # question-answering pipeline any more.)
    transformers = pytest.importorskip("transformers")
    assert export_run(out, tmp_path / "hf")["epoch"] == 2
    model = transformers.AutoModelForQuestionAnswering.from_pretrained(str(tmp_path / "hf"))
    data, batch = dev_features("squad_v1", tasks["squad"], tokenizer, doc_stride=24)
    with torch.no_grad():
        got = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long())
    pad = ~batch["attention_mask"].bool()
    outputs = {k: getattr(got, k).masked_fill(pad, torch.finfo(torch.float32).min).numpy()
               for k in ("start_logits", "end_logits")}  # fmt: skip
    answers = data.predict("dev", outputs)["predictions"]
    same = sum(answers[q] == predictions[q] for q in predictions)
    assert same >= len(predictions) - 1, (same, len(predictions))  # fp32 near-ties


def test_squad_v2_reports_the_official_fields(pretrained, tasks, tmp_path):
    """The official v2.0 script's fields, and their values: the evaluation (our transcription
    of evaluate-v2.0.py, tested against it in tests/unit) run again here on the files the
    run wrote (predictions.json and null_odds.json, the script's inputs) gives the reported
    scores; the question counts are the dev file's."""
    from megatron_taco.tasks import squad_v2_evaluate

    out = tmp_path / "squad2"
    launch(*finetune_args(pretrained["taco"], "squad_v2", tasks["squad2"], out,
                            "--doc-stride", "24", "--epochs", "1"), timeout=600)  # fmt: skip
    r = results(out)
    dev = r["dev"]
    for key in ("exact", "f1", "HasAns_exact", "HasAns_f1", "NoAns_exact", "NoAns_f1",
                "best_exact", "best_exact_thresh", "best_f1", "best_f1_thresh"):  # fmt: skip
        assert key in dev, key
    data = json.loads((tasks["squad2"] / "dev-v2.0.json").read_text())["data"]
    qas = [qa for a in data for p in a["paragraphs"] for qa in p["qas"]]
    unanswerable = sum(1 for qa in qas if qa["is_impossible"])
    assert 0 < unanswerable < len(qas)
    assert (dev["total"], dev["HasAns_total"], dev["NoAns_total"]) == (
        len(qas),
        len(qas) - unanswerable,
        unanswerable,
    )
    folder = out / "predictions" / "dev" / f"epoch{r['chosen_epoch']}"
    predictions = json.loads((folder / "predictions.json").read_text())
    odds = json.loads((folder / "null_odds.json").read_text())
    assert set(predictions) == set(odds) == {qa["id"] for qa in qas}
    assert squad_v2_evaluate(data, predictions, odds) == pytest.approx(dev, rel=1e-12)
    # Independent of that transcription (which scored the run too, so the line above only
    # ties the report to the files): the null odds decide the answers at the default
    # threshold 0 (no answer iff the null span beats the best by more than 0) ...
    assert all((predictions[q] == "") == (odds[q] > 0) for q in predictions)
    # ... an unanswerable question is right exactly when nothing is answered, with no text
    # normalisation involved ...
    nothing = [predictions[qa["id"]] == "" for qa in qas if qa["is_impossible"]]
    assert dev["NoAns_exact"] == pytest.approx(100.0 * sum(nothing) / len(nothing), rel=1e-12)
    assert dev["exact"] == pytest.approx(
        (dev["HasAns_exact"] * dev["HasAns_total"] + dev["NoAns_exact"] * dev["NoAns_total"])
        / dev["total"], rel=1e-12)  # fmt: skip
    # ... and the best threshold is at least as good as answering nothing at all.
    assert dev["best_exact"] >= 100.0 * unanswerable / len(qas) - 1e-9
    # best_* can only match or beat answering with the fixed threshold
    assert dev["best_f1"] >= dev["f1"] - 1e-9 and dev["best_exact"] >= dev["exact"] - 1e-9
    # the answers are spans of their contexts (or "" for no answer)
    contexts = {qa["id"]: p["context"] for a in data for p in a["paragraphs"] for qa in p["qas"]}
    assert all(text in contexts[qid] for qid, text in predictions.items())


def test_multiple_choice_is_learnt(pretrained, tasks, tokenizer, tmp_path):
    out = tmp_path / "race"
    launch(*finetune_args(pretrained["sas"], "race", tasks["race"], out, "--epochs", "1",
                            "--global-batch-size", "8", "--micro-batch-size", "8"),
        timeout=900)  # fmt: skip
    dev = results(out)["dev"]
    assert {"acc", "acc_middle", "acc_high"} <= set(dev)
    assert min(dev["acc"], dev["acc_middle"], dev["acc_high"]) >= 90.0, dev  # chance: 25%
    # Exported: AutoModelForMultipleChoice scores the dev questions with the run's accuracy.
    transformers = pytest.importorskip("transformers")
    epoch = export_run(out, tmp_path / "hf")
    model = transformers.AutoModelForMultipleChoice.from_pretrained(str(tmp_path / "hf"))
    _, batch = dev_features("race", tasks["race"], tokenizer)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"],
                       attention_mask=batch["attention_mask"].long()).logits  # fmt: skip
    acc = 100.0 * (logits.argmax(-1) == batch["labels"]).double().mean().item()
    assert abs(acc - epoch["acc"]) <= 100.0 / len(logits) + 1e-9, (acc, epoch)


def dev_features(task: str, folder: Path, tokenizer, **options):
    """The task's dev features as the runs above build them, in one padded batch."""
    from megatron_taco.tasks import load_task
    from megatron_taco.tasks.base import Collate

    data = load_task(task, folder, tokenizer, seq_length=64, splits=("dev",), **options)
    dev = data.dev["dev"]
    return data, Collate(dynamic=False)([dev[i] for i in range(len(dev))])


def test_killed_run_resumes_to_the_same_dev_metrics_at_tp2(pretrained, tasks, tmp_path):
    """2 ranks at tensor parallel 2 (the checkpoint was saved at 1), ZeRO-1, length-grouped
    batches: killed in epoch 2, the same flags resume from the epoch-1 checkpoint."""

    def args(output: Path) -> list[str]:
        # --group-by-length: the length-grouped order (and the dynamic padding it meets) is
        # a function of the seed and the position, so the resumed run reads the same batches
        return finetune_args(pretrained["taco"], "custom", tasks["marker"], output,
                             "--epochs", "3", "--tensor-model-parallel-size", "2",
                             "--deepspeed-config", "ds_configs/zero1_fp32.json",
                             "--group-by-length")  # fmt: skip

    full, crashed = tmp_path / "full", tmp_path / "crashed"
    res = launch(*args(full), world=2, timeout=900)
    assert "world size 2 = tensor parallel 2 x data parallel 1" in res.stdout
    # 663 examples at batch 16: 41 iterations per epoch; killed at 60, resumed from 41. The
    # killed one through the real deepspeed launcher, all of it killed (a node lost).
    metrics = crashed / "metrics.jsonl"
    kill_when(
        deepspeed_command(*args(crashed)),
        lambda: metrics.is_file() and '"iteration": 60,' in metrics.read_text(),
        timeout=600,
    )
    assert not results(crashed)["finished"]
    res = launch(*args(crashed), world=2, timeout=900)
    assert "resumed from" in res.stdout and "at iteration 41" in res.stdout
    a, b = results(full), results(crashed)
    assert b["finished"] and a["epochs"] == b["epochs"] and a["dev"] == b["dev"]
    assert a["hyperparameters"]["group_by_length"] is True
    train = [[r["loss"] for r in map(json.loads, (out / "metrics.jsonl").open())
              if r["split"] == "train" and r["iteration"] > 41] for out in (full, crashed)]  # fmt: skip
    assert train[0] == train[1][-len(train[0]) :]  # epochs 2 and 3: the same losses
    # A tensor-parallel-2 ZeRO-1 fine-tuned checkpoint exports and serves like a tp=1 one.
    assert_pipeline_reproduces_dev_accuracy(full, tasks["marker"], tmp_path / "hf", "taco")


def test_predict_test_writes_the_glue_servers_file_of_the_chosen_epoch(pretrained, tasks, tmp_path):
    """The marker task in SST-2's layout, its dev sentences again as test.tsv (an index
    column, no labels): SST-2.tsv in OUTPUT/submission/ has every index with a 0/1
    prediction, and those predictions score the chosen epoch's dev accuracy exactly."""
    sst2 = tmp_path / "SST-2"
    sst2.mkdir()
    gold = []
    for split in ("train", "dev"):
        lines = (tasks["marker"] / f"{split}.tsv").read_text().splitlines()[1:]
        rows = [line.rsplit("\t", 1) for line in lines]
        rows = [(text, "1" if label == "pos" else "0") for text, label in rows]
        (sst2 / f"{split}.tsv").write_text(
            "sentence\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in rows)
        )
        if split == "dev":
            gold = [y for _, y in rows]
            (sst2 / "test.tsv").write_text(
                "index\tsentence\n" + "".join(f"{10 + i}\t{t}\n" for i, (t, _) in enumerate(rows))
            )
    out = tmp_path / "run"
    res = launch(*finetune_args(pretrained["sas"], "sst2", sst2, out, "--epochs", "2",
                                  "--predict-test", "--group-by-length"), timeout=600)  # fmt: skip
    assert "submission/" in res.stdout
    r = results(out)
    assert r["submission"]["epoch"] == r["chosen_epoch"] and r["submission"]["files"] == [
        "SST-2.tsv"
    ]
    lines = (out / "submission" / "SST-2.tsv").read_text().splitlines()
    assert lines[0] == "index\tprediction"
    rows = [line.split("\t") for line in lines[1:]]
    assert [int(i) for i, _ in rows] == [10 + i for i in range(len(gold))]
    assert {p for _, p in rows} <= {"0", "1"}
    acc = 100.0 * sum(p == y for (_, p), y in zip(rows, gold)) / len(gold)
    assert acc == pytest.approx(r["dev"]["acc"], abs=1e-9)
    # A run that chose its epoch without the flag cannot submit it later: one line.
    bare = tmp_path / "bare"
    launch(*finetune_args(pretrained["sas"], "sst2", sst2, bare, "--epochs", "1"), timeout=600)
    res = launch(*finetune_args(pretrained["sas"], "sst2", sst2, bare, "--epochs", "1",
                                  "--predict-test"), check=False)  # fmt: skip
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "--predict-test: " in res.stderr.strip().splitlines()[-1]
    assert "chose epoch 1 before --predict-test was given" in res.stderr
    assert not (bare / "submission").exists()


def test_sweep_under_torchrun_skips_finished_runs(pretrained, tasks, tmp_path):
    out = tmp_path / "sweep"
    cmd = [
        str(BIN / "torchrun"), "--nproc-per-node", "2", "--master-port", str(free_port()),
        *finetune_args(pretrained["sas"], "custom", tasks["marker"], out),
        "--protocol", "sas", "--lrs", "2e-3", "1e-3", "--batch-sizes", "32",
        "--epoch-grid", "1", "--num-seeds", "1",
        "--micro-batch-size", "8", "--deepspeed-config", "ds_configs/zero1_fp32.json",
    ]  # fmt: skip
    res = run(cmd, timeout=900)
    runs = sorted(p.parent.name for p in out.glob("custom/*/results.json"))
    assert runs == ["lr0.001-bs32-ep1-seed1234", "lr0.002-bs32-ep1-seed1234"], runs
    assert res.stdout.count("sweep: run ") == 2
    summary = json.loads((out / "summary.json").read_text())
    best = summary["tasks"]["custom"]
    # The winner is the run with the higher dev accuracy in its own results.json.
    acc = {name: results(out / "custom" / f"{name}-seed1234")["dev"] for name in
           ("lr0.001-bs32-ep1", "lr0.002-bs32-ep1")}  # fmt: skip
    key = next(k for k in acc["lr0.001-bs32-ep1"] if k.endswith("acc"))
    assert best["seeds"] == 1 and best["best"] == max(acc, key=lambda n: acc[n][key]), acc
    assert "| custom |" in (out / "summary.md").read_text()
    res = run(cmd, timeout=600)
    assert "sweep: run " not in res.stdout  # both finished: nothing is run again


def test_bad_input_is_one_line(pretrained, tasks, tmp_path):
    def fails(*extra: str, data: Path = tasks["marker"], task: str = "custom") -> str:
        res = launch(*finetune_args(pretrained["sas"], task, data, tmp_path / "o", *extra),
                  check=False)  # fmt: skip
        assert res.returncode == 2, res.stderr
        assert "Traceback" not in res.stderr
        return res.stderr.strip().splitlines()[-1]

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "train.tsv").write_text("sentence\tlabel\nfine\tpos\ntoo\tmany\tcolumns\n")
    (broken / "dev.tsv").write_text("sentence\tlabel\nfine\tpos\n")
    assert "train.tsv:3" in fails(data=broken)
    (broken / "train.tsv").write_text("sentence\tlabel\nfine\tpos\n")
    (broken / "dev.tsv").unlink()
    assert "dev.tsv" in fails(data=broken)
    assert "--task" in fails(task="sst-5")
    assert "--predict-test" in fails("--predict-test")  # the custom task has no test split
    assert "--global-batch-size" in fails("--global-batch-size", "4096", "--micro-batch-size", "16")
    assert "--seq-length" in fails("--seq-length", "4096")
    (broken / "dev.tsv").write_text("sentence\tlabel\nfine\tpos\n")
    assert "at least 2" in fails(data=broken)  # one label: nothing to classify
    # No refused command claimed --output: the corrected one below runs in it.
    assert not (tmp_path / "o" / "run.json").exists()
    # An --output holding a run with other settings is refused, the run is kept.
    launch(*finetune_args(pretrained["sas"], "custom", tasks["marker"], tmp_path / "o",
                            "--epochs", "1"), timeout=600)  # fmt: skip
    assert "--output" in fails("--epochs", "1", "--lr", "1e-4")
    # Resuming with another batch order: the checkpoint's position means other batches.
    assert fails("--epochs", "1", "--group-by-length").endswith(
        "(data.group_by_length: False before, True now); give a new --output, or the same "
        "flags to resume it"
    )
    assert results(tmp_path / "o")["finished"]
