"""A trial against the run that never failed: per-iteration records of metrics.jsonl, every
tensor of every checkpoint both runs saved (bit for bit), the SAS replacement store byte for
byte, and the tracker. Each function returns a list of differences, one line each (empty:
identical); checking stops listing after a few per file so a report stays readable."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"
MAX_LISTED = 5
# Metrics that measure time or memory, not training: they differ between any two runs.
VOLATILE_KEYS = frozenset({"elapsed_s", "eta_s", "tflops_per_rank"})
VOLATILE_SUFFIXES = ("_ms", "_per_s", "_gib")
# metadata.json entries that name the bytes of the files rather than what they hold: two
# torch.save of equal tensors need not be equal bytes.
METADATA_VOLATILE = frozenset({"files", "checksum"})


def volatile(key: str) -> bool:
    return key in VOLATILE_KEYS or key.endswith(VOLATILE_SUFFIXES)


def read_records(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The records of a metrics.jsonl in order, and how many lines were cut short (a run
    killed mid-write leaves one; the next run starts a new line)."""
    records, broken = [], 0
    if not path.is_file():
        return records, broken
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            broken += 1
            continue
        if isinstance(record, dict) and "split" in record and "iteration" in record:
            records.append(record)
    return records, broken


def same_value(a: Any, b: Any) -> bool:
    """Exact equality; floats by their bits (a NaN equals a NaN, -0.0 differs from 0.0)."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b)
        )
    return type(a) is type(b) and a == b


def compare_records(reference: list[dict], trial: list[dict], train_iters: int) -> list[str]:
    """Every record the trial logged (a redone iteration logs twice) must equal the
    reference's record of that split and iteration in every key but the volatile ones, and
    every training iteration must be there."""
    want = {(r["split"], r["iteration"]): r for r in reference}
    diffs: list[str] = []
    for record in trial:
        key = (record["split"], record["iteration"])
        ref = want.get(key)
        if ref is None:
            diffs.append(f"metrics: {key[0]} iteration {key[1]} is not in the reference")
            continue
        keys = sorted((set(ref) | set(record)) - {k for k in ref if volatile(k)})
        for k in keys:
            if k not in record or k not in ref or not same_value(record[k], ref[k]):
                diffs.append(
                    f"metrics: {key[0]} iteration {key[1]} {k}: "
                    f"{record.get(k, 'missing')!r} != reference {ref.get(k, 'missing')!r}"
                )
                break
    logged = {r["iteration"] for r in trial if r["split"] == "train"}
    missing = sorted(set(range(1, train_iters + 1)) - logged)
    if missing:
        diffs.append(f"metrics: training iterations never logged: {missing}")
    return _few(diffs)


def _few(diffs: list[str]) -> list[str]:
    if len(diffs) <= MAX_LISTED:
        return diffs
    return [*diffs[:MAX_LISTED], f"... and {len(diffs) - MAX_LISTED} more"]


# -- tensors ------------------------------------------------------------------------------


def leaves(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf of nested dicts/lists/tuples (and objects' attributes) by its path."""
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(leaves(v, f"{prefix}/{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(leaves(v, f"{prefix}/{i}"))
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.Tensor, type)):
        # An object the safe loader allows (DeepSpeed's loss scaler): its attributes.
        out[f"{prefix}/<class>"] = type(obj).__qualname__
        out.update(leaves(vars(obj), prefix))
    else:
        out[prefix or "/"] = obj
    return out


_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """One integer per element holding its bits (bytes for wider elements)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(_INTS.get(flat.element_size(), torch.uint8))


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit: dtype, shape and every byte (one ulp is a difference)."""
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(_bits(a), _bits(b)))


def compare_leaves(reference: Any, trial: Any, where: str, limit: int | None = MAX_LISTED
                   ) -> list[str]:  # fmt: skip
    ref, got = leaves(reference), leaves(trial)
    diffs = [f"{where}{k}: missing" for k in sorted(set(ref) - set(got))]
    diffs += [f"{where}{k}: not in the reference" for k in sorted(set(got) - set(ref))]
    for k in sorted(set(ref) & set(got)):
        a, b = ref[k], got[k]
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if not same_tensor(a, b):
                diffs.append(f"{where}{k}: tensor differs ({_first_difference(a, b)})")
        elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            diffs.append(f"{where}{k}: {type(b).__name__} != reference {type(a).__name__}")
        elif not same_value(a, b):
            diffs.append(f"{where}{k}: {b!r} != reference {a!r}")
    return _few(diffs) if limit else diffs


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{b.dtype}{list(b.shape)} vs reference {a.dtype}{list(a.shape)}"
    differ = torch.nonzero(_bits(a) != _bits(b)).reshape(-1)
    i = int(differ[0])
    if _bits(a).numel() != a.numel():  # compared by bytes
        return f"{len(differ)} byte(s) differ, first at byte {i}"
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    return f"{len(differ)} element(s), first [{i}]: {flat_b[i].item()!r} vs {flat_a[i].item()!r}"


def load_tensors(path: Path) -> Any:
    """A checkpoint file, read as the project reads one (weights_only, no code runs)."""
    from megatron_taco.checkpoint.safe_files import safe_torch_load

    return safe_torch_load(str(path))


def _drop(meta: dict[str, Any], dotted: str) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        meta = meta.get(key) if isinstance(meta, dict) else None
    if isinstance(meta, dict):
        meta.pop(last, None)


