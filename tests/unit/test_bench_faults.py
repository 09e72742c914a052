"""The fault campaign's own logic (benchmarks/bench_faults.py; the campaign itself runs outside
`make test`): a trial is the same from its seed, the comparison sees one ulp, the verdicts,
and the shim's write faults and planted bug in a real interpreter."""

from __future__ import annotations

import errno
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks.faults import compare
from benchmarks.faults.inject import flip_byte, shim_spec
from benchmarks.faults.jobs import SHIM_DIR
from benchmarks.faults.plan import KINDS, SHAPES, TrialPlan, pick_trial, trial_seed
from benchmarks.faults.verdict import Facts, classify, one_line

# -- plans --------------------------------------------------------------------------------


def test_a_trial_is_the_same_from_its_seed_and_survives_json():
    seeds = [trial_seed(7, i) for i in range(40)]
    assert seeds == [trial_seed(7, i) for i in range(40)]
    assert len(set(seeds)) == 40 and trial_seed(8, 0) != seeds[0]
    plans = [pick_trial(s) for s in seeds]
    assert [p.to_json() for p in plans] == [pick_trial(s).to_json() for s in seeds]
    for plan in plans:
        assert TrialPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    assert len({json.dumps(p.to_json(), sort_keys=True) for p in plans}) == 40


def test_the_draw_takes_the_kinds_in_turn_and_keeps_store_faults_to_sas():
    plans = [pick_trial(trial_seed(3, i)) for i in range(400)]
    assert [p.faults[0].kind for p in plans[:20]] == [*KINDS, *KINDS]
    assert {p.config.model for p in plans} == {"taco", "sas", "sas_da"}
    assert any(len(p.faults) == 2 for p in plans)
    for p in plans:
        for f in p.faults:
            assert f.kind != "corrupt_store" or p.config.model != "taco"
            if f.params.get("point", "").startswith("store_commit"):
                assert p.config.model != "taco"
            if "iteration" in f.params:  # None: a restart's first save
                assert f.params["iteration"] in (*p.config.shape.saves, None)
    two = ("stale_lock", "kill_rank")
    assert [pick_trial(trial_seed(3, i, 2), kinds=two).faults[0].kind for i in range(4)] == [
        *two, *two]  # fmt: skip
    only = [pick_trial(s, kinds=("kill_save",), models=("taco",)) for s in range(20)]
    assert {(p.faults[0].kind, p.config.model) for p in only} == {("kill_save", "taco")}
    with pytest.raises(ValueError, match="needs a SAS model"):
        pick_trial(0, kinds=("corrupt_store",), models=("taco",))


def test_shapes_save_at_the_interval_and_at_the_end():
    assert SHAPES["taco"].saves == (3, 6, 9, 10)
    assert SHAPES["sas"].saves == (4, 8, 12)


def test_a_byte_fault_resolves_against_the_reference_byte_counts(tmp_path):
    plan = next(
        p
        for p in (pick_trial(s, kinds=("kill_save",)) for s in range(100))
        if p.faults[0].params["rank"] == 1
    )
    fault = plan.faults[0]
    it = fault.params["iteration"]
    ref = {"census": {"0": {f"ckpt:iter_{it:07d}": 1000}, "1": {}}}
    spec = shim_spec(fault, ref, tmp_path, tmp_path / "fired", None)
    # Rank 1 writes nothing of that save here: the fault moves to rank 0.
    assert spec["rank"] == 0
    assert spec["io"]["after_bytes"] == int(fault.params["byte_frac"] * 1000)
    assert spec["io"]["action"] == "kill_job" and f"iter_{it:07d}" in spec["io"]["path_re"]


# -- comparison ---------------------------------------------------------------------------


def test_one_ulp_is_a_difference():
    a = torch.linspace(-1, 1, 17, dtype=torch.float32)
    b = a.clone()
    b[5] = torch.nextafter(b[5], torch.tensor(2.0))
    assert compare.same_tensor(a, a.clone())
    assert not compare.same_tensor(a, b)
    (diff,) = compare.compare_leaves({"w": a}, {"w": b}, "ckpt")
    assert "ckpt/w: tensor differs (1 element(s), first [5]" in diff
    assert not compare.same_tensor(torch.zeros(2), -torch.zeros(2))  # the sign bit
    assert not compare.same_tensor(a, a.double())
    nan = torch.tensor([math.nan])
    assert compare.same_tensor(nan, nan.clone())
    assert compare.same_value(math.nan, math.nan) and not compare.same_value(0.0, -0.0)
    assert not compare.same_value(1, 1.0)


