"""Is the encoder learning? Collapse and plateau figures at every evaluation, for any model.

A pretraining run can end in an encoder that gives the same vector for every input, or
whose MLM head predicts the corpus's most frequent token everywhere, while its loss still
falls (it learns the unigram distribution). Neither shows in a loss curve, so every
evaluation measures both, from two optional eval-mode outputs of the model (named in
model_outputs.py; models/common/monitoring.py builds them):

- ``representation`` [rows, s, H] with ``representation_mask`` [rows, s] (real tokens):
  the last-layer vectors. ``collapse_cosine`` is the mean pairwise cosine similarity of
  every real token's vector with every other's, over the whole evaluation (all
  micro-batches and data-parallel ranks): (|sum u_i|^2 - N) / (N (N - 1)) for the unit
  vectors u_i, so one [H] sum per rank is all that is reduced. 1 means one vector for every
  token of every input; a randomly initialised encoder gives well below it (its vectors
  still carry the input tokens).
- ``<name>_label_counts`` [C]: how often each class is a target among the labelled tokens
  (MLM: the vocabulary). ``<name>_baseline_acc`` is max / sum over the evaluation: the
  accuracy of always predicting the evaluation's most frequent target, the level a head
  that learned only the unigram distribution sits at. Compared with ``<name>_acc``.

``LearningMonitor`` turns the figures into one warning line each (outputs near-constant
across inputs; an accuracy still at its baseline after warm-up) and, with
``--exit-on-collapse``, holds back saves while the encoder is collapsed and stops the run when
the collapse lasts --collapse-patience evaluations.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from megatron_taco.arguments import option, require
from megatron_taco.errors import RunError
from megatron_taco.model_outputs import LABEL_COUNTS_SUFFIX, REPRESENTATION, REPRESENTATION_MASK
from megatron_taco.parallel import comm
from megatron_taco.training.callbacks import Callback

COLLAPSE = "collapse_cosine"
BASELINE_SUFFIX = "_baseline_acc"  # "<name>_baseline_acc", beside the head's "<name>_acc"


class CollapseError(RunError):
    pass


@dataclasses.dataclass(frozen=True)
class LearningMonitorConfig:
    collapse_threshold: float = option(
        0.99,
        "An evaluation whose collapse_cosine (mean pairwise cosine of the last-layer vectors of "
        "all evaluated tokens) is at or above this warns that the encoder's outputs are "
        "near-constant across inputs.",
        flag="--collapse-threshold",
    )
    plateau_margin: float = option(
        1.1,
        "After warm-up, an evaluation whose MLM accuracy is below this multiple of the "
        "most-frequent-token baseline warns that the model is still at the unigram level.",
        flag="--plateau-margin",
    )
    exit_on_collapse: bool = option(
        False,
        "Stop the run (exit 1, one line) when --collapse-patience evaluations in a row find the "
        "encoder collapsed. Periodic saves are held back from the first of them (and resume if "
        "it recovers), so the last checkpoint before it stays (an exit's save, at a signal, a "
        "time limit or --exit-interval, still writes one to resume from, and the resumed run "
        "goes on counting). Needs a validation (--eval-iters > 0, a validation part in "
        "--split).",
        flag="--exit-on-collapse",
    )
    collapse_patience: int = option(
        2,
        "Consecutive collapsed evaluations before --exit-on-collapse stops the run (an early "
        "collapse can be transient: TACO-small measured 0.996 at iteration 100 of a short run "
        "and 0.34 at 150).",
        flag="--collapse-patience",
    )

    def __post_init__(self) -> None:
        cls = type(self)
        t = self.collapse_threshold
        require(
            isinstance(t, (int, float)) and 0 < t <= 1,
            cls,
            "collapse_threshold",
            f"must be in (0, 1], got {t!r}",
        )
        m = self.plateau_margin
        require(
            isinstance(m, (int, float)) and math.isfinite(m) and m >= 1,
            cls,
            "plateau_margin",
            f"must be >= 1, got {m!r}",
        )
        p = self.collapse_patience
        require(isinstance(p, int) and p >= 1, cls, "collapse_patience", f"must be >= 1, got {p!r}")


class EvaluationStatistics:
    """Accumulates the non-scalar evaluation outputs above on the device (no host sync per
    micro-batch); ``reduce`` sums them over the data-parallel group in one all-reduce."""

    def __init__(self) -> None:
        self.unit_sum: torch.Tensor | None = None  # [H] float64
        self.tokens: torch.Tensor | None = None  # 0-d float64
        self.counts: dict[str, torch.Tensor] = {}  # name -> [C] float64

    def add(self, outputs: dict[str, Any]) -> None:
        rep = outputs.get(REPRESENTATION)
        if rep is not None:
            mask = outputs[REPRESENTATION_MASK].bool()
            unit = torch.nn.functional.normalize(rep.detach().to(torch.float64), dim=-1)
            unit = unit * mask.unsqueeze(-1)  # [rows, s, H], padding zeroed
            s, n = unit.sum(dim=(0, 1)), mask.sum().to(torch.float64)
            self.unit_sum = s if self.unit_sum is None else self.unit_sum + s
            self.tokens = n if self.tokens is None else self.tokens + n
        for key, value in outputs.items():
            if key.endswith(LABEL_COUNTS_SUFFIX):
                name = key[: -len(LABEL_COUNTS_SUFFIX)]
                v = value.detach().to(torch.float64)
                self.counts[name] = self.counts[name] + v if name in self.counts else v

    def reduce(self, parallel=None) -> dict[str, float]:
        """The figures over every data-parallel rank (tensor-parallel ranks hold the same
        vectors and labels, so they are not summed over); ``parallel`` None: this process's."""
        parts = [self.counts[k] for k in sorted(self.counts)]
        if self.unit_sum is not None:
            parts += [self.unit_sum, self.tokens.reshape(1)]
        if not parts:
            return {}
        flat = torch.cat(parts)
        if parallel is not None and parallel.dp_size > 1:
            comm.all_reduce(flat, parallel.get_data_parallel_group())
        out: dict[str, float] = {}
        offset = 0
        for name in sorted(self.counts):
            c = flat[offset : offset + self.counts[name].numel()]
            offset += c.numel()
            total = float(c.sum())
            if total > 0:
                out[name + BASELINE_SUFFIX] = float(c.max()) / total
        if self.unit_sum is not None:
            unit_sum, n = flat[offset:-1], float(flat[-1])
            if n > 1:
                out[COLLAPSE] = (float(unit_sum.dot(unit_sum)) - n) / (n * (n - 1))
        return out