def compare_checkpoint(reference: Path, trial: Path, ignore: tuple[str, ...] = ()) -> list[str]:
    """One iteration's directory: the same files, equal metadata.json (but for the bytes it
    records), every tensor and number equal. Where only the optimizer files' flat ZeRO
    partitions differ, the project's consolidation decides: DeepSpeed pads those partitions
    with memory it never initialises (seen at ZeRO-3), so only the tensors consolidation
    reads from them (parameters, masters, moments) must be equal."""
    ref_files = sorted(p.name for p in reference.iterdir())
    got_files = sorted(p.name for p in trial.iterdir())
    if ref_files != got_files:
        return [f"{trial.name}: files {got_files} != reference {ref_files}"]
    diffs: list[str] = []
    flat: list[str] = []  # differences in tensors of the optimizer files
    for name in ref_files:
        where = f"{trial.name}/{name}"
        if name == METADATA:
            ref, got = (json.loads((d / name).read_text()) for d in (reference, trial))
            for key in (*METADATA_VOLATILE, *ignore):
                _drop(ref, key), _drop(got, key)
            diffs += compare_leaves(ref, got, where)
        elif name.endswith(".pt"):
            found = compare_leaves(load_tensors(reference / name), load_tensors(trial / name),
                                   where, limit=None)  # fmt: skip
            optim = name.endswith("optim_states.pt")
            flat += [d for d in found if optim and ": tensor differs" in d]
            diffs += [d for d in found if not (optim and ": tensor differs" in d)]
        elif (reference / name).read_bytes() != (trial / name).read_bytes():
            diffs.append(f"{where}: bytes differ")
    if flat:
        consolidated = compare_consolidated(reference, trial)
        diffs += consolidated + (flat if consolidated else [])
    return _few(diffs)


def compare_consolidated(reference: Path, trial: Path) -> list[str]:
    """Every tensor as the project's consolidation reads it (full, unpadded, by family),
    the optimizer's step and hyperparameters."""
    from megatron_taco.recipes.registry import read_checkpoint

    it = int(trial.name.removeprefix("iter_"))
    (ref, _, _), (got, _, _) = (read_checkpoint(str(d.parent), it) for d in (reference, trial))
    where = f"{trial.name} (consolidated)"
    return compare_leaves(
        {"families": ref.families, "step": ref.step, "groups": ref.param_groups},
        {"families": got.families, "step": got.step, "groups": got.param_groups},
        where,
    )


def checkpoint_iterations(save: Path) -> list[int]:
    out = []
    for p in save.iterdir() if save.is_dir() else ():
        name = p.name
        if name.startswith("iter_") and name[5:].isdigit() and p.is_dir():
            out.append(int(name[5:]))
    return sorted(out)


def leftovers(save: Path) -> list[str]:
    """What a save leaves while it is in progress: ``iter_N.tmp-*``, ``iter_N.del-*``."""
    if not save.is_dir():
        return []
    return sorted(p.name for p in save.iterdir() if ".tmp-" in p.name or ".del-" in p.name)


def read_tracker(save: Path) -> int | None:
    try:
        text = (save / TRACKER).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def compare_saves(reference: Path, trial: Path, train_iters: int, ignore: tuple[str, ...] = ()
                  ) -> list[str]:  # fmt: skip
    """The tracker names the last iteration; every checkpoint the reference has is in the
    trial and equal (an exit's save adds others: they have no reference)."""
    diffs = []
    tracked = read_tracker(trial)
    if tracked != train_iters:
        diffs.append(f"tracker: names {tracked}, expected {train_iters}")
    ref_iters, got_iters = checkpoint_iterations(reference), checkpoint_iterations(trial)
    missing = sorted(set(ref_iters) - set(got_iters))
    if missing:
        diffs.append(f"checkpoints: iterations {missing} missing (reference has {ref_iters})")
    for it in sorted(set(ref_iters) & set(got_iters)):
        name = f"iter_{it:07d}"
        diffs += compare_checkpoint(reference / name, trial / name, ignore)
    return diffs


def compare_store(reference: Path, trial: Path) -> list[str]:
    """Byte for byte: the same files with the same contents."""

    def files(root: Path) -> dict[str, Path]:
        if not root.is_dir():
            return {}
        return {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}

    ref, got = files(reference), files(trial)
    diffs = [f"store: {name} missing" for name in sorted(set(ref) - set(got))]
    diffs += [f"store: {name} not in the reference" for name in sorted(set(got) - set(ref))]
    for name in sorted(set(ref) & set(got)):
        a, b = ref[name].read_bytes(), got[name].read_bytes()
        if a != b:
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            diffs.append(f"store: {name} differs from byte {first} (sizes {len(b)}, {len(a)})")
    return _few(diffs)


def undo_damage(damage: dict[str, Any] | None) -> bool:
    """Put back the byte the campaign changed, if the file still holds the changed byte at
    that place (the run never rewrote it): what the run did is compared, not what the
    campaign did. True when a byte was put back."""
    if not damage or "file" not in damage:
        return False
    path = Path(damage["file"])
    try:
        data = bytearray(path.read_bytes())
    except OSError:
        return False
    offset = damage["offset"]
    if offset >= len(data) or data[offset] != damage["new"]:
        return False
    data[offset] = damage["old"]
    path.write_bytes(bytes(data))
    return True


def directory_bytes(path: Path) -> int:
    return sum(os.path.getsize(p) for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0
