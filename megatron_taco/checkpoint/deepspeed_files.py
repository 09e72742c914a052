"""DeepSpeed's files of a checkpoint: read and written by ourselves (never DeepSpeed's own
unrestricted loaders) for conversion and export, and DeepSpeed's checkpoint engine made safe
for training.

DeepSpeed's files are read and written for ZeRO stages 0-2 (the per-parameter optimizer of
stage 0, plain or wrapped with fp32 master weights for bf16/fp16, and the flat data-parallel
partitions of stages 1-2); fp16 only from fp16, whose loss scale cannot be made up:

    mp_rank_XX_model_states.pt                      module, client state, stage-0 optimizer
    [bf16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt  stage 1-2 optimizer partition D

ZeRO-3 checkpoints (parameters partitioned over the data-parallel ranks, saved empty) are
read too, never written: DeepSpeed's own zero_to_fp32 reassembles each tensor-parallel
rank's parameters and optimizer moments from its data-parallel partitions (the files are
loaded here with weights_only=True, not by zero_to_fp32's unrestricted torch.load), and the
tp ranks are then merged like the others':

    zero_pp_rank_D_mp_rank_XX_model_states.pt        client state, parameter shapes
    [bf16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt  fp32 partition D and its moments

Every tensor of a checkpoint is kept by *family*: ``module`` (the module state dict, in the
dtype it was saved in), ``master`` (fp32 master weights, where the optimizer keeps them) and
the optimizer moments (``exp_avg``, ``exp_avg_sq``, ...), each a {name: full tensor} dict.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import io
import math
import os
import re
from collections import OrderedDict
from itertools import accumulate
from typing import Any

import torch

from megatron_taco.checkpoint.errors import CheckpointError
from megatron_taco.checkpoint.layout import checkpoint_tag
from megatron_taco.checkpoint.reshard import ModelLayout, Tensors
from megatron_taco.checkpoint.safe_files import safe_torch_load
from megatron_taco.errors import ConfigError

# The command that converts a checkpoint; error messages name it.
CONVERTER = "taco-convert-checkpoint"


_MODEL_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")


_ZERO3_MODEL_FILE = re.compile(r"^zero_pp_rank_\d+_mp_rank_(\d+)_model_states\.pt$")


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    iter_dir: str
    iteration: int
    meta: dict[str, Any]  # metadata.json
    tp_size: int
    dp_size: int
    zero_stage: int
    precision: str

    @property
    def model(self) -> str:
        return str(self.meta.get("model", "TACO"))

    @property
    def configs(self) -> dict[str, Any]:
        return self.meta.get("configs") or {}

    def model_file(self, tp_rank: int, dp_rank: int | None = None) -> str:
        return os.path.join(self.iter_dir, model_states_name(tp_rank, dp_rank))

    def zero_file(self, dp_rank: int, tp_rank: int) -> str:
        return os.path.join(self.iter_dir, optim_states_name(self.precision, dp_rank, tp_rank))


def model_states_name(tp_rank: int, dp_rank: int | None = None) -> str:
    """DeepSpeed's model states file of tensor-parallel rank ``tp_rank``; ZeRO-3 keeps one
    per data-parallel rank (``dp_rank``)."""
    zero3 = "" if dp_rank is None else f"zero_pp_rank_{dp_rank}_"
    return f"{zero3}mp_rank_{tp_rank:02d}_model_states.pt"


def optim_states_name(precision: str, dp_rank: int, tp_rank: int) -> str:
    prefix = "bf16_" if precision == "bf16" else ""
    return f"{prefix}zero_pp_rank_{dp_rank}_mp_rank_{tp_rank:02d}_optim_states.pt"


def ds_format(ds_config: dict[str, Any] | None) -> tuple[int, str]:
    """(ZeRO stage, precision) of a DeepSpeed config dict."""
    ds_config = ds_config or {}
    zero = ds_config.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0)) if isinstance(zero, dict) else 0

    def enabled(key: str) -> bool:
        section = ds_config.get(key)
        return isinstance(section, dict) and bool(section.get("enabled", False))

    return stage, "fp16" if enabled("fp16") else "bf16" if enabled("bf16") else "fp32"


def describe_checkpoint(load_dir: str, iteration: int, meta: dict[str, Any]) -> CheckpointInfo:
    """What DeepSpeed's files of a checkpoint are (layout, ZeRO stage, precision), from its
    metadata.json (read_metadata checked its fields) and, for ZeRO-3, its file names."""
    iter_dir = os.path.join(load_dir, checkpoint_tag(iteration))
    stage, precision = ds_format(meta.get("configs", {}).get("deepspeed"))
    if glob.glob(os.path.join(iter_dir, "zero_pp_rank_*_model_states.pt")):
        stage = 3
    tp, dp = meta["tensor_model_parallel_size"], meta["data_parallel_size"]
    return CheckpointInfo(iter_dir, iteration, meta, tp, dp, stage, precision)


def load_file(path: str) -> Any:
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} does not exist")
    return safe_torch_load(path)


@dataclasses.dataclass
class TrainingStates:
    """Every tensor of a checkpoint, full (tp-merged, unpadded), by family, plus what
    DeepSpeed needs to resume: the optimizer's step, hyperparameters and loss-scale state,
    and the model file's other entries (LR scheduler, step counters, client state)."""

    info: CheckpointInfo
    families: dict[str, Tensors]  # "module", "master" (if any), moments ("exp_avg", ...)
    step: Any = None
    param_groups: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    optimizer_extras: dict[str, Any] = dataclasses.field(default_factory=dict)
    client: dict[str, Any] = dataclasses.field(default_factory=dict)
    zero_template: dict[str, Any] | None = None

    @property
    def moment_keys(self) -> list[str]:
        return [k for k in self.families if k not in ("module", "master")]

    def full_state_dict(self) -> Tensors:
        """The model's full state dict in float32 (fp32 master weights where kept)."""
        master = self.families.get("master", {})
        out: Tensors = {}
        for name, tensor in self.families["module"].items():
            value = master.get(name, tensor)
            value = value.float() if value.is_floating_point() else value
            out[name] = value.detach().contiguous().clone()
        return out


