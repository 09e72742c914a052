"""What a trial runs and which fault it meets, picked from one seed (no I/O here).

A trial is a configuration (model, layout, DataLoader workers, launcher) and one or two
faults, the second landing in the first restart ("twice in a row"). A fault names its kind,
its place (which process, file or code point) and where it lands: either a time (after the
attempt's j-th new training iteration is logged, plus a fraction of a delay scale) or a code
point (a hook point, or the b-th byte a rank writes into a save or the replacement store).
Byte positions are fractions here; the trial resolves them against the byte counts of the
configuration's reference run, which are deterministic.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from typing import Any

MODELS = ("taco", "sas", "sas_da")
# name -> (tensor-parallel size, ZeRO stage); the data-parallel size is 2 / tp.
LAYOUTS = {
    "dp2-z0": (1, 0),
    "dp2-z1": (1, 1),
    "dp2-z2": (1, 2),
    "dp2-z3": (1, 3),
    "tp2-z0": (2, 0),
    "tp2-z1": (2, 1),
}
LAUNCHERS = ("deepspeed", "torchrun", "taco-launch deepspeed", "taco-launch torchrun")
WORKERS = (0, 1)
ERRNOS = ("ENOSPC", "EIO")

# Faults whose outcome may be a refusal (one line naming the damaged file): the campaign
# damages what the run needs. Every other kind must be survived by a requeue.
MAY_REFUSE = frozenset({"corrupt_ckpt", "corrupt_store"})
STORE_KINDS = frozenset({"corrupt_store"})
KINDS = (
    "kill_rank",  # SIGKILL of one rank, at a random time
    "kill_launcher",  # SIGKILL of a launcher process (the top one, or the per-node one)
    "term_launcher",  # SIGTERM of the top launcher process alone
    "term_twice",  # SIGTERM to every process of the job (or the top one), then again
    "kill_save",  # SIGKILL of the whole job at a random byte of a save
    "kill_point",  # SIGKILL (one rank or the job) at a random hook point
    "write_error",  # ENOSPC or EIO from a checkpoint, tracker or store write or fsync
    "corrupt_ckpt",  # the job stopped, then one byte of the latest checkpoint changed
    "corrupt_store",  # the job stopped, then one byte of a committed store generation
    "stale_lock",  # the job SIGKILLed, its run.lock left (as is, or with a reused PID ...)
)
# Kinds a second fault, in the first restart, is drawn from.
SECOND_KINDS = ("kill_rank", "kill_launcher", "term_twice", "kill_point", "kill_save")
TWICE_PROBABILITY = 0.15
STARTUP_PROBABILITY = 0.1  # a timed fault lands in start-up (before the first iteration)


@dataclasses.dataclass(frozen=True)
class Shape:
    """How a model's tiny run is laid out in iterations (checked against the reference)."""

    train_iters: int
    save_interval: int
    epoch_iters: int | None = None  # SAS: iterations per epoch (the store commits at its end)

    @property
    def saves(self) -> tuple[int, ...]:
        periodic = range(self.save_interval, self.train_iters + 1, self.save_interval)
        return tuple(sorted({*periodic, self.train_iters}))


SHAPES = {
    "taco": Shape(train_iters=10, save_interval=3),
    "sas": Shape(train_iters=12, save_interval=4, epoch_iters=6),
    "sas_da": Shape(train_iters=12, save_interval=4, epoch_iters=6),
}


