"""What a trial's facts make of it (no I/O here).

Outcomes, in this order of precedence:
  hung       an attempt ran past its timeout, or its processes outlived it past the bound
  lost_data  a checkpoint announced as saved is gone or broken at the end, or a restart
             resumed from before it (the campaign's own damage excepted)
  refused    the requeue stopped, the same way twice, with an error and no training
  differed   finished, but a loss, tensor, store byte or the tracker differs from the
             reference
  exact      finished, bit for bit the reference

A trial is a failure when it hung, lost data or differed, when it was refused by anything
but a line (a traceback, several different lines) or after a fault the project promises to
survive (only damage to a checkpoint or the store may be refused), or when one stop cost
more iterations than --save-interval (twice that when the campaign damaged the latest
checkpoint: falling back to the one before it is the way on).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

RANK_PREFIX = re.compile(r"\brank \d+: ")


@dataclasses.dataclass(frozen=True)
class Facts:
    hung: bool
    finished: bool
    differences: list[str]
    lost_data: list[str]
    refusal: list[str]  # the error lines of the attempt that stopped the requeue
    refusal_tracebacks: int
    may_refuse: bool
    landed: list[bool]  # the first fault: did it fire before the job ended by itself
    lost: list[int]  # iterations redone after each stop
    save_interval: int


def one_line(lines: list[str]) -> str | None:
    """The one line every rank printed (a rank prefix aside), else None."""
    distinct = {RANK_PREFIX.sub("", line) for line in lines}
    return next(iter(distinct)) if len(distinct) == 1 else None


def classify(facts: Facts) -> dict[str, Any]:
    if facts.hung:
        outcome = "hung"
    elif facts.lost_data:
        outcome = "lost_data"
    elif not facts.finished:
        outcome = "refused"
    elif facts.differences:
        outcome = "differed"
    else:
        outcome = "exact"
    reasons = []
    if outcome in ("hung", "lost_data", "differed"):
        reasons.append(outcome)
    line = one_line(facts.refusal) if outcome == "refused" else None
    if outcome == "refused":
        if line is None or facts.refusal_tracebacks:
            reasons.append("refused without one clear line")
        if not facts.may_refuse:
            reasons.append("refused after a fault a requeue must survive")
    # A damaged latest checkpoint costs the interval before it too (the fallback's).
    allowed = facts.save_interval * (2 if facts.may_refuse else 1)
    worst = max(facts.lost, default=0)
    over = worst > allowed
    if over:
        reasons.append(f"lost {worst} iterations, more than {allowed} (--save-interval "
                       f"{facts.save_interval})")  # fmt: skip
    return {
        "outcome": outcome,
        "failure": bool(reasons),
        "reasons": reasons,
        "refusal_line": line or (facts.refusal[0] if facts.refusal else None),
        "landed": all(facts.landed) if facts.landed else False,
        "over_interval": over,
        "differences": facts.differences,
        "lost_data": facts.lost_data,
    }