def test_records_are_compared_bit_for_bit_but_for_timings():
    ref = [{"split": "train", "iteration": i, "loss": 1.0 / i, "elapsed_ms": 3.0} for i in (1, 2)]
    redone = [*ref, {**ref[1], "elapsed_ms": 9.0}]  # iteration 2 done twice, slower
    assert compare.compare_records(ref, redone, 2) == []
    off = {**ref[1], "loss": math.nextafter(ref[1]["loss"], 1.0)}
    (diff,) = compare.compare_records(ref, [ref[0], off], 2)
    assert diff.startswith("metrics: train iteration 2 loss: ")
    assert compare.compare_records(ref, ref[:1], 2) == [
        "metrics: training iterations never logged: [2]"
    ]
    (diff,) = compare.compare_records(ref, [ref[0], {**ref[1], "new": 1}], 2)
    assert "new: 1 != reference 'missing'" in diff


def test_metrics_lines_cut_short_are_counted_not_read(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"split": "train", "iteration": 1, "loss": 2.5}\n{"split": "tr\n')
    records, broken = compare.read_records(path)
    assert records == [{"split": "train", "iteration": 1, "loss": 2.5}] and broken == 1


def test_metadata_is_compared_but_for_file_bytes_and_the_operator_flag(tmp_path):
    meta = {"iteration": 4, "checksum": "aa", "files": {"a.pt": {"crc32": "1"}},
            "configs": {"checkpoint": {"load_fallback": False}, "training": {"lr": 1e-3}}}  # fmt: skip
    for name, changes in (("ref", {}), ("got", {"checksum": "bb", "files": {}})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metadata.json").write_text(json.dumps({**meta, **changes}))
    ref, got = tmp_path / "ref", tmp_path / "got"
    assert compare.compare_checkpoint(ref, got) == []
    fallback = json.loads((got / "metadata.json").read_text())
    fallback["configs"]["checkpoint"]["load_fallback"] = True
    (got / "metadata.json").write_text(json.dumps(fallback))
    (diff,) = compare.compare_checkpoint(ref, got)
    assert diff == "got/metadata.json/configs/checkpoint/load_fallback: True != reference False"
    assert compare.compare_checkpoint(ref, got, ("configs.checkpoint.load_fallback",)) == []


def test_store_and_damage(tmp_path):
    for root in ("a", "b"):
        (tmp_path / root / "gen_00000").mkdir(parents=True)
        (tmp_path / root / "gen_00000" / "shard_00000.bin").write_bytes(bytes(range(64)))
    assert compare.compare_store(tmp_path / "a", tmp_path / "b") == []
    shard = tmp_path / "b" / "gen_00000" / "shard_00000.bin"
    damage = flip_byte(shard, 0.5, 0x10)
    assert damage["offset"] == 32 and damage["new"] == 32 ^ 0x10
    (diff,) = compare.compare_store(tmp_path / "a", tmp_path / "b")
    assert diff == "store: gen_00000/shard_00000.bin differs from byte 32 (sizes 64, 64)"
    assert (
        compare.undo_damage(damage) and compare.compare_store(tmp_path / "a", tmp_path / "b") == []
    )
    assert not compare.undo_damage(damage)  # the byte is no longer the campaign's


def test_iterations_lost_count_from_the_next_attempt_that_loaded():
    from benchmarks.faults.trial import Attempt, iterations_lost

    attempts = [
        Attempt(0, "term", new_iterations=[1, 2, 3, 4, 5, 6, 7], fault_time=10.0),
        Attempt(1, "kill before build", fault_time=30.0),  # died before it loaded anything
        Attempt(2, None, resumed_from=6, new_iterations=[7, 8], first_record_time=50.0),
        Attempt(3, None, rc=2),  # refused: nothing after it loaded
    ]
    lost = iterations_lost(attempts)
    assert [(x["lost"], x["resumed_from"]) for x in lost] == [(1, 6), (1, 6), (None, None)]
    assert [x["recovery_s"] for x in lost] == [40.0, 20.0, None]


# -- verdicts -----------------------------------------------------------------------------


def facts(**kw) -> Facts:
    base = dict(hung=False, finished=True, differences=[], lost_data=[], refusal=[],
                refusal_tracebacks=0, may_refuse=False, landed=[True], lost=[2], save_interval=3)  # fmt: skip
    return Facts(**{**base, **kw})


LINE = "pretrain_taco.py: error: rank {}: checkpoint iteration 6 is incomplete or corrupt"


@pytest.mark.parametrize(
    ("kw", "outcome", "failure"),
    [
        ({}, "exact", False),
        ({"differences": ["metrics: ..."]}, "differed", True),
        ({"hung": True, "differences": ["x"]}, "hung", True),
        ({"lost_data": ["iteration 6 was saved and now fails"]}, "lost_data", True),
        ({"lost": [4]}, "exact", True),  # more than one --save-interval redone
        ({"lost": [6], "may_refuse": True}, "exact", False),  # the damaged one's too
        ({"lost": [7], "may_refuse": True}, "exact", True),
        ({"finished": False, "refusal": [LINE.format(0), LINE.format(1)], "may_refuse": True},
         "refused", False),
        ({"finished": False, "refusal": [LINE.format(0)]}, "refused", True),  # after a kill
        ({"finished": False, "refusal": [LINE.format(0)], "may_refuse": True,
          "refusal_tracebacks": 1}, "refused", True),
        ({"finished": False, "refusal": [LINE.format(0), "launch.py: error: other"],
          "may_refuse": True}, "refused", True),
    ],
)  # fmt: skip
def test_classification(kw, outcome, failure):
    verdict = classify(facts(**kw))
    assert (verdict["outcome"], verdict["failure"]) == (outcome, failure), verdict


def test_one_line_ignores_the_rank():
    assert one_line([LINE.format(0), LINE.format(1)]) == LINE.format(0).replace("rank 0: ", "")
    assert one_line([]) is None


# -- the shim, in a real interpreter --------------------------------------------------------


def run_shim(spec: dict, code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "FAULTS_SHIM"}
    env.update(FAULTS_SHIM=json.dumps(spec), RANK="0",
               PYTHONPATH=os.pathsep.join([str(SHIM_DIR), env.get("PYTHONPATH", "")]))  # fmt: skip
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_the_shim_fails_a_write_at_its_byte_and_keeps_the_disk_full(tmp_path):
    spec = {"rank": 0, "marker": str(tmp_path / "fired"), "io": {
        "path_re": r"/iter_0000004\.tmp-[0-9a-f]+/", "action": "errno", "errno": errno.ENOSPC,
        "after_bytes": 10, "sticky_re": str(tmp_path)}}  # fmt: skip
    code = """
import os
os.makedirs("iter_0000004.tmp-ab12", exist_ok=True)
with open("iter_0000004.tmp-ab12/a.pt", "wb") as f:
    f.write(b"x" * 6)
    try:
        f.write(b"y" * 6)
    except OSError as e:
        print("first", e.errno, e.filename.endswith("a.pt"))
fd = os.open("other.bin", os.O_WRONLY | os.O_CREAT)
try:
    os.write(fd, b"z")
except OSError as e:
    print("later", e.errno)
"""
    res = run_shim(spec, code, tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[:2] == [f"first {errno.ENOSPC} True", f"later {errno.ENOSPC}"]
    assert (tmp_path / "iter_0000004.tmp-ab12" / "a.pt").read_bytes() == b"x" * 6
    (fired,) = (json.loads(line) for line in (tmp_path / "fired").read_text().splitlines())
    assert fired["rank"] == 0 and "at byte 4 of 6" in fired["where"]
    # Another rank only counts.
    res = run_shim({**spec, "rank": 1}, code, tmp_path)
    assert res.returncode == 0 and res.stdout == "", res.stdout


def test_the_shim_plants_a_bug_where_the_module_is_imported(tmp_path):
    code = """
import megatron_taco.checkpoint.load as c
print(c.set_rng_states.__name__)
"""
    assert run_shim({"bug": "no_rng_restore"}, code, tmp_path).stdout.strip() == "<lambda>"
    assert run_shim({}, code, tmp_path).stdout.strip() == "set_rng_states"


def test_a_hung_job_is_described_with_its_processes_and_stacks(tmp_path):
    from benchmarks.faults.jobs import Job

    code = "import time\ndef waiting_here():\n    time.sleep(60)\nwaiting_here()\n"
    job = Job([sys.executable, "-c", code], tmp_path, dict(os.environ), tmp_path / "log")
    try:
        deadline = time.monotonic() + 30
        while not job.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # into the sleep
        (row,) = job.describe(tmp_path / "stuck")
    finally:
        job.cleanup()
    assert row["pid"] == job.proc.pid and row["ppid"] == os.getpid()
    assert row["cmdline"].startswith(sys.executable) and row["state"] in "SR"
    spy = Path(sys.executable).parent / "py-spy"
    if spy.is_file():  # a dev tool, used where installed
        assert "waiting_here" in (tmp_path / "stuck" / f"{job.proc.pid}.txt").read_text()
