"""The bugs the suite must catch: small patches of the product code, each with the tests
that fail under it (docs/benchmarks.md lists them with the test that caught each).

    python -m tests.mutations --list            the mutations and their tests
    python -m tests.mutations [NAME ...]        each applied, its tests run, file restored
    python -m tests.mutations --root DIR ...    the same on another checkout (a baseline)
    python -m tests.mutations --tier e2e ...    only the tests under tests/e2e (each tier's
                                                power on its own)

A mutation is a list of (old, new) text replacements in one file, each old text found
exactly once. The file is restored after its tests whatever happens; a copy is kept beside
it (``<file>.mutation-orig``) until then, and a later run restores any copy left behind by
a run that was killed. One line per mutation: caught by <the first failing test>, or
MISSED. Exit status 1 when one is missed.

Mutations built into a test (the test applies them itself and asserts its comparison
fails) are not repeated here: test_taco_tp.py's MUTATIONS, test_sas_hf_equivalence.py's
mutants, test_sampling.py's sample mutations, test_finetune_tp.py's wrong slice."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BACKUP = ".mutation-orig"


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    path: str
    edits: tuple[tuple[str, str], ...]
    tests: tuple[str, ...]


MUTATIONS = (
    Mutation(
        "tp_copy_no_allreduce",
        "the tp copy's backward without its all-reduce",
        "megatron_taco/parallel/mappings.py",
        (
            (
                "_CopyToTP = _adjoint(_identity, _all_reduce, ",
                "_CopyToTP = _adjoint(_identity, _identity, ",
            ),
        ),
        ("tests/distributed/test_taco_tp.py", "tests/distributed/test_tp_dp_training.py"),
    ),
    Mutation(
        "reduce_scatter_flat_layout",
        "reduce-scatter's chunks taken from flat memory (a wrong layout)",
        "megatron_taco/parallel/mappings.py",
        (
            (
                "stacked = torch.stack(x.chunk(world, dim=dim), dim=0)",
                "stacked = x.contiguous().view(world, *x.shape[:dim], x.shape[dim] // world, "
                "*x.shape[dim + 1 :])",
            ),
        ),
        ("tests/distributed/test_parallel_layers.py",),
    ),
    Mutation(
        "vocab_ce_no_max_allreduce",
        "vocabulary-parallel cross entropy without the max all-reduce",
        "megatron_taco/parallel/cross_entropy.py",
        (('        _all_reduce(logits_max, group, "max")\n', ""),),
        ("tests/distributed/test_parallel_layers.py", "tests/distributed/test_tp_dp_training.py"),
    ),
    Mutation(
        "tp_rank_always_0",
        "every rank believes it is tensor-parallel rank 0",
        "megatron_taco/parallel/state.py",
        (("        self.tp_rank = rank % tp_size\n", "        self.tp_rank = 0\n"),),
        ("tests/distributed/test_tp_dp_training.py",),
    ),
    Mutation(
        "sampler_one_slice",
        "every data-parallel rank reads the same slice of the global batch",
        "megatron_taco/data/sampler.py",
        (
            (
                "        offset = self.data_parallel_rank * self.micro_batch_size\n",
                "        offset = 0\n",
            ),
        ),
        ("tests/unit/test_sampler.py", "tests/distributed/test_tp_dp_training.py"),
    ),
    Mutation(
        "cold_start_silently_unigram",
        "the masked (mlm) cold start replaced by unigram draws",
        "megatron_taco/data/sas_collator.py",
        (
            ("    if config.cold_start in MASKED_COLD_STARTS:\n", "    if False:\n"),
            (
                '    if config.cold_start != "unigram":\n',
                '    if config.cold_start == "uniform":\n',
            ),
        ),
        ("tests/unit/test_sas_collator.py", "tests/learning/test_sas_learns.py"),
    ),
    Mutation(
        "rtd_loss_over_padding",
        "SAS's RTD loss averaged over padding too",
        "megatron_taco/models/sas/model.py",
        (
            (
                "        loss = bce.masked_fill(~valid, 0.0).sum() / count.clamp(min=1)\n",
                "        loss = bce.mean()\n",
            ),
        ),
        ("tests/unit/test_sas_model.py", "tests/learning/test_sas_objective.py"),
    ),
    Mutation(
        "taco_encoder_detached_from_mlm",
        "TACO's word-embedding stream detached before the heads",
        "megatron_taco/models/taco/model.py",
        (
            (
                "        we = h_we.flatten(0, 1)  # [b*s, d_WE]\n",
                "        we = h_we.flatten(0, 1).detach()  # [b*s, d_WE]\n",
            ),
        ),
        ("tests/unit/test_taco_model.py", "tests/learning/test_taco_learns.py"),
    ),
    Mutation(
        "export_label_swap",
        "the exported classifier's id2label in reverse order",
        "megatron_taco/models/finetune_hf.py",
        (
            (
                '        "id2label": dict(enumerate(names)),\n',
                '        "id2label": dict(enumerate(reversed(names))),\n',
            ),
        ),
        (
            "tests/unit/test_export_finetuned.py",
            "tests/e2e/test_finetune.py::test_classification_is_learnt",
        ),
    ),
    Mutation(
        "no_orphan_check",
        "a rank whose launcher is gone at its start is not told so",
        "megatron_taco/runtime/launcher.py",
        (("    return parent == 1 or parent_name in _ADOPTERS\n", "    return False\n"),),
        ("tests/unit/test_orphaned_start.py",),
    ),
    Mutation(
        "no_orphan_grace",
        "a rank whose launcher died keeps waiting in a stalled exit save",
        "megatron_taco/training/resilience/exit.py",
        (
            (
                "        if gone_at is None or time.monotonic() - gone_at < grace:\n",
                "        if True:\n",
            ),
        ),
        (
            "tests/e2e/test_preemption.py::test_a_rank_whose_launcher_died_abandons_a_stalled_exit_save",
        ),
    ),
    Mutation(
        "tracker_before_files",
        "the tracker names the new checkpoint before its files are complete",
        "megatron_taco/checkpoint/save.py",
        (
            (
                "    write_metadata(tmp_dir, meta, files)\n",
                '    io.atomic_write(tracker_path(save_dir), f"{iteration}\\n")\n'
                "    write_metadata(tmp_dir, meta, files)\n",
            ),
        ),
        ("tests/unit/test_checkpoint_faults.py", "tests/e2e/test_checkpoint_crash.py"),
    ),
    Mutation(
        "no_crc_check",
        "a checkpoint file whose CRC-32 differs from its manifest is loaded",
        "megatron_taco/checkpoint/manifest.py",
        (('    if crc != entry["crc32"]:\n', "    if False:\n"),),
        ("tests/unit/test_checkpoint_safety.py", "tests/e2e/test_checkpoint_crash.py"),
    ),
    Mutation(
        "unsafe_pickle_loaded",
        "no opcode scan and a full (not weights-only) torch.load",
        "megatron_taco/checkpoint/safe_files.py",
        (
            ("    return [name for name in found if name not in allowed]\n", "    return []\n"),
            (
                "map_location=map_location, weights_only=True, mmap=mmap)",
                "map_location=map_location, weights_only=False, mmap=mmap)",
            ),
        ),
        ("tests/unit/test_checkpoint_safety.py", "tests/e2e/test_checkpoint_crash.py"),
    ),
    Mutation(
        "rng_not_restored",
        "a resumed run does not restore torch's RNG state",
        "megatron_taco/checkpoint/rng.py",
        (('    torch.set_rng_state(states["torch_cpu"])\n', "    pass\n"),),
        ("tests/distributed/test_engine_zero.py",),
    ),
    Mutation(
        "bf16_grad_norm_of_grad",
        "the gradient norm taken from p.grad under ZeRO-1 bf16 (the fixed bug)",
        "megatron_taco/training/engine.py",
        (("    return isinstance(optimizer, DeepSpeedOptimizer)\n", "    return False\n"),),
        ("tests/distributed/test_engine_zero.py",),
    ),
    Mutation(
        "host_read_every_micro_batch",
        "a host read of the loss at every micro-batch",
        "megatron_taco/training/loop.py",
        (
            (
                '            self.model_engine.backward(outputs["loss"])\n',
                '            self.model_engine.backward(outputs["loss"])\n'
                '            outputs["loss"].item()\n',
            ),
        ),
        ("tests/unit/test_host_sync.py",),
    ),
    Mutation(
        "save_lock_ignored",
        "a second run on a --save in use is not refused",
        "megatron_taco/checkpoint/ownership.py",
        (
            (
                "            _claim(fd, path, _read(fd), locked, created=created, "
                "flock_local=flock_local)\n",
                "            pass\n",
            ),
        ),
        ("tests/unit/test_save_lock.py", "tests/e2e/test_checkpoint_crash.py"),
    ),
    Mutation(
        "reshard_every_rank_gets_shard_0",
        "re-sharding hands every tensor-parallel rank the first shard",
        "megatron_taco/checkpoint/reshard.py",
        (
            (
                "split_partition(tensor, lay.dim, lay.stride, rank, self.tp_size)",
                "split_partition(tensor, lay.dim, lay.stride, 0, self.tp_size)",
            ),
        ),
        ("tests/unit/test_convert_checkpoint.py", "tests/e2e/test_convert_checkpoint.py"),
    ),
    Mutation(
        "epoch_permutation_ignores_epoch",
        "every epoch visits the instances in the same order",
        "megatron_taco/data/epochs.py",
        (("        keys = self._keys(epoch)\n", "        keys = self._keys(0)\n"),),
        ("tests/unit/test_epochs.py",),
    ),
    Mutation(
        "dev_history_dropped_on_resume",
        "a resumed fine-tuning run forgets the dev scores of its earlier epochs",
        "megatron_taco/recipes/finetune_eval.py",
        (
            (
                '        self.history = list(state.get("history", []))\n',
                "        self.history = []\n",
            ),
        ),
        ("tests/e2e/test_finetune.py::test_killed_run_resumes_to_the_same_dev_metrics_at_tp2",),
    ),
)


def restore_leftovers(root: Path) -> list[str]:
    """Copies left by a killed run, put back."""
    restored = []
    for m in MUTATIONS:
        path = root / m.path
        backup = Path(f"{path}{BACKUP}")
        if backup.exists():
            os.replace(backup, path)
            restored.append(m.path)
    return restored


def apply(m: Mutation, text: str) -> str:
    for old, new in m.edits:
        count = text.count(old)
        if count != 1:
            raise SystemExit(f"mutation {m.name}: {m.path} holds {old!r} {count} times, not once")
        text = text.replace(old, new)
    return text


def run(m: Mutation, root: Path, timeout: float, tests: tuple[str, ...]) -> tuple[str, float]:
    """(the first failing test, or "" when all passed; seconds)."""
    path = root / m.path
    original = path.read_bytes()
    mutated = apply(m, original.decode())
    backup = Path(f"{path}{BACKUP}")
    backup.write_bytes(original)
    start = time.monotonic()
    try:
        path.write_text(mutated)
        env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
        try:
            res = subprocess.run(
                cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout
            )
            out = res.stdout + res.stderr
        except subprocess.TimeoutExpired as e:
            return f"(timed out after {timeout:g} s: {e.cmd[-1]})", time.monotonic() - start
    finally:
        path.write_bytes(original)
        backup.unlink()
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, flags=re.MULTILINE)
    if failed:
        return failed[0], time.monotonic() - start
    if res.returncode != 0:  # a collection error, a crash: say so, do not count it caught
        return f"(pytest exit {res.returncode}: {out.strip().splitlines()[-1:]})", 0.0
    return "", time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutations", description=__doc__)
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--root", type=Path, default=REPO, help="the checkout to mutate")
    parser.add_argument("--list", action="store_true", help="list them, run nothing")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per mutation")
    parser.add_argument("--tier", help="only the mutations' tests under tests/TIER")
    args = parser.parse_args(argv)
    known = {m.name: m for m in MUTATIONS}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        parser.error(f"unknown mutation(s) {', '.join(unknown)}; --list shows them")
    chosen = [known[n] for n in args.names] or list(MUTATIONS)
    tests = {m.name: m.tests for m in chosen}
    if args.tier:
        tests = {
            n: tuple(t for t in ts if t.startswith(f"tests/{args.tier}/"))
            for n, ts in tests.items()
        }
        chosen = [m for m in chosen if tests[m.name]]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.what} ({m.path}); tests: {' '.join(m.tests)}")
        return 0
    root = args.root.resolve()
    for path in restore_leftovers(root):
        print(f"restored {path} from a run that was killed", flush=True)
    for m in chosen:
        apply(m, (root / m.path).read_text())  # every snippet found before anything runs
    missed = 0
    for m in chosen:
        caught, seconds = run(m, root, args.timeout, tests[m.name])
        ok = caught and not caught.startswith("(")
        missed += not ok
        verdict = f"caught by {caught}" if ok else f"MISSED {caught}".rstrip()
        print(f"{m.name}: {verdict} ({seconds:.0f} s)", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
