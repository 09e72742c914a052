"""The campaign's summary: counts by outcome, by fault kind and place, iterations lost and
time to a running job again, and the trials to look at with the command that replays each."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from benchmarks.faults.plan import MAY_REFUSE

OUTCOMES = ("exact", "refused", "differed", "hung", "lost_data")


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "worst": None, "n": 0}
    return {"median": statistics.median(values), "worst": max(values), "n": len(values)}


def stops(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The stops a landed fault caused (an operator's --load-fallback run is not one)."""
    faulted = {a["index"] for a in result["attempts"] if a["fault"] and a["landed"]}
    return [x for x in result["iterations_lost"] if x["attempt"] in faulted]


def landed(result: dict[str, Any]) -> bool:
    """Whether the trial's (first) fault fired before its job ended by itself."""
    return bool(result["attempts"] and result["attempts"][0]["landed"])


def summarize(results: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    counts = {k: sum(r["outcome"] == k for r in results) for k in OUTCOMES}
    # Stops a requeue must survive (no damage done by the campaign), and the others.
    survivable = [r for r in results if r["kind"] not in MAY_REFUSE]
    damaged = [r for r in results if r["kind"] in MAY_REFUSE]
    by_place: dict[str, dict[str, dict[str, int]]] = defaultdict(dict)
    for r in results:
        row = by_place[r["kind"]].setdefault(r["place"], {k: 0 for k in (*OUTCOMES, "trials",
                                                                         "failures", "missed")})  # fmt: skip
        row["trials"] += 1
        row[r["outcome"]] += 1
        row["failures"] += r["failure"]
        row["missed"] += not landed(r)
    return {
        "trials": len(results),
        **counts,
        "failures": sum(r["failure"] for r in results),
        "missed": sum(not landed(r) for r in results),
        "over_interval": sum(r["over_interval"] for r in results),
        "fallback_exact": sum(
            r["outcome"] == "refused" and bool(r.get("fallback")) and not r["differences"]
            for r in results
        ),  # fmt: skip
        "iterations_lost": _lost(survivable),
        "iterations_lost_per_save_interval": _lost(survivable, per_interval=True),
        "iterations_lost_after_damage": _lost(damaged),
        "recovery_s": _stats(
            [s["recovery_s"] for r in survivable for s in stops(r) if s["recovery_s"] is not None]
        ),  # fmt: skip
        "by_kind": by_place,
        "not_exact": [
            {
                k: r[k]
                for k in (
                    "trial",
                    "seed",
                    "config",
                    "faults",
                    "outcome",
                    "reasons",
                    "refusal_line",
                    "fallback",
                    "replay",
                )
                if k in r
            }  # fmt: skip
            for r in results
            if r["outcome"] != "exact"
        ],
        **extra,
    }


def _lost(results: list[dict[str, Any]], per_interval: bool = False) -> dict[str, float | None]:
    return _stats([s["lost"] / (r["save_interval"] if per_interval else 1)
                   for r in results for s in stops(r) if s["lost"] is not None])  # fmt: skip


def table(summary: dict[str, Any]) -> str:
    head = ("kind", "place", "n", "exact", "refused", "differed", "hung", "lost", "fail", "missed")
    rows = [head]
    for kind in sorted(summary["by_kind"]):
        for place, c in sorted(summary["by_kind"][kind].items()):
            rows.append((kind, place, c["trials"], c["exact"], c["refused"], c["differed"],
                         c["hung"], c["lost_data"], c["failures"], c["missed"]))  # fmt: skip
    rows.append(("all", "", summary["trials"], *(summary[k] for k in OUTCOMES),
                 summary["failures"], summary["missed"]))  # fmt: skip
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
    lines = ["  ".join(str(v).ljust(w) for v, w in zip(r, widths)) for r in rows]
    lost, ratio, rec = (summary[k] for k in ("iterations_lost",
                                             "iterations_lost_per_save_interval", "recovery_s"))  # fmt: skip
    lines.append(
        f"iterations lost per stop: median {lost['median']}, worst {lost['worst']} "
        f"(per --save-interval: median {_num(ratio['median'])}, worst {_num(ratio['worst'])}; "
        f"{lost['n']} stops)"
    )
    damaged = summary["iterations_lost_after_damage"]
    lines.append(f"  after the campaign damaged a checkpoint or the store (the fallback's): "
                 f"median {damaged['median']}, worst {damaged['worst']}")  # fmt: skip
    lines.append(
        f"fault to a running job again: median {_num(rec['median'])} s, worst "
        f"{_num(rec['worst'])} s"
    )
    for r in summary["not_exact"]:
        lines.append(f"  {r.get('trial')}: {r['outcome']} {r['reasons']} {r['faults']} "
                     f"[{r['config']}] -> {r.get('replay')}")  # fmt: skip
    return "\n".join(lines)


def markdown(summary: dict[str, Any]) -> str:
    """The table docs/reliability.md carries."""
    out = ["| fault | place | trials | exact | refused | differed | hung | lost data |",
           "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for kind in sorted(summary["by_kind"]):
        for place, c in sorted(summary["by_kind"][kind].items()):
            out.append(f"| {kind} | {place} | {c['trials']} | {c['exact']} | {c['refused']} | "
                       f"{c['differed']} | {c['hung']} | {c['lost_data']} |")  # fmt: skip
    out.append(f"| **all** | | {summary['trials']} | "
               + " | ".join(str(summary[k]) for k in OUTCOMES) + " |")  # fmt: skip
    return "\n".join(out)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