@dataclasses.dataclass
class _RankStates:
    families: dict[str, Tensors]
    step: Any = None
    param_groups: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)
    zero_template: dict[str, Any] | None = None


def _hyper(groups: list[dict]) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def _torch_optimizer(sd: Any, layout: ModelLayout, what: str) -> _RankStates:
    """A torch optimizer state dict (stage 0) -> per-parameter families."""
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise CheckpointError(f"{what}: the optimizer state is not a torch optimizer state dict")
    counts = [len(g["params"]) for g in sd["param_groups"]]
    if counts != [len(names) for names in layout.groups]:
        raise CheckpointError(
            f"{what}: optimizer groups hold {counts} parameters, the model in metadata.json "
            f"{[len(n) for n in layout.groups]}"
        )
    out = _RankStates(families={}, param_groups=_hyper(sd["param_groups"]))
    for group, names in zip(sd["param_groups"], layout.groups):
        for index, name in zip(group["params"], names):
            for key, value in sd["state"].get(index, {}).items():
                if key == "step":
                    out.step = value
                elif torch.is_tensor(value) and value.dim() > 0:
                    out.families.setdefault(key, {})[name] = value
    # torch keeps no state for a parameter that never had a gradient: its moments are zero.
    for family in out.families.values():
        for name, lay in layout.params.items():
            if name not in family:
                family[name] = torch.zeros(lay.shape)
    return out


def _stage0(optimizer: Any, layout: ModelLayout, what: str) -> _RankStates:
    if isinstance(optimizer, dict) and "fp32_groups_flat" in optimizer:
        raise CheckpointError(
            f"{what}: DeepSpeed's fused FP16_Optimizer layout (fp32_groups_flat) is not supported"
        )
    if not (isinstance(optimizer, dict) and "optimizer_state_dict" in optimizer):
        return _torch_optimizer(optimizer, layout, what)
    # bf16/fp16 without ZeRO: fp32 masters per parameter beside the torch state.
    out = _torch_optimizer(optimizer["optimizer_state_dict"], layout, what)
    masters = optimizer.get("fp32_groups") or []
    out.families["master"] = {
        name: tensor
        for tensors, names in zip(masters, layout.groups)
        for name, tensor in zip(names, tensors)
    }
    out.extras = {
        k: v for k, v in optimizer.items() if k not in ("optimizer_state_dict", "fp32_groups")
    }
    return out


def _unflatten(flat: torch.Tensor, names: list[str], layout: ModelLayout) -> Tensors:
    out, offset = {}, 0
    for name in names:
        shape = layout.params[name].shape
        n = math.prod(shape)
        out[name] = flat[offset : offset + n].view(shape).clone()
        offset += n
    return out


