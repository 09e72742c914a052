"""Rank-0 outputs of a run: console lines, a tqdm progress bar, TensorBoard scalars, the
metrics JSON-lines file (one object per logged step or evaluation; plots and tests read it)
and, with --wandb-project, Weights & Biases (training/observability/tracking.py).

Every train line also says where the run is, for a person reading a SLURM log: the wall
time since this process started training (``elapsed_s``), the time left to --train-iters at
the pace so far, evaluations and saves included (``eta_s``), and this rank's memory since
the previous line (CUDA: peak allocated and reserved; CPU: the process's resident set).
All outputs get the same record.

Every method is a no-op on ranks other than 0, so the loop calls them unconditionally.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from typing import Any

from tqdm import tqdm

from megatron_taco.model_outputs import COUNT_SUFFIX

# Order of the well-known fields on the console line; model keys follow alphabetically.
_CONSOLE_FIRST = (
    "elapsed_s",
    "eta_s",
    "consumed_samples",
    "elapsed_ms",
    "lr",
    "global_batch_size",
    "loss",
)
_CONSOLE_LAST = (
    "grad_norm",
    "skipped_iterations",
    "samples_per_s",
    "tokens_per_s",
    "tflops_per_rank",
    "mfu",  # model FLOPs utilisation, where the model and the device's peak are known
    "mem_max_allocated_gib",
    "mem_max_reserved_gib",
    "host_rss_gib",
)
_NOT_ON_CONSOLE = ("split", "iteration")
_DURATIONS = {"elapsed_s": "elapsed", "eta_s": "ETA"}  # shown as [d-]h:mm:ss
GIB = 2**30


RUN_LOGGER = "megatron_taco.run"


class _RunLines(logging.Handler):
    """The run's own lines, bare (no time, level or name), on stdout: through the progress
    bar's write when one is shown (``extra={"bar": bar}``), so it is not torn."""

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        bar = getattr(record, "bar", None)
        if bar is not None and not bar.disable:
            bar.write(message)
        else:
            print(message, file=sys.stdout, flush=True)


def run_log() -> logging.Logger:
    """The one channel of what a run tells its user (the banner, train and evaluation lines,
    saves, a sweep's progress): stdlib logging under ``megatron_taco.run``, shown as bare
    lines; warnings of every module go to the same logging tree with their level and name."""
    log = logging.getLogger(RUN_LOGGER)
    if not log.handlers:
        log.addHandler(_RunLines())
        log.setLevel(logging.INFO)
        log.propagate = False  # printed bare here, not again by the root's format
    return log


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return str(seconds)
    days, rest = divmod(round(seconds), 86400)
    hours, rest = divmod(rest, 3600)
    text = f"{hours}:{rest // 60:02d}:{rest % 60:02d}"
    return f"{days}-{text}" if days else text


