"""Rank-0 outputs of a run: console lines, a tqdm progress bar, TensorBoard scalars and the
metrics JSON-lines file (one object per logged step or evaluation; plots and tests read it).

Every method is a no-op on ranks other than 0, so the loop calls them unconditionally.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from typing import Any

from tqdm import tqdm

# Order of the well-known fields on the console line; model keys follow alphabetically.
_CONSOLE_FIRST = ("consumed_samples", "elapsed_ms", "lr", "global_batch_size", "loss")
_CONSOLE_LAST = (
    "grad_norm",
    "skipped_iterations",
    "samples_per_s",
    "tokens_per_s",
    "tflops_per_rank",
)
_NOT_ON_CONSOLE = ("split", "iteration")

logger = logging.getLogger(__name__)


def _fmt(key: str, value: Any) -> str:
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
    ) -> None:
        self.active = rank == 0
        self.train_iters = train_iters
        self.metrics_file = metrics_file
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
        if not self.active:
            return
        if self._bar is not None and not self._bar.disable:
            self._bar.write(message)
        else:
            print(message, flush=True)

    def advance(self, iterations: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(iterations)

    def log(self, split: str, iteration: int, metrics: dict[str, Any]) -> None:
        """One logged step (split "train") or one evaluation ("valid", "test")."""
        if not self.active:
            return
        record = {"split": split, "iteration": iteration, **metrics}
        if self._metrics is not None:
            line = json.dumps({k: _json_value(v) for k, v in record.items()}) + "\n"
            self._append_metrics(line.encode("utf-8"))
        if self._writer is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._writer.add_scalar(f"{split}/{key}", value, iteration)
            self._writer.flush()
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
                logger.warning("--metrics-file: writing %s failed (%s); training goes on, "
                               "the records it misses are lost", self.metrics_file,
                               e.strerror or e)  # fmt: skip
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
        return " | ".join([head, *(f"{k}: {_fmt(k, record[k])}" for k in keys)]) + " |"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None


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
                logger.warning("%s:%d: not a whole metrics record, skipped: %.60s", path,
                               number, line)  # fmt: skip
                continue
            records[key] = rec
    return sorted(records.values(), key=lambda r: (r.get("split", "train"), r["iteration"]))