class LearningMonitor(Callback):
    """Reads each validation's metrics; warns (one line each) and, with --exit-on-collapse,
    holds back saves during a collapse and stops the run when it persists. A callback only
    for its state: the streak is saved in checkpoints, so a run resumed from an exit's save
    made during a collapse goes on counting it."""

    name = "learning_monitor"

    def __init__(
        self, config: LearningMonitorConfig, warmup_iters: int, emit, saves: bool = True
    ) -> None:
        self.config = config
        self.warmup_iters = warmup_iters
        self.emit = emit  # one line to the run's log (rank 0)
        self.saves = saves  # the run has a --save
        self.streak = 0  # consecutive collapsed evaluations
        self.first_collapsed: int | None = None
        self._unwatched_told = False

    @property
    def holds_saves(self) -> bool:
        """True while --exit-on-collapse keeps a collapsed encoder out of the checkpoints."""
        return self.config.exit_on_collapse and self.streak > 0

    def state_dict(self) -> dict[str, Any]:
        return {"streak": self.streak, "first_collapsed": self.first_collapsed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streak = int(state.get("streak", 0))
        self.first_collapsed = state.get("first_collapsed")

    def check(self, iteration: int, metrics: dict[str, float]) -> None:
        self._check_collapse(iteration, metrics.get(COLLAPSE))
        if iteration > self.warmup_iters:
            self._check_plateau(iteration, metrics)

    def check_end(self, iteration: int) -> None:
        """At the end of training: a run still collapsed is not saved over the last good
        checkpoint (--exit-on-collapse)."""
        if self.holds_saves:
            raise CollapseError(
                f"iteration {iteration}: training ended with the encoder collapsed since "
                f"iteration {self.first_collapsed}; not saved (--exit-on-collapse), "
                f"{self._kept()}: lower --lr or lengthen the warm-up"
            )

    def _kept(self) -> str:
        if not self.saves:
            return "nothing is saved without --save"
        return f"the last checkpoint before iteration {self.first_collapsed} is kept"

    def _check_collapse(self, iteration: int, cosine: float | None) -> None:
        cfg = self.config
        if cosine is None:  # the model gives no vectors: nothing known, the streak stands
            if cfg.exit_on_collapse and not self._unwatched_told:
                self._unwatched_told = True
                self.emit(
                    f" WARNING: iteration {iteration}: --exit-on-collapse: the validation "
                    "gives no collapse figure (the model returns no last-layer vectors "
                    "in eval mode); the encoder is not watched"
                )
            return
        if cosine < cfg.collapse_threshold:
            if self.holds_saves:
                self.emit(
                    f" iteration {iteration}: the encoder recovered (mean pairwise cosine "
                    f"{cosine:.4f}); checkpoints are saved again"
                )
            self.streak, self.first_collapsed = 0, None
            return
        self.streak += 1
        if self.first_collapsed is None:  # (not `or`: an evaluation at iteration 0 counts)
            self.first_collapsed = iteration
        message = (
            f"iteration {iteration}: the encoder has collapsed: its last-layer vectors are "
            f"near-constant across inputs (mean pairwise cosine {cosine:.4f} >= "
            f"--collapse-threshold {cfg.collapse_threshold:g})"
        )
        if cfg.exit_on_collapse and self.streak >= cfg.collapse_patience:
            raise CollapseError(
                f"{message}, {self.streak} evaluations in a row since iteration "
                f"{self.first_collapsed}; stopped (--exit-on-collapse), {self._kept()}: lower "
                "--lr or lengthen the warm-up"
            )
        held = ""
        if cfg.exit_on_collapse:
            stop = f"stopping after {cfg.collapse_patience} collapsed evaluations in a row"
            held = (
                f"; checkpoints held back until it recovers ({stop})" if self.saves else f"; {stop}"
            )
        self.emit(f" WARNING: {message}; lower --lr or lengthen the warm-up{held}")

    def _check_plateau(self, iteration: int, metrics: dict[str, float]) -> None:
        for key in sorted(metrics):
            if not key.endswith(BASELINE_SUFFIX):
                continue
            name = key[: -len(BASELINE_SUFFIX)]
            acc, base = metrics.get(f"{name}_acc"), metrics[key]
            if acc is not None and acc < self.config.plateau_margin * base:
                self.emit(
                    f" WARNING: iteration {iteration}: {name}_acc {acc:.4f} is still at the "
                    f"most-frequent-target baseline {base:.4f} (below "
                    f"{self.config.plateau_margin:g}x) after the {self.warmup_iters}-iteration "
                    "warm-up: the model predicts the unigram distribution, not from context"
                )