def _real_partition(osd: dict, g: int) -> torch.Tensor:
    """A rank's fp32 partition of flat group ``g`` without the alignment padding. ZeRO 1/2
    save it without; DeepSpeed's BF16_Optimizer (what zero1_bf16 builds: ZeRO-1 with fp32
    gradient accumulation) keeps it, the last rank's ``group_paddings[g]`` elements. Both
    load each other's files: their partitions are cut alike (2 x dp alignment) and the
    moments are saved padded by both."""
    part = osd["single_partition_of_fp32_groups"][g].reshape(-1)
    if "zero_stage" in osd:
        return part
    return part[: part.numel() - int(osd["group_paddings"][g])]


def _zero_group(osds: list[dict], g: int, names: list[str], layout: ModelLayout, what: str):
    """Group ``g`` of every data-parallel partition -> (master, {moment: tensors}, step)."""
    # Padding sits only at the end of the flat group: the partitions' real elements,
    # concatenated in rank order, are the group's parameters back to back.
    real = [_real_partition(o, g) for o in osds]
    numel = sum(math.prod(layout.params[n].shape) for n in names)
    if sum(r.numel() for r in real) != numel:
        raise CheckpointError(
            f"{what}: optimizer group {g} holds {sum(r.numel() for r in real)} elements, the "
            f"model in metadata.json has {numel}"
        )
    states = [
        o["base_optimizer_state"]["state"][g]
        if isinstance(o["base_optimizer_state"], dict)
        else o["base_optimizer_state"][g]
        for o in osds
    ]
    moments, step = {}, states[0].get("step", osds[0].get("base_optimizer_state_step"))
    for key, value in states[0].items():
        if key != "step" and torch.is_tensor(value) and value.dim() > 0:
            flat = torch.cat([s[key].reshape(-1)[: r.numel()] for s, r in zip(states, real)])
            moments[key] = _unflatten(flat, names, layout)
    return _unflatten(torch.cat(real), names, layout), moments, step


def _zero(info: CheckpointInfo, layout: ModelLayout, tp_rank: int) -> _RankStates:
    files = [load_file(info.zero_file(d, tp_rank)) for d in range(info.dp_size)]
    what = info.zero_file(0, tp_rank)
    osds = [f.get("optimizer_state_dict") if isinstance(f, dict) else None for f in files]
    if any(not isinstance(o, dict) or "single_partition_of_fp32_groups" not in o for o in osds):
        raise CheckpointError(
            f"{what}: not a ZeRO stage 1/2 (or BF16_Optimizer) optimizer partition; other "
            "layouts are not supported"
        )
    if any(any(p) for o in osds for p in o.get("param_alignment_paddings", [])):
        raise CheckpointError(f"{what}: ZeRO parameter_alignment padding is not supported")
    zero = (info.configs.get("deepspeed") or {}).get("zero_optimization") or {}
    if zero.get("round_robin_gradients"):
        # The flat groups are then in another order than the parameters'.
        raise CheckpointError(f"{what}: ZeRO round_robin_gradients is not supported")
    out = _RankStates(families={"master": {}}, zero_template={})
    for g, names in enumerate(layout.groups):
        master, moments, out.step = _zero_group(osds, g, names, layout, what)
        out.families["master"].update(master)
        for key, tensors in moments.items():
            out.families.setdefault(key, {}).update(tensors)
    base = osds[0]["base_optimizer_state"]
    out.param_groups = _hyper(base["param_groups"]) if isinstance(base, dict) else []
    keys = ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad")
    out.extras = {k: osds[0][k] for k in keys if k in osds[0]}
    # The optimizer state is replaced on writing; the placeholder keeps DeepSpeed's key order.
    out.zero_template = {**files[0], "optimizer_state_dict": None}
    return out