def memory_metrics() -> dict[str, float]:
    """This process's memory since the previous call: the CUDA caching allocator's peak
    allocated and reserved GiB on the current device (the peaks are reset for the next
    call), or on CPU the resident set. Host-side counters only: no device sync."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out = {
            "mem_max_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
            "mem_max_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
        }
        torch.cuda.reset_peak_memory_stats()
        return out
    return {"host_rss_gib": _resident_bytes() / GIB}


def _resident_bytes() -> int:
    try:  # Linux: the current resident set (ru_maxrss is the peak since start)
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak * (1 if sys.platform == "darwin" else 1024)


logger = logging.getLogger(__name__)


def _fmt(key: str, value: Any) -> str:
    if key in _DURATIONS and isinstance(value, (int, float)):
        return _duration(value)
    if key.endswith(COUNT_SUFFIX) and isinstance(value, float) and math.isfinite(value):
        # A count per iteration (a mean over the interval): read as a whole number.
        return str(round(value))
    if isinstance(value, float):
        if key == "lr":
            return f"{value:.4e}"
        if not math.isfinite(value):
            return str(value)
        return f"{value:.4f}" if abs(value) < 1e5 else f"{value:.4e}"
    return str(value)


def _json_value(value: Any) -> Any:
    # JSON has no inf/nan; keep them readable for humans and json.loads alike.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class TrainingLogger:
    def __init__(
        self,
        *,
        rank: int,
        train_iters: int,
        start_iteration: int = 0,
        tensorboard_dir: str | None = None,
        metrics_file: str | None = None,
        progress_bar: bool = True,
        tracker: Any = None,
    ) -> None:
        """``tracker``: rank 0's experiment tracker (tracking.WandbRun), given the same
        records as TensorBoard, and the plots by image()."""
        self.active = rank == 0
        self.train_iters = train_iters
        self.metrics_file = metrics_file
        self.tracker = tracker if self.active else None
        self._start = time.perf_counter()
        self._start_iteration = start_iteration
        self._writer = None
        self._metrics = None
        self._bar = None
        if not self.active:
            return
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(tensorboard_dir, exist_ok=True)
            self._writer = SummaryWriter(log_dir=tensorboard_dir, max_queue=100)
        if metrics_file is not None:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
            # Appended to: a resumed run continues the same file (plots take the last line
            # of each iteration). Unbuffered: each record is one write, or a warning.
            self._metrics = open(metrics_file, "ab", buffering=0)  # noqa: SIM115
            # A record cut short (a full disk, a killed run) stays a line of its own.
            self._metrics_torn = self._metrics.tell() > 0 and not _ends_with_newline(metrics_file)
            self._metrics_failed = False
        if progress_bar and start_iteration < train_iters:
            # disable=None: no bar when stderr is not a terminal (log files stay clean).
            self._bar = tqdm(
                total=train_iters,
                initial=start_iteration,
                desc="train",
                unit="it",
                dynamic_ncols=True,
                disable=None,
                file=sys.stderr,
            )

    def print(self, message: str) -> None:
        if self.active:
            run_log().info(message, extra={"bar": self._bar})

    def advance(self, iterations: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(iterations)

    def progress(self, iteration: int) -> dict[str, float]:
        """elapsed_s, eta_s (once an iteration was trained) and memory_metrics() for the
        train line of ``iteration``."""
        elapsed = time.perf_counter() - self._start
        out = {"elapsed_s": elapsed}
        done = iteration - self._start_iteration
        if done > 0:
            out["eta_s"] = elapsed / done * max(self.train_iters - iteration, 0)
        out.update(memory_metrics())
        return out

    def log(self, split: str, iteration: int, metrics: dict[str, Any]) -> None:
        """One logged step (split "train") or one evaluation ("valid", "test")."""
        if not self.active:
            return
        if split == "train":
            metrics = {**metrics, **self.progress(iteration)}
        record = {"split": split, "iteration": iteration, **metrics}
        if self._metrics is not None:
            line = json.dumps({k: _json_value(v) for k, v in record.items()}) + "\n"
            self._append_metrics(line.encode("utf-8"))
        if self._writer is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._writer.add_scalar(f"{split}/{key}", value, iteration)
            self._writer.flush()
        if self.tracker is not None:
            self.tracker.log(split, iteration, metrics)
        self.print(self._console_line(split, iteration, record))
        if split == "train" and self._bar is not None and "loss" in metrics:
            self._bar.set_postfix(loss=f"{metrics['loss']:.4f}", refresh=False)

    def _append_metrics(self, data: bytes) -> None:
        """A failed write (a full disk, a quota) is a warning: metrics must never stop a
        run before its checkpoint is written."""
        try:
            self._metrics.write(b"\n" + data if self._metrics_torn else data)
            self._metrics_torn = False
        except OSError as e:
            self._metrics_torn = True  # maybe partly written: the next record starts a line
            if not self._metrics_failed:
                logger.warning(
                    "--metrics-file: writing %s failed (%s); training goes on, "
                    "the records it misses are lost",
                    self.metrics_file,
                    e.strerror or e,
                )
            self._metrics_failed = True
        else:
            self._metrics_failed = False

    def _console_line(self, split: str, iteration: int, record: dict[str, Any]) -> str:
        width = len(str(self.train_iters))
        head = (
            f" iteration {iteration:>{width}}/{self.train_iters}"
            if split == "train"
            else f" {split} at iteration {iteration}"
        )
        keys = [k for k in _CONSOLE_FIRST if k in record]
        keys += sorted(
            k for k in record if k not in _CONSOLE_FIRST + _CONSOLE_LAST + _NOT_ON_CONSOLE
        )
        keys += [k for k in _CONSOLE_LAST if k in record]
        fields = (f"{_DURATIONS.get(k, k)}: {_fmt(k, record[k])}" for k in keys)
        return " | ".join([head, *fields]) + " |"

    def image(self, name: str, path: str, iteration: int) -> None:
        """A plot (PNG) for the experiment tracker; the files themselves are beside the
        metrics file already."""
        if self.tracker is not None:
            self.tracker.image(name, path, iteration)

    def close(self) -> None:
        for name in ("_bar", "_writer", "_metrics", "tracker"):
            output = getattr(self, name)
            if output is not None:
                output.close()
                setattr(self, name, None)


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The metrics file's records; for an iteration logged more than once (a run resumed
    from an earlier checkpoint into the same file) the last record wins."""
    records: dict[tuple[str, int], dict[str, Any]] = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
                key = (rec.get("split", "train"), int(rec["iteration"]))
            except (ValueError, KeyError, TypeError, AttributeError):
                # A record cut short by a full disk or a killed run: skipped, not fatal.
                logger.warning(
                    "%s:%d: not a whole metrics record, skipped: %.60s", path, number, line
                )
                continue
            records[key] = rec
    return sorted(records.values(), key=lambda r: (r.get("split", "train"), r["iteration"]))
