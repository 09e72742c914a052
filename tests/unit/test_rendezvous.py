"""What the ranks settle around the rendezvous (checkpoint/rendezvous.py), with real processes:

* the ranks a launcher starts on one node verify the checkpoint once: one rank reads its
  files, the others take its verdict (the same one-line error included); a rank that dies
  holding the lock leaves the work to the next;
* after the rendezvous, ranks that would load different checkpoints (a stale view of a
  network file system) stop together with one line naming who saw what.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from megatron_taco.checkpoint.layout import FORMAT
from megatron_taco.checkpoint.manifest import write_metadata as _write_metadata
from megatron_taco.checkpoint.plan import FRESH, RESUME, ResumePlan
from megatron_taco.checkpoint.rendezvous import agree_on_load, describe_disagreement
from megatron_taco.errors import ConfigError
from tests.helpers import ENV, REPO, free_port, run_distributed


def _checkpoint(load: Path, iteration: int, payload: bytes) -> None:
    """A checkpoint in the layout the verifier checks (one data file, its manifest)."""
    from megatron_taco.checkpoint.manifest import manifest_entry as _manifest_entry

    iter_dir = load / f"iter_{iteration:07d}"
    iter_dir.mkdir(parents=True)
    (iter_dir / "data.bin").write_bytes(payload)
    meta = {"format": FORMAT, "iteration": iteration, "consumed_samples": 0, "world_size": 2,
            "tensor_model_parallel_size": 1, "data_parallel_size": 2, "model": "TOY"}  # fmt: skip
    _write_metadata(str(iter_dir), meta, {"data.bin": _manifest_entry(str(iter_dir / "data.bin"))})
    (load / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")


# One local rank: counts the files it checksums while choosing the checkpoint to load.
_RANK = """
    import json, os, sys, time
    from megatron_taco.checkpoint import manifest
    from megatron_taco.checkpoint.config import CheckpointConfig
    from megatron_taco.checkpoint.plan import ResumeRequest, plan_resume
    from megatron_taco.checkpoint.rendezvous import verify_once_per_node
    from megatron_taco.errors import ConfigError

    reads = []
    real = manifest.checksum_regular
    def counting(path):
        reads.append(path)
        time.sleep(0.5)  # long enough for the other rank to be waiting
        if os.environ.get("DIE") == os.environ["LOCAL_RANK"]:
            open(os.environ["HOLDING"], "w").close()  # the other rank may start now
            time.sleep(0.5)
            os._exit(9)  # dies holding the lock, before any verdict
        return real(path)
    manifest.checksum_regular = counting

    load = sys.argv[1]
    # As the deepspeed launcher starts a rank: its own --local_rank in the command line.
    sys.argv = ["pretrain_taco.py", f"--local_rank={os.environ['LOCAL_RANK']}", "--load", load]

    request = ResumeRequest(CheckpointConfig(load=load, load_fallback=True), models=("TOY",))
    if os.environ.get("DIE") not in (None, os.environ["LOCAL_RANK"]):
        while not os.path.exists(os.environ["HOLDING"]):  # the dying rank takes the lock first
            time.sleep(0.05)
    try:
        plan = plan_resume(request, once=verify_once_per_node)
        result = {"iteration": plan.iteration, "reads": len(reads)}
    except ConfigError as e:
        result = {"error": str(e), "reads": len(reads)}
    print(json.dumps(result), flush=True)
"""


def _node(load: Path, *, die: str | None = None) -> list[dict]:
    """Two ranks of one launch on one node: children of this process (their launcher)."""
    import json

    # TMPDIR: where the ranks leave their verdict (megatron_taco-<uid>), apart per test.
    env = {**ENV, "LOCAL_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "TMPDIR": str(load.parent)}  # fmt: skip
    if die is not None:
        env["DIE"], env["HOLDING"] = die, str(load.parent / "holding")
    procs = [
        subprocess.Popen([sys.executable, "-c", textwrap.dedent(_RANK), str(load)], cwd=REPO,
                         env={**env, "LOCAL_RANK": str(r), "RANK": str(r)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in (0, 1)
    ]  # fmt: skip
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        lines = [line for line in stdout.splitlines() if line.startswith("{")]
        out.append(json.loads(lines[-1]) if lines else {"exit": p.returncode, "stderr": stderr})
    return out


def test_the_checkpoint_is_verified_once_per_node(tmp_path):
    load = tmp_path / "load"
    _checkpoint(load, 6, b"six" * 1000)
    _checkpoint(load, 8, b"eight" * 1000)
    results = _node(load)
    assert [r["iteration"] for r in results] == [8, 8], results
    assert sorted(r["reads"] for r in results) == [0, 1]  # one rank read the file, once


def test_a_verification_error_reaches_every_local_rank_in_one_line(tmp_path):
    load = tmp_path / "load"
    _checkpoint(load, 8, b"eight" * 1000)
    (load / "iter_0000008" / "data.bin").write_bytes(b"x")
    results = _node(load)
    assert results[0]["error"] == results[1]["error"], results
    assert "iter_0000008/data.bin has 1 bytes" in results[0]["error"]
    assert sorted(r["reads"] for r in results) == [0, 1]


def test_a_rank_that_dies_verifying_leaves_the_work_to_the_next(tmp_path):
    load = tmp_path / "load"
    _checkpoint(load, 8, b"eight" * 1000)
    for die in ("0", "1"):
        (tmp_path / "holding").unlink(missing_ok=True)
        results = _node(load, die=die)
        survivor = results[1 - int(die)]
        assert results[int(die)]["exit"] == 9, results
        assert survivor["iteration"] == 8 and survivor["reads"] == 1, results


# ---------------------------------------------------------------------------------------
# After the rendezvous


def _agree(rank, world_size, choices, load):
    choice = choices[rank]
    plan = ResumePlan(FRESH, load) if choice is None else ResumePlan(RESUME, load, *choice)
    try:
        agree_on_load(plan)
    except ConfigError as e:
        return str(e)
    return None


def test_ranks_that_would_load_different_checkpoints_stop_with_one_line():
    same = run_distributed(_agree, 2, [(8, "1a2b3c4d"), (8, "1a2b3c4d")], "ckpt")
    assert same == [None, None]
    # A stale view on rank 1's node: an older tracker, or the same iteration rewritten.
    for choices in ([(8, "1a2b3c4d"), (6, "99999999")], [(8, "1a2b3c4d"), (8, "0000000f")],
                    [(8, "1a2b3c4d"), None]):  # fmt: skip
        lines = run_distributed(_agree, 2, choices, "ckpt")
        assert lines[0] == lines[1] and lines[0] is not None, lines
        assert lines[0].startswith(
            "--load: the ranks disagree on the checkpoint to load from ckpt:"
        )
        assert "rank 0 on " in lines[0] and "rank 1 on " in lines[0] and "\n" not in lines[0]


def test_disagreement_groups_ranks():
    views = [("a", "8"), ("a", "8"), ("b", "6"), ("b", "6"), ("c", "8")]
    assert describe_disagreement(views, "it") == (
        "the ranks disagree on it: ranks 0-1,4 on a, c: 8; ranks 2-3 on b: 6"
    )
    assert describe_disagreement(views[:2], "it") is None