def _zero3(info: CheckpointInfo, layout: ModelLayout, tp_rank: int, optimizer: bool):
    """Tensor-parallel rank ``tp_rank`` of a ZeRO-3 checkpoint: its parameters (fp32, as the
    optimizer keeps them; the model files hold empty placeholders) and, with ``optimizer``,
    its moments, each reassembled from the data-parallel partitions by zero_to_fp32."""
    from deepspeed.utils import zero_to_fp32

    dp = info.dp_size
    models = [load_file(info.model_file(tp_rank, d)) for d in range(dp)]
    what = info.zero_file(0, tp_rank)
    files = [load_file(info.zero_file(d, tp_rank)) for d in range(dp)]
    osds = [f.get("optimizer_state_dict") if isinstance(f, dict) else None for f in files]
    if any(not isinstance(o, dict) or "fp32_flat_groups" not in o for o in osds):
        raise CheckpointError(f"{what}: not a ZeRO stage 3 optimizer partition")
    if any(o.get("partition_count") != dp for o in osds):
        raise CheckpointError(
            f"{what}: partitioned over {osds[0].get('partition_count')} ranks, metadata.json "
            f"says data parallel size {dp}"
        )
    shapes = []
    for m in models:
        if not all(k in m for k in ("param_shapes", "buffer_names", "shared_params")):
            raise CheckpointError(f"{what}: its model states file has no ZeRO-3 parameter shapes")
        buffers = {
            k: v.float() if v.is_floating_point() else v
            for k, v in m["module"].items()
            if k in m["buffer_names"]
        }
        shapes.append(
            zero_to_fp32.zero_model_state(
                buffers=buffers,
                param_shapes=m["param_shapes"],
                shared_params=list(m["shared_params"].items()),
                ds_version=m.get("ds_version"),
                frozen_param_shapes=m.get("frozen_param_shapes"),
                frozen_param_fragments=m.get("frozen_param_fragments"),
            )
        )
    names = [n for group in models[0]["param_shapes"] for n in group]
    if set(names) != set(layout.params):
        odd = sorted(set(names) ^ set(layout.params))[:3]
        raise CheckpointError(
            f"{what}: its parameters differ from the model's in metadata.json ({', '.join(odd)})"
        )

    def gathered(flat_groups: list[list[torch.Tensor]]) -> Tensors:
        # zero_to_fp32 prints its progress (and tqdm bars): not this command's output.
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            merged = zero_to_fp32._get_fp32_state_dict_from_zero3_checkpoint(
                dp, flat_groups, shapes, exclude_frozen_parameters=False
            )
            return {k: v.detach() for k, v in zero_to_fp32.to_torch_tensor(merged).items()}

    try:
        weights = gathered([o["fp32_flat_groups"] for o in osds])
    except (ValueError, RuntimeError) as e:
        raise CheckpointError(f"{what}: zero_to_fp32 cannot reassemble it ({e})") from None
    out = _RankStates(families={"module": weights, "master": {n: weights[n] for n in names}})
    base = [o["optimizer_state_dict"] for o in osds]
    state = [b["state"] for b in base]
    out.step = state[0].get(0, {}).get("step")
    # ZeRO-3 cuts a large group into sub-groups (sub_group_size), each with its settings.
    hyper = _hyper(base[0]["param_groups"])
    out.param_groups = list({h.get("name", i): h for i, h in enumerate(hyper)}.values())
    keys = ("loss_scaler", "dynamic_loss_scale", "overflow")
    out.extras = {k: osds[0][k] for k in keys if k in osds[0]}
    if optimizer:
        groups = range(len(osds[0]["fp32_flat_groups"]))
        moments = [k for k, v in state[0].get(0, {}).items() if torch.is_tensor(v) and v.dim() > 0]
        for key in moments:
            merged = gathered([[s[g][key].reshape(-1) for g in groups] for s in state])
            out.families[key] = {n: merged[n] for n in names}
    return out


def _check_model_files(info: CheckpointInfo) -> None:
    pattern = _ZERO3_MODEL_FILE if info.zero_stage == 3 else _MODEL_FILE
    found = sorted({int(m.group(1)) for f in os.listdir(info.iter_dir) if (m := pattern.match(f))})
    if found != list(range(info.tp_size)):
        raise CheckpointError(
            f"{info.iter_dir}: expected DeepSpeed model files mp_rank_00..{info.tp_size - 1:02d} "
            f"(tensor parallel size {info.tp_size} in metadata.json), found ranks {found}"
        )