@dataclasses.dataclass(frozen=True)
class Config:
    model: str
    layout: str
    workers: int
    launcher: str

    def __post_init__(self) -> None:
        if self.model not in MODELS or self.layout not in LAYOUTS:
            raise ValueError(f"unknown model or layout: {self.model}, {self.layout}")
        if self.launcher not in LAUNCHERS or self.workers not in WORKERS:
            raise ValueError(f"unknown launcher or workers: {self.launcher}, {self.workers}")

    @property
    def base_launcher(self) -> str:
        return self.launcher.split()[-1]

    @property
    def reference_key(self) -> str:
        """What the reference depends on: taco-launch passes signals, it does not touch the
        ranks, so a wrapped launcher shares the plain one's reference."""
        return f"{self.model}_{self.layout}_w{self.workers}_{self.base_launcher}"

    @property
    def shape(self) -> Shape:
        return SHAPES[self.model]

    def describe(self) -> str:
        return f"{self.model} {self.layout} w{self.workers} {self.launcher}"


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    place: str
    params: dict[str, Any]

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}")

    @property
    def timed(self) -> bool:
        return "after_new" in self.params

    def describe(self) -> str:
        p = self.params
        if self.timed:
            where = "start-up" if p["after_new"] == 0 else f"iteration {p['after_new']}"
            at = f"{where} +{p['delay']:.2f}"
        elif "point" in p:
            at = p["point"]
        elif "iteration" in p:
            save = "first save" if p["iteration"] is None else f"save {p['iteration']}"
            at = f"{save} rank {p['rank']} byte {p['byte_frac']:.3f}"
        else:
            at = f"rank {p['rank']} byte {p['byte_frac']:.3f}"
        what = f"{self.kind}/{self.place}"
        if "errno" in p:
            what += f" {p['errno']}"
        return f"{what} at {at}"


