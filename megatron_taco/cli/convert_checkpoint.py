"""Re-shard a TACO or SAS checkpoint for another tensor/data-parallel size, ZeRO stage or
precision, or consolidate it into one full fp32 state dict (taco-convert-checkpoint,
tools/convert_checkpoint.py).

    python tools/convert_checkpoint.py --load ckpt --save ckpt_tp2 \\
        --tensor-model-parallel-size 2 --data-parallel-size 4 \\
        --deepspeed-config ds_configs/zero1_bf16.json
    python tools/convert_checkpoint.py --load ckpt --consolidate model.safetensors

The new --save directory holds one checkpoint in DeepSpeed's layout for the new sizes,
optimizer state included (Adam moments, fp32 master weights, step), with the same
iteration, consumed samples, LR-scheduler position and callback states, so a run started
with ``--load NEW_DIR`` continues where the old one stopped. RNG states are per rank: they
are copied only when the layout is unchanged; otherwise resume with ``--no-load-rng``.
A SAS replacement store found under the old --load is copied along: only the files its
generation manifests name, checked against their sizes and CRC-32s; a symbolic link, FIFO or
device anywhere in it is refused by name (a checkpoint is someone else's input).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import sys
from typing import Any

import torch

from megatron_taco import io
from megatron_taco.arguments import run_cli
from megatron_taco.checkpoint.config import CheckpointConfig
from megatron_taco.checkpoint.deepspeed_files import (
    CheckpointInfo,
    TargetLayout,
    TrainingStates,
    ds_format,
    write_states,
)
from megatron_taco.checkpoint.errors import CheckpointError
from megatron_taco.checkpoint.layout import checkpoint_tag, rng_state_path, tracker_path
from megatron_taco.checkpoint.manifest import manifest_entry, write_metadata
from megatron_taco.checkpoint.ownership import check_new_save
from megatron_taco.checkpoint.plan import ResumeRequest, find_checkpoint, plan_resume
from megatron_taco.checkpoint.reshard import ModelLayout
from megatron_taco.checkpoint.safe_files import (
    UnsafeFile,
    copy_regular,
    read_regular,
    regular_files,
    unsafe_globals,
)
from megatron_taco.cli import tool_parser
from megatron_taco.cli.hf_extra import MissingExtra, require_hf_extra
from megatron_taco.data.replacement_store import MANIFEST_NAME, Manifest
from megatron_taco.data.tokenizer import load_tokenizer, save_tokenizer_copy, saved_tokenizer_record
from megatron_taco.errors import ConfigError
from megatron_taco.recipes.registry import checkpoint_tokenizer, read_checkpoint
from megatron_taco.training.deepspeed_config import load_deepspeed_json

PROG = "convert_checkpoint.py"
STORE = "replacement_store"
_GENERATION = re.compile(r"gen_\d{5,}")


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser(PROG, __doc__, allow_abbrev=False)
    p.add_argument("--load", required=True, help="Checkpoint directory (a --save of training).")
    p.add_argument("--ckpt-step", type=int, help="Iteration to convert (default: the latest).")
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument("--save", help="New checkpoint directory (must not hold checkpoints).")
    out.add_argument(
        "--consolidate",
        metavar="FILE",
        help="Write the full model state dict in float32 to FILE (.safetensors or .pt).",
    )
    p.add_argument(
        "--tensor-model-parallel-size", type=int, help="New size (default: the checkpoint's)."
    )
    p.add_argument("--data-parallel-size", type=int, help="New size (default: the checkpoint's).")
    p.add_argument(
        "--deepspeed-config",
        help="The DeepSpeed JSON of the run that will load it: its ZeRO stage (0-2) and "
        "precision decide the files written (default: the checkpoint's).",
    )
    p.add_argument(
        "--tokenizer-model",
        help="Tokenizer of the run (default: the one its metadata.json names); only its "
        "vocabulary size is read, to remove the tensor-parallel vocabulary padding.",
    )
    return p


def _target_ds_config(info: CheckpointInfo, path: str | None) -> dict[str, Any]:
    saved = dict(info.configs.get("deepspeed") or {})
    if path is None:
        return saved
    new = load_deepspeed_json(path)
    # The saved key order where keys stay (what DeepSpeed would write for the same JSON).
    # The precision's dtypes go with it: a bf16 ZeRO-2 JSON's fp32 accumulation must not
    # survive into a ZeRO-0 target, where DeepSpeed refuses it.
    sections = ("zero_optimization", "bf16", "fp16", "data_types", "communication_data_type")
    merged = {k: v for k, v in saved.items() if k not in sections or k in new}
    merged.update(new)
    return merged


def _target(args, states: TrainingStates, config, build) -> TargetLayout:
    info = states.info
    tp = args.tensor_model_parallel_size or info.tp_size
    dp = args.data_parallel_size or info.dp_size
    if tp < 1 or dp < 1:
        raise ConfigError("--tensor-model-parallel-size and --data-parallel-size must be >= 1")
    config.validate_parallel(tp)
    ds_config = _target_ds_config(info, args.deepspeed_config)
    stage, precision = ds_format(ds_config)
    if args.deepspeed_config is None:
        stage, precision = info.zero_stage, info.precision
    layout = ModelLayout(build, tp, config.vocab_size)
    return TargetLayout(layout, dp, stage, precision, ds_config)


def _metadata(states: TrainingStates, target: TargetLayout, args, rng: bool) -> dict[str, Any]:
    info, tp, dp = states.info, target.layout.tp_size, target.dp_size
    meta = {k: v for k, v in copy.deepcopy(info.meta).items() if k not in ("files", "checksum")}
    configs = meta.setdefault("configs", {})
    configs.setdefault("parallel", {})["tensor_model_parallel_size"] = tp
    configs["deepspeed"] = target.ds_config
    if args.deepspeed_config is not None:
        configs.setdefault("training", {})["deepspeed_config"] = args.deepspeed_config
    meta.update(world_size=tp * dp, tensor_model_parallel_size=tp, data_parallel_size=dp)
    meta["rng_states"] = rng
    meta["converted_from"] = {
        "load": os.path.abspath(args.load),
        "iteration": info.iteration,
        "tensor_model_parallel_size": info.tp_size,
        "data_parallel_size": info.dp_size,
        "zero_stage": info.zero_stage,
        "precision": info.precision,
    }
    return meta


def _copy_rng(info: CheckpointInfo, target: TargetLayout, tmp: str) -> list[str]:
    """The RNG files, when every rank keeps its place and they load safely: copied without
    following links, and checked against the manifest that was verified."""
    same = (target.layout.tp_size, target.dp_size) == (info.tp_size, info.dp_size)
    paths = [rng_state_path(info.iter_dir, r) for r in range(info.tp_size * info.dp_size)]
    names = [os.path.basename(p) for p in paths]
    if not same or not all(n in info.meta["files"] for n in names):
        return []
    if any(unsafe_globals(p) for p in paths):
        return []
    for path, name in zip(paths, names):
        _copy_checked(path, os.path.join(tmp, name), info.meta["files"][name])
    return names


def _copy_checked(src: str, dst: str, entry: dict[str, Any]) -> None:
    try:
        size, crc = copy_regular(src, dst)
    except UnsafeFile as e:
        raise CheckpointError(str(e)) from None
    except OSError as e:
        raise CheckpointError(f"{src}: cannot be copied ({e.strerror or e})") from None
    want = (entry["bytes"], entry["crc32"])
    if (size, crc) != want:
        raise CheckpointError(
            f"{src} changed while it was copied ({size} bytes, CRC-32 {crc}; its manifest "
            f"says {want[0]} bytes, {want[1]})"
        )


def save_converted(states: TrainingStates, target: TargetLayout, args) -> tuple[str, bool, str]:
    """Write the converted checkpoint into a temporary directory, then rename it into place
    and write the tracker (fsynced, and the directory too), so --save never holds a partial
    checkpoint. Returns (its directory, whether it holds the RNG states, a note on the
    replacement store copied along)."""
    save, tag = args.save, checkpoint_tag(states.info.iteration)
    check_new_save(save)  # again: nothing may have appeared since the plan
    os.makedirs(save, exist_ok=True)
    tmp = os.path.join(save, f"{tag}.tmp-convert-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        rng = _copy_rng(states.info, target, tmp)
        files = {}
        for name in write_states(states, target, tmp) + rng:
            io.fsync_file(os.path.join(tmp, name))
            files[name] = manifest_entry(os.path.join(tmp, name))
        meta = _metadata(states, target, args, rng=bool(rng))
        meta["tokenizer"] = _copy_tokenizer(states.info, args.tokenizer_model, save)
        write_metadata(tmp, meta, files)
        io.fsync_dir(tmp)
        os.rename(tmp, os.path.join(save, tag))
        io.fsync_dir(save)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    note = _copy_store(args.load, save)
    io.atomic_write(tracker_path(save), f"{states.info.iteration}\n")
    return os.path.join(save, tag), bool(rng), note


def _copy_tokenizer(info: CheckpointInfo, tokenizer_model: str | None, save: str) -> dict:
    """The new --save holds the tokenizer too (metadata.json "tokenizer" names the copy)."""
    tokenizer = load_tokenizer(*checkpoint_tokenizer(info, tokenizer_model))
    record = saved_tokenizer_record(tokenizer)
    save_tokenizer_copy(save, tokenizer, record)
    return record


def _copy_store(load: str, save: str) -> str:
    """SAS self-augmentation keeps its replacements under --save; they do not depend on the
    parallel layout. Copies the committed generations (manifest, layout, the shards the
    manifest names, each checked against it) into a temporary directory renamed into place;
    returns what was copied, for the summary line."""
    store, target = os.path.join(load, STORE), os.path.join(save, STORE)
    if not os.path.lexists(store) or os.path.lexists(target):
        return ""
    try:
        present = regular_files(store)  # refuses any link, FIFO or device in it
    except UnsafeFile as e:
        raise CheckpointError(f"{e} (in the SAS replacement store of --load)") from None
    copies: dict[str, tuple[int, str] | None] = {}  # name -> (bytes, crc32) or unchecked
    for name in present:
        generation, _, leaf = name.partition("/")
        if leaf != MANIFEST_NAME or not _GENERATION.fullmatch(generation):
            continue
        path = os.path.join(store, name)
        try:
            manifest = Manifest.from_json(json.loads(read_regular(path, 16 << 20)))
        except (ValueError, OSError) as e:  # ReplacementStoreError is a ValueError
            raise CheckpointError(f"{path}: not a replacement-store manifest ({e})") from None
        copies[name] = None
        if f"{generation}/layout.json" in present:
            copies[f"{generation}/layout.json"] = None
        for record in manifest.shards:
            copies[f"{generation}/{record.file}"] = (record.bytes, f"{record.crc32:08x}")
    tmp = f"{target}.tmp-{os.getpid()}"
    try:
        for name, expected in sorted(copies.items()):
            os.makedirs(os.path.dirname(os.path.join(tmp, name)), exist_ok=True)
            src = os.path.join(store, name)
            if expected is None:
                copy_regular(src, os.path.join(tmp, name))
            else:
                _copy_checked(src, os.path.join(tmp, name), dict(zip(("bytes", "crc32"), expected)))
        os.makedirs(tmp, exist_ok=True)
        os.rename(tmp, target)
        io.fsync_dir(save)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    skipped = len(present) - len(copies)
    generations = sum(1 for name in copies if name.endswith("/" + MANIFEST_NAME))
    return f"; replacement store: {generations} committed generation(s), {len(copies)} files" + (
        f" ({skipped} not named by a manifest skipped)" if skipped else ""
    )


def save_consolidated(states: TrainingStates, path: str) -> None:
    state_dict = states.full_state_dict()
    with io.atomic_path(path) as tmp:  # given the umask's mode: safetensors writes 0600
        if path.endswith(".safetensors"):
            from safetensors.torch import save_file

            info = states.info
            meta = {
                "model": info.model,
                "iteration": str(info.iteration),
                "model_config": json.dumps(info.configs.get("model") or {}),
            }
            save_file(state_dict, tmp, metadata=meta)
        else:
            torch.save(state_dict, tmp)


def _describe(tp: int, dp: int, stage: int, precision: str) -> str:
    return f"tp {tp} x dp {dp}, ZeRO {stage} {precision}"


def convert(args: argparse.Namespace) -> str:
    if args.consolidate and args.consolidate.endswith(".safetensors"):
        require_hf_extra(f"--consolidate {args.consolidate}", ("safetensors",))
    # What to read, and whether --save may receive it: decided as for every --load.
    request = ResumeRequest(
        CheckpointConfig(load=args.load, ckpt_step=args.ckpt_step, save=args.save), required=True
    )
    info = find_checkpoint(args.load, plan_resume(request).iteration, verify=False)
    states, config, build = read_checkpoint(info, tokenizer_model=args.tokenizer_model)
    info = states.info
    source = _describe(info.tp_size, info.dp_size, info.zero_stage, info.precision)
    if args.consolidate:
        save_consolidated(states, args.consolidate)
        return (
            f"{info.iter_dir} ({info.model}, {source}) -> {args.consolidate}: "
            f"{len(states.families['module'])} full float32 tensors"
        )
    target = _target(args, states, config, build)
    out, rng, note = save_converted(states, target, args)
    layout = _describe(target.layout.tp_size, target.dp_size, target.zero_stage, target.precision)
    return (
        f"{info.iter_dir} ({info.model}, {source}) -> {out} ({layout}){note}; resume with "
        f"--load {args.save}{'' if rng else ' --no-load-rng'}"
    )


def main(argv: list[str] | None = None) -> int:
    return run_cli(
        build_parser(),
        argv,
        lambda args: print(convert(args)),
        user_errors=(CheckpointError, MissingExtra),
    )


if __name__ == "__main__":
    sys.exit(main())