def read_states(info: CheckpointInfo, layout: ModelLayout, *, optimizer: bool = True):
    """Every tensor of the checkpoint, merged over tensor-parallel ranks. ``optimizer=False``
    reads the model files only (no moments; fp32 masters of stage 0 bf16/fp16 included)."""
    if layout.tp_size != info.tp_size:
        raise ValueError("the layout must be built at the checkpoint's tensor parallel size")
    _check_model_files(info)
    ranks, client = [], {}
    for r in range(info.tp_size):
        path = info.model_file(r, 0 if info.zero_stage == 3 else None)
        sd = load_file(path)
        if not isinstance(sd, dict) or not isinstance(sd.get("module"), dict):
            raise CheckpointError(f"{path}: no 'module' state dict in it")
        if info.zero_stage == 3:
            rank = _zero3(info, layout, r, optimizer)
        elif info.zero_stage > 0:
            rank = _zero(info, layout, r) if optimizer else _RankStates(families={})
        elif sd.get("optimizer") is not None and (optimizer or info.precision != "fp32"):
            rank = _stage0(sd["optimizer"], layout, path)
        else:
            rank = _RankStates(families={})
        rank.families.setdefault("module", sd["module"])
        ranks.append(rank)
        if r == 0:
            client = {**sd, "module": None, "optimizer": None}
    families = {
        key: layout.merge([rank.families.get(key, {}) for rank in ranks], f"{info.iter_dir}: {key}")
        for key in ranks[0].families
    }
    first = ranks[0]
    return TrainingStates(
        info, families, first.step, first.param_groups, first.extras, client, first.zero_template
    )


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class TargetLayout:
    layout: ModelLayout  # at the new tensor-parallel size
    dp_size: int
    zero_stage: int
    precision: str
    ds_config: dict[str, Any]  # stored in the files, as DeepSpeed does


def _step(step: Any) -> Any:
    return step.clone() if torch.is_tensor(step) else step


def _module(rank: Tensors, master: Tensors, precision: str) -> Tensors:
    # Same dtype: the saved tensor as it is (bitwise); another: from the fp32 master.
    dtype, out = _DTYPES[precision], {}
    for name, tensor in rank.items():
        if tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = master.get(name, tensor).to(dtype)
        out[name] = tensor
    return out


def _masters(module: Tensors, master: Tensors, names: list[str]) -> list[torch.Tensor]:
    return [master[n] if n in master else module[n].float() for n in names]


def _torch_state(states: TrainingStates, rank: dict[str, Tensors], groups: list[list[str]]):
    state: dict[int, dict[str, Any]] = {}
    param_groups = []
    for names, hyper in zip(groups, states.param_groups):
        ids = list(range(len(state), len(state) + len(names)))
        for index, name in zip(ids, names):
            state[index] = {"step": _step(states.step)}
            state[index].update({k: rank[k][name] for k in states.moment_keys})
        param_groups.append({**hyper, "params": ids})
    return {"state": state, "param_groups": param_groups}


def _stage0_optimizer(states: TrainingStates, rank: dict[str, Tensors], target: TargetLayout):
    groups = target.layout.groups
    sd = _torch_state(states, rank, groups)
    if target.precision == "fp32":
        return sd
    extras = states.optimizer_extras
    if "cur_scale" not in extras:  # from fp32 or ZeRO: DeepSpeed's initial, static state
        extras = {
            "dynamic_loss_scale": False,
            "cur_scale": 1.0,
            "cur_iter": states.client.get("global_steps", 0),
        }
    masters = [_masters(rank["module"], rank.get("master", {}), names) for names in groups]
    return {**extras, "optimizer_state_dict": sd, "fp32_groups": masters}


def _partition(flat: torch.Tensor, lo: int, size: int, real: int, pad: bool) -> torch.Tensor:
    part = flat[lo : min(lo + size, real)].clone() if lo < real else flat[:0].clone()
    if pad and part.numel() < size:
        part = torch.cat([part, part.new_zeros(size - part.numel())])
    return part


def _zero_partitions(states, rank: dict[str, Tensors], target: TargetLayout) -> list[dict]:
    """Per data-parallel rank: the flat group partitions DeepSpeed's ZeRO 1/2 optimizer
    builds (groups padded at the end to a multiple of 2 x dp, then cut in dp equal parts)."""
    from deepspeed.utils.tensor_fragment import fragment_address

    dp = target.dp_size
    parts = [{"fp32": [], "state": {}, "pad": [], "map": []} for _ in range(dp)]
    for g, names in enumerate(target.layout.groups):
        master = torch.cat(
            [t.reshape(-1) for t in _masters(rank["module"], rank.get("master", {}), names)]
        )
        moments = {
            k: torch.cat([rank[k][n].reshape(-1) for n in names]) for k in states.moment_keys
        }
        real = master.numel()
        size = math.ceil(real / (2 * dp)) * 2 * dp // dp
        offsets = [0, *accumulate(math.prod(target.layout.params[n].shape) for n in names)]
        for d, part in enumerate(parts):
            lo = d * size
            part["fp32"].append(_partition(master, lo, size, real, pad=False))
            part["pad"].append(size - part["fp32"][-1].numel())
            part["state"][g] = {"step": _step(states.step)}
            part["state"][g].update(
                {k: _partition(v, lo, size, real, pad=True) for k, v in moments.items()}
            )
            mapping = OrderedDict()
            for name, start, end in zip(names, offsets, offsets[1:]):
                a, b = max(start, lo), min(end, lo + size)
                if a < b:
                    mapping[name] = fragment_address(numel=b - a, start=a - lo)
            part["map"].append(mapping)
    return parts


