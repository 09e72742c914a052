"""One trial: the faulted job, requeued with the same command until it finishes (bounded),
then compared with the configuration's reference run (run once, cached)."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.faults import compare
from benchmarks.faults.inject import apply_after_stop, shim_spec, timed_action
from benchmarks.faults.jobs import Job, MetricsWatch, command, free_port, job_env
from benchmarks.faults.plan import MAY_REFUSE, Config, Fault, TrialPlan
from benchmarks.faults.verdict import Facts, classify

ERROR_LINE = re.compile(r"^(?:\S+\.py|launch\.py): error: .*$", re.M)
RESUMED = re.compile(r"resumed from ckpt at iteration (\d+)")
SAVED = re.compile(r" saved checkpoint ckpt/iter_(\d{7}) ")


@dataclasses.dataclass(frozen=True)
class Limits:
    attempt_timeout: float = 300.0  # seconds an attempt may run before it counts as hung
    linger: float = 60.0  # seconds the job's processes may outlive its top process
    max_attempts: int = 6


# -- the reference ------------------------------------------------------------------------


def reference(config: Config, corpus: dict, refs: Path, limits: Limits) -> dict[str, Any]:
    """The run that never failed, for this configuration (cached under ``refs``): its
    directory, start-up time and the bytes each rank writes per save and to the store."""
    where = refs / config.reference_key
    done = where / "reference.json"
    if done.is_file():
        return json.loads(done.read_text())
    if where.exists():
        shutil.rmtree(where)
    (where / "run").mkdir(parents=True)
    cmd = command(config, corpus, free_port())
    census = where / "census"
    watch = MetricsWatch(where / "run" / "ckpt" / "metrics.jsonl")
    job = Job(cmd, where / "run", job_env({"census": str(census)}), where / "reference.log")
    first = None
    while job.wait(0.1) is None:
        if first is None and watch.poll():
            first = watch.train[0][0]
        if time.time() - job.started > limits.attempt_timeout:
            job.cleanup()
            raise RuntimeError(f"reference {config.reference_key} timed out: {job.log}")
    seconds = time.time() - job.started
    job.wait_gone(limits.linger)
    save = where / "run" / "ckpt"
    shape = config.shape
    if job.proc.returncode != 0 or compare.read_tracker(save) != shape.train_iters:
        raise RuntimeError(
            f"reference {config.reference_key} failed (exit {job.proc.returncode}); see {job.log}"
        )
    records, _ = compare.read_records(save / "metrics.jsonl")
    logged = sorted(r["iteration"] for r in records if r["split"] == "train")
    if logged != list(range(1, shape.train_iters + 1)):
        raise RuntimeError(f"reference {config.reference_key} logged iterations {logged}")
    ranks = {}
    for path in where.glob("census.rank*"):
        ranks[path.name.removeprefix("census.rank")] = json.loads(path.read_text())
    result = {
        "key": config.reference_key,
        "command": cmd,
        "save": str(save),
        "seconds": seconds,
        "startup_s": (first or job.started) - job.started,
        "census": ranks,
    }
    done.write_text(json.dumps(result, indent=1))
    return result


# -- attempts -----------------------------------------------------------------------------


@dataclasses.dataclass
class Attempt:
    index: int
    fault: str | None
    rc: int | None = None
    seconds: float = 0.0
    landed: bool = False
    fault_time: float | None = None
    fault_where: str = ""
    timed_out: bool = False
    lingered: bool = False
    dead_s: float | None = None  # fault -> every process of the job gone
    resumed_from: int | None = None  # None: from scratch
    new_iterations: list[int] = dataclasses.field(default_factory=list)
    first_record_time: float | None = None
    saved: list[int] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)
    tracebacks: int = 0
    damage: dict[str, Any] | None = None
    extra_args: list[str] = dataclasses.field(default_factory=list)
    # Hung: the processes left when the attempt timed out or outlived its launcher.
    stuck: list[dict] = dataclasses.field(default_factory=list)


def _markers(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_attempt(index: int, cmd: list[str], run_dir: Path, trial_dir: Path, fault: Fault | None,
                ref: dict, bug: str | None, limits: Limits, extra: tuple[str, ...] = ()) -> Attempt:  # fmt: skip
    attempt = Attempt(index, fault.describe() if fault else None, extra_args=list(extra))
    cmd = [*cmd, *extra]
    marker = trial_dir / f"fired_{index}.jsonl"
    spec = shim_spec(fault, ref, run_dir, marker, bug)
    save = run_dir / "ckpt"
    watch = MetricsWatch(save / "metrics.jsonl")
    job = Job(cmd, run_dir, job_env(spec), trial_dir / f"attempt_{index}.log")
    try:
        return _supervise(attempt, job, watch, fault, ref, run_dir, trial_dir, marker, limits)
    finally:
        job.cleanup()  # also when the campaign itself is interrupted


def _supervise(attempt: Attempt, job: Job, watch: MetricsWatch, fault: Fault | None, ref: dict,
               run_dir: Path, trial_dir: Path, marker: Path, limits: Limits) -> Attempt:  # fmt: skip
    driver = None
    if fault is not None and fault.timed:
        driver = threading.Thread(target=timed_action, args=(job, watch, fault, ref, attempt),
                                  daemon=True)  # fmt: skip
        driver.start()
    while job.wait(0.1) is None:
        watch.poll()
        if time.time() - job.started > limits.attempt_timeout:
            attempt.timed_out = True
            break
    if driver is not None:
        driver.join(timeout=30)
    attempt.lingered = not job.wait_gone(0 if attempt.timed_out else limits.linger)
    if attempt.timed_out or attempt.lingered:
        attempt.stuck = job.describe(trial_dir / f"attempt_{attempt.index}_stuck")
    gone = time.time()
    job.cleanup()
    watch.poll()
    attempt.rc = job.proc.returncode
    attempt.seconds = gone - job.started
    fired = _markers(marker)
    if fired:
        attempt.landed, attempt.fault_time = True, fired[0]["time"]
        attempt.fault_where = fired[0]["where"]
    if attempt.landed and attempt.fault_time is not None:
        attempt.dead_s = gone - attempt.fault_time
    if fault is not None and attempt.landed:
        attempt.damage = apply_after_stop(fault, run_dir, trial_dir)
    _read_output(attempt, job.output(), watch)
    return attempt


def rank_tracebacks(out: str) -> int:
    """Python tracebacks of the ranks: torchrun's agent prints its own (ChildFailedError)
    when a rank fails, which is the launcher's report, not a rank's."""
    blocks = out.split("Traceback (most recent call last):")[1:]
    return sum("torch/distributed/run.py" not in block[:3000] for block in blocks)


def _read_output(attempt: Attempt, out: str, watch: MetricsWatch) -> None:
    attempt.errors = sorted(set(ERROR_LINE.findall(out)))
    attempt.tracebacks = rank_tracebacks(out)
    resumed = RESUMED.search(out)
    attempt.resumed_from = int(resumed.group(1)) if resumed else None
    attempt.saved = sorted({int(m) for m in SAVED.findall(out)})
    attempt.new_iterations = [r["iteration"] for _, r in watch.train]
    attempt.first_record_time = watch.train[0][0] if watch.train else None


# -- the trial ----------------------------------------------------------------------------


def run_trial(plan: TrialPlan, corpus: dict, trial_dir: Path, refs: Path, limits: Limits,
              bug: str | None = None) -> dict[str, Any]:  # fmt: skip
    config, shape = plan.config, plan.config.shape
    ref = reference(config, corpus, refs, limits)
    if trial_dir.exists():  # a trial run again (an interrupted campaign): nothing of before
        shutil.rmtree(trial_dir)
    run_dir = trial_dir / "run"
    run_dir.mkdir(parents=True)
    cmd = command(config, corpus, free_port())
    (trial_dir / "trial.json").write_text(json.dumps(
        {**plan.to_json(), "bug": bug, "command": cmd, "reference": ref["key"]}, indent=1))  # fmt: skip
    attempts: list[Attempt] = []
    refused_twice = False
    for index in range(limits.max_attempts):
        fault = plan.faults[index] if index < len(plan.faults) else None
        attempt = run_attempt(index, cmd, run_dir, trial_dir, fault, ref, bug, limits)
        attempts.append(attempt)
        if attempt.timed_out or attempt.lingered:
            break
        done = attempt.rc == 0 and compare.read_tracker(run_dir / "ckpt") == shape.train_iters
        if done and index + 1 >= len(plan.faults):
            break
        if len(attempts) >= 2 and _refused(attempts[-2]) and _refused(attempt):
            refused_twice = attempt.errors == attempts[-2].errors
            if refused_twice:
                break
    finished = attempts[-1].rc == 0 and compare.read_tracker(run_dir / "ckpt") == shape.train_iters
    fallback = None
    if not finished and refused_twice:
        # What an operator tries next (the line names it for a damaged checkpoint): one more
        # run with --load-fallback.
        fix = run_attempt(len(attempts), cmd, run_dir, trial_dir, None, ref, bug, limits,
                          ("--load-fallback",))  # fmt: skip
        attempts.append(fix)
        fallback = fix.rc == 0 and compare.read_tracker(run_dir / "ckpt") == shape.train_iters
    result = evaluate(plan, ref, run_dir, attempts, finished, fallback)
    result["seconds"] = sum(a.seconds for a in attempts)
    (trial_dir / "result.json").write_text(json.dumps(result, indent=1))
    return result


def rescore(trial_dir: Path, refs: Path) -> dict[str, Any]:
    """A kept trial evaluated again from its files (after a change to the comparison or the
    verdicts), without running anything."""
    plan = TrialPlan.from_json(json.loads((trial_dir / "trial.json").read_text()))
    old = json.loads((trial_dir / "result.json").read_text())
    attempts = [Attempt(**a) for a in old["attempts"]]
    ref = json.loads((refs / plan.config.reference_key / "reference.json").read_text())
    fallback = old["fallback"]
    finished = old.get("finished", not attempts[-1].extra_args and attempts[-1].rc == 0)
    result = evaluate(plan, ref, trial_dir / "run", attempts, finished, fallback)
    kept = {k: old[k] for k in ("seconds", "trial", "replay", "wall_s") if k in old}
    result.update(kept)
    (trial_dir / "result.json").write_text(json.dumps(result, indent=1))
    return result


def _refused(attempt: Attempt) -> bool:
    """Stopped with an error, without a fault of its own and without saving anything (the
    same line twice in a row ends the requeue: it cannot go on by itself)."""
    return (attempt.fault is None and attempt.rc not in (0, None) and bool(attempt.errors)
            and not attempt.saved)  # fmt: skip


def _loaded(attempt: Attempt) -> bool:
    return attempt.resumed_from is not None or bool(attempt.new_iterations)


def iterations_lost(attempts: list[Attempt]) -> list[dict[str, Any]]:
    """Per stopped attempt: the training iterations logged up to it that the next attempt
    to load a checkpoint (or start from scratch and train) did again, and the time from the
    fault to the next iteration logged. ``lost`` is None when no later attempt loaded."""
    out = []
    logged = 0
    for i, attempt in enumerate(attempts[:-1]):
        logged = max([logged, *attempt.new_iterations])
        nxt = next((a for a in attempts[i + 1 :] if _loaded(a)), None)
        resumed = None if nxt is None else nxt.resumed_from or 0
        recovery = None
        if attempt.fault_time is not None:
            later = next((a.first_record_time for a in attempts[i + 1 :] if a.first_record_time),
                         None)  # fmt: skip
            recovery = None if later is None else later - attempt.fault_time
        out.append({"attempt": i, "lost": None if resumed is None else max(logged - resumed, 0),
                    "resumed_from": resumed, "recovery_s": recovery})  # fmt: skip
    return out


def _lost_data(attempts: list[Attempt], save: Path, damaged: set[int]) -> list[str]:
    """A checkpoint announced as saved that is gone or broken at the end, or a restart that
    resumed from before the last one announced (unless the campaign damaged it)."""
    from megatron_taco.checkpoint.manifest import verify_checkpoint

    problems = []
    announced: set[int] = set()
    for attempt in attempts:
        newest = max(announced - damaged, default=None)
        resumed = attempt.resumed_from or 0
        if _loaded(attempt) and newest is not None and resumed < newest:
            problems.append(
                f"attempt {attempt.index} resumed from {resumed or 'scratch'}, after iteration "
                f"{newest} was saved"
            )
        announced |= set(attempt.saved)
    for it in sorted(announced - damaged):
        try:
            verify_checkpoint(str(save), it)
        except Exception as e:  # any failure: the checkpoint is not loadable
            problems.append(f"iteration {it} was saved and now fails: {str(e)[:300]}")
    return problems


def evaluate(plan: TrialPlan, ref: dict, run_dir: Path, attempts: list[Attempt], finished: bool,
             fallback: bool | None) -> dict[str, Any]:  # fmt: skip
    config, shape = plan.config, plan.config.shape
    save, ref_save = run_dir / "ckpt", Path(ref["save"])
    damaged = {a.damage["iteration"] for a in attempts if a.damage and "iteration" in a.damage}
    restored = [compare.undo_damage(a.damage) for a in attempts if a.damage]
    diffs: list[str] = []
    if finished or fallback:
        ref_records, _ = compare.read_records(ref_save / "metrics.jsonl")
        records, broken = compare.read_records(save / "metrics.jsonl")
        diffs += compare.compare_records(ref_records, records, shape.train_iters)
        ignore = ("configs.checkpoint.load_fallback",) if fallback is not None else ()
        diffs += compare.compare_saves(ref_save, save, shape.train_iters, ignore)
        if config.model != "taco":
            diffs += compare.compare_store(ref_save / "replacement_store",
                                           save / "replacement_store")  # fmt: skip
    # The refusal is the attempt's before the operator's --load-fallback run, if one ran.
    last = attempts[-2] if fallback is not None else attempts[-1]
    facts = Facts(
        hung=any(a.timed_out or a.lingered for a in attempts),
        finished=finished,
        differences=diffs,
        lost_data=_lost_data(attempts, save, damaged),
        refusal=last.errors if not finished else [],
        refusal_tracebacks=last.tracebacks if not finished else 0,
        may_refuse=any(f.kind in MAY_REFUSE for f in plan.faults),
        landed=[a.landed for a in attempts if a.fault is not None][:1],  # the first fault
        lost=[x["lost"] for x in iterations_lost(attempts) if x["lost"] is not None],
        save_interval=shape.save_interval,
    )
    verdict = classify(facts)
    return {
        "seed": plan.seed,
        "finished": finished,
        "config": config.describe(),
        "faults": [f.describe() for f in plan.faults],
        "kind": plan.faults[0].kind,
        "may_refuse": facts.may_refuse,
        "save_interval": shape.save_interval,
        "place": plan.faults[0].place,
        **verdict,
        "fallback": fallback,
        "iterations_lost": iterations_lost(attempts),
        "restored_damage": restored,
        "attempts": [dataclasses.asdict(a) for a in attempts],
        "leftovers": compare.leftovers(save),
    }
