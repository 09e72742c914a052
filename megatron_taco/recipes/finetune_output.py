"""A fine-tuning run's --output: run.json records what makes the run this run, so that the
same command resumes it and any other is refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from megatron_taco import io
from megatron_taco.errors import ConfigError
from megatron_taco.recipes.finetune_eval import RESULTS_FILE
from megatron_taco.recipes.sweep_summary import read_result

RUN_FILE = "run.json"  # what OUTPUT was started with: a restart must match it
CHECKPOINTS = "checkpoints"


def check_test_predictable(output: str) -> None:
    """--predict-test given to a run in --output that chose an epoch without it: a resumed
    run cannot go back to that epoch's model, so unless a later epoch overtakes it the run
    would end without the test files, silently (a finished run at once). Refused, unless a
    later epoch is sure to be the chosen one (--epoch-selection last, not finished)."""
    path = os.path.join(output, RESULTS_FILE)
    if not os.path.isfile(path):
        return
    results, _ = read_result(path)  # unreadable: the run rewrites it
    if not results or results.get("chosen_epoch") is None:
        return
    if results.get("selection") == "last" and not results["finished"]:
        return
    chosen, written = results["chosen_epoch"], (results.get("submission") or {}).get("epoch")
    if written != chosen:
        raise ConfigError(
            f"--predict-test: {output} chose epoch {chosen} before --predict-test was given, "
            "and a resumed run cannot go back to that epoch's model; fine-tune into a new "
            "--output with --predict-test to submit"
        )


def run_record(cfg) -> dict[str, Any]:
    """What makes a run this run (run.json): a later command with --output resumes it only
    if it records the same."""
    ft = cfg.recipe.finetune
    return {
        "pretrained": dataclasses.asdict(cfg.recipe.pretrained),
        # Where the run lives, how many workers read its data and whether it also predicts
        # the test split do not change the run.
        "finetune": {k: v for k, v in dataclasses.asdict(ft).items() if k != "output"},
        "data": {
            k: v
            for k, v in dataclasses.asdict(cfg.data).items()
            if k not in ("num_workers", "predict_test")
        },
        "training": dataclasses.asdict(cfg.training),
        "deepspeed": {"zero_stage": cfg.deepspeed.zero_stage, "precision": cfg.deepspeed.precision},
        "tensor_model_parallel_size": cfg.parallel.tensor_model_parallel_size,
    }


def claim_output(output: str, run: dict[str, Any], *, write: bool) -> None:
    """A new --output, or the same run again (it resumes); anything else is refused. Every
    rank checks, rank 0 writes run.json: its half-written file (io.atomic_write's
    ``run.json.<random>.tmp``) is not counted, and the listing is taken before run.json is read, so a rank checking while rank 0 renames it
    into place sees either no run.json or the whole of it. An empty checkpoints/ is what a
    refused command may have left (the save directory is test-written before the task's
    files are read), so it does not make --output foreign."""

    def half_written(name: str) -> bool:
        return name.startswith(f"{RUN_FILE}.") and name.endswith(".tmp")

    try:
        names = [n for n in os.listdir(output) if not half_written(n)]
    except FileNotFoundError:
        names = []
    except OSError as e:
        raise ConfigError(f"--output: {output} cannot be listed ({e.strerror or e})") from None
    save = os.path.join(output, CHECKPOINTS)
    # Another rank's write test (check_save_dir) may be in there right now.
    if (
        CHECKPOINTS in names
        and os.path.isdir(save)
        and all(n.startswith(".write_test.") for n in os.listdir(save))
    ):
        names.remove(CHECKPOINTS)
    path = os.path.join(output, RUN_FILE)
    if RUN_FILE in names:
        try:
            with open(path, encoding="utf-8") as f:
                saved = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--output: {path} is unreadable ({e})") from None
        saved, now = _by_content(saved), _by_content(json.loads(json.dumps(run)))
        if saved != now:
            diff = _first_difference(saved, now)
            raise ConfigError(
                f"--output: {output} holds a run with other settings ({diff}); give a new "
                "--output, or the same flags to resume it"
            )
        return
    if names:
        raise ConfigError(f"--output: {output} exists, is not empty and holds no {RUN_FILE}")
    if not write or int(os.environ.get("RANK", "0")) != 0:
        return  # rank 0 writes it; the others only check
    os.makedirs(output, exist_ok=True)
    io.atomic_write(path, json.dumps(run, indent=2, sort_keys=True))


# What run.json's "training" held before the checkpoint flags left TrainingConfig (issue
# 35): a run interrupted before then resumes, those being the ones this recipe sets itself.
_MOVED_TO_CHECKPOINT = (
    "save",
    "save_interval",
    "load",
    "ckpt_step",
    "finetune",
    "no_load_optim",
    "no_load_rng",
)


def _by_content(run: Any) -> Any:
    """A run record without its tokenizer's path: the same tokenizer at another path (the
    pretrained checkpoint's copy, or the original) resumes the run. Its content is checked
    against the pretrained checkpoint (checkpoint_tokenizer) and, once the run has saved,
    against its own checkpoint (plan_resume's tokenizer check)."""
    if not isinstance(run, dict):
        return run
    data, training = run.get("data"), run.get("training")
    if isinstance(data, dict):
        paths = ("tokenizer_model", "vocab_file")
        run = {**run, "data": {k: v for k, v in data.items() if k not in paths}}
    if isinstance(training, dict):
        kept = {k: v for k, v in training.items() if k not in _MOVED_TO_CHECKPOINT}
        run = {**run, "training": kept}
    return run


def _first_difference(a: Any, b: Any, where: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return _first_difference(a.get(key), b.get(key), f"{where}.{key}".lstrip("."))
    return f"{where}: {a!r} before, {b!r} now"