def _zero_file(states: TrainingStates, part: dict, target: TargetLayout) -> dict[str, Any]:
    import deepspeed
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    extras = states.optimizer_extras
    groups = target.layout.groups
    clip = (states.info.configs.get("training") or {}).get("clip_grad", 0.0)
    osd = {
        "loss_scaler": extras.get("loss_scaler", LossScaler(scale=1.0)),
        "dynamic_loss_scale": extras.get("dynamic_loss_scale", False),
        "overflow": False,
        "clip_grad": extras.get("clip_grad", float(clip)),
        "base_optimizer_state": {
            "state": part["state"],
            "param_groups": [{**h, "params": [g]} for g, h in enumerate(states.param_groups)],
        },
        "single_partition_of_fp32_groups": part["fp32"],
        "zero_stage": ZeroStageEnum(target.zero_stage),
        "group_paddings": part["pad"],
        "param_alignment_paddings": [[0] * len(names) for names in groups],
        "partition_count": [target.dp_size] * len(groups),
        "ds_version": deepspeed.__version__,
        "param_slice_mappings": part["map"],
    }
    template = states.zero_template or {"ds_version": deepspeed.__version__}
    return {**template, "optimizer_state_dict": osd, "ds_config": target.ds_config}


def _model_file(states, module: Tensors, optimizer: Any, target: TargetLayout) -> dict:
    layout = target.layout
    shapes = None
    if target.zero_stage > 0:
        shapes = [
            OrderedDict((n, torch.Size(layout.params[n].shape)) for n in names)
            for names in layout.groups
        ]
    return {
        **states.client,
        "module": module,
        "optimizer": optimizer,
        "param_shapes": shapes,
        "dp_world_size": target.dp_size,
        "mp_world_size": layout.tp_size,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": layout.tp_size},
        "ds_config": target.ds_config,
    }


def check_target(states: TrainingStates, target: TargetLayout) -> None:
    if target.zero_stage not in (0, 1, 2):
        raise ConfigError(
            f"ZeRO stage {target.zero_stage}: only stages 0, 1 and 2 are written (ZeRO-3 "
            "checkpoints are read); give --deepspeed-config with a stage 0-2 config"
        )
    info = states.info
    same_kind = info.precision == "fp16" and (info.zero_stage > 0) == (target.zero_stage > 0)
    if target.precision == "fp16" and not same_kind:
        raise ConfigError(
            "fp16: the dynamic loss scale cannot be made up; convert into fp16 only from an fp16 "
            "checkpoint of the same kind (ZeRO 0, or ZeRO 1-2), or into bf16/fp32"
        )
    if not states.moment_keys:
        raise CheckpointError(f"{states.info.iter_dir}: no optimizer states were read")


def write_states(states: TrainingStates, target: TargetLayout, iter_dir: str) -> list[str]:
    """DeepSpeed's files of ``states`` for ``target`` into ``iter_dir``; returns their names."""
    check_target(states, target)
    split = {key: target.layout.split(family) for key, family in states.families.items()}
    written = []
    for r in range(target.layout.tp_size):
        rank = {key: parts[r] for key, parts in split.items()}
        module = _module(rank["module"], rank.get("master", {}), target.precision)
        optimizer = None
        if target.zero_stage == 0:
            optimizer = _stage0_optimizer(states, rank, target)
        else:
            for d, part in enumerate(_zero_partitions(states, rank, target)):
                name = optim_states_name(target.precision, d, r)
                torch.save(_zero_file(states, part, target), os.path.join(iter_dir, name))
                written.append(name)
        name = model_states_name(r)
        torch.save(_model_file(states, module, optimizer, target), os.path.join(iter_dir, name))
        written.append(name)
    return written