@dataclasses.dataclass(frozen=True)
class TrialPlan:
    seed: int
    config: Config
    faults: tuple[Fault, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "config": dataclasses.asdict(self.config),
            "faults": [dataclasses.asdict(f) for f in self.faults],
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> TrialPlan:
        return cls(
            seed=int(obj["seed"]),
            config=Config(**obj["config"]),
            faults=tuple(Fault(**f) for f in obj["faults"]),
        )


def trial_seed(campaign_seed: int, index: int, kinds: int = len(KINDS)) -> int:
    """Trial ``index``'s own seed: replaying it needs nothing else. Its remainder modulo the
    number of kinds drawn from is ``index``'s, so a campaign takes the kinds in turn."""
    digest = hashlib.sha256(f"bench_faults:{campaign_seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") // kinds * kinds + index % kinds


def _timed(rng: random.Random, shape: Shape, first: int = 1, startup: bool = True) -> dict:
    if startup and rng.random() < STARTUP_PROBABILITY:
        return {"after_new": 0, "delay": rng.random()}
    return {"after_new": rng.randint(first, shape.train_iters - 1), "delay": rng.random()}


def _pick_fault(rng: random.Random, kind: str, config: Config, restart: bool) -> Fault:
    shape, sas = config.shape, config.model != "taco"
    # In a restart, timed faults land in its start-up or its first iterations.
    timed = (
        (lambda: {"after_new": rng.randint(0, 2), "delay": rng.random()})
        if restart
        else (lambda: _timed(rng, shape))
    )
    rank = rng.randint(0, 1)
    if kind == "kill_rank":
        return Fault(kind, f"rank{rank}", {**timed(), "rank": rank})
    if kind == "kill_launcher":
        return Fault(kind, rng.choice(("top", "inner")), timed())
    if kind == "term_launcher":
        return Fault(kind, "top", timed())
    if kind == "term_twice":
        return Fault(kind, rng.choice(("job", "top")), {**timed(), "gap": rng.uniform(0.05, 3)})
    if kind == "kill_save":  # in a restart: its first save, whichever iteration it is
        iteration = None if restart else rng.choice(shape.saves)
        return Fault(kind, "job", {"iteration": iteration, "rank": rank,
                                   "byte_frac": rng.random()})  # fmt: skip
    if kind == "kill_point":
        return _pick_point(rng, config, restart)
    if kind == "write_error":
        return _pick_write_error(rng, config)
    if kind == "corrupt_ckpt":
        files = ("model", "optim", "rng", "metadata", "tracker")
        return Fault(kind, rng.choice(files), {
            **_timed(rng, shape, first=shape.save_interval, startup=False),
            "stop": rng.choice(("kill_job", "term_job")), "byte_frac": rng.random(),
            "xor": rng.randint(1, 255), "pick": rng.random(),
        })  # fmt: skip
    if kind == "corrupt_store":
        if not sas:
            raise ValueError("corrupt_store needs a SAS model")
        return Fault(kind, rng.choice(("shard", "manifest")), {
            **_timed(rng, shape, first=shape.epoch_iters + 1, startup=False),
            "stop": rng.choice(("kill_job", "term_job")), "byte_frac": rng.random(),
            "xor": rng.randint(1, 255), "pick": rng.random(),
        })  # fmt: skip
    if kind == "stale_lock":
        place = rng.choice(("as_left", "pid_reused", "other_host", "empty"))
        return Fault(kind, place, _timed(rng, shape, startup=False))
    raise ValueError(kind)


def _pick_point(rng: random.Random, config: Config, restart: bool) -> Fault:
    shape = config.shape
    # In a restart: the point's first occurrence (its first save), whichever iteration.
    at = "" if restart else f"@{rng.choice(shape.saves)}"
    rank = rng.randint(0, 1)
    points = [
        (f"after_model_files{at}", rank),
        (f"after_rng_files{at}", rank),
        (f"after_metadata{at}", 0),
        (f"after_rename{at}", 0),
        (f"after_tracker{at}", 0),
        (f"before_rendezvous@{rank}", rank),
        (f"before_build@{rank}", rank),
    ]
    if config.model != "taco":
        points += [("store_commit@0", 0), ("store_commit@1", 0)]
    point, rank = rng.choice(points)
    action = rng.choice(("kill_self", "kill_job"))
    return Fault("kill_point", point.split("@")[0], {"point": point, "rank": rank,
                                                    "action": action})  # fmt: skip


def _pick_write_error(rng: random.Random, config: Config) -> Fault:
    targets = ["ckpt", "ckpt_fsync", "tracker"]
    if config.model != "taco":
        targets += ["store", "store_fsync"]
    target = rng.choice(targets)
    params: dict[str, Any] = {"errno": rng.choice(ERRNOS), "byte_frac": rng.random()}
    if target.startswith("ckpt") or target == "tracker":
        saves = config.shape.saves
        params["iteration"] = rng.choice(saves)
        # The trackers written before this save's (rank 0 writes "N\n" at each).
        params["tracker_bytes_before"] = sum(
            len(f"{s}\n") for s in saves if s < params["iteration"]
        )
    params["rank"] = 0 if target == "tracker" else rng.randint(0, 1)
    return Fault("write_error", target, params)


def pick_trial(seed: int, kinds: tuple[str, ...] = KINDS, models: tuple[str, ...] = MODELS,
               twice: float = TWICE_PROBABILITY) -> TrialPlan:  # fmt: skip
    """The whole trial from ``seed``: the same seed gives the same plan. The (first) fault's
    kind is ``kinds[seed % len(kinds)]``: consecutive trial seeds take the kinds in turn."""
    rng = random.Random(seed)
    kind = kinds[seed % len(kinds)]
    eligible = [m for m in models if kind not in STORE_KINDS or m != "taco"]
    if not eligible:
        raise ValueError(f"fault kind {kind} needs a SAS model; --models gives {models}")
    config = Config(
        model=rng.choice(eligible),
        layout=rng.choice(tuple(LAYOUTS)),
        workers=rng.choice(WORKERS),
        launcher=rng.choice(LAUNCHERS),
    )
    faults = [_pick_fault(rng, kind, config, restart=False)]
    if rng.random() < twice:
        faults.append(_pick_fault(rng, rng.choice(SECOND_KINDS), config, restart=True))
    return TrialPlan(seed=seed, config=config, faults=tuple(faults))
