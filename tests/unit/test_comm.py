"""parallel/comm.py is the package's only caller of torch.distributed collectives, and it puts
tensors where the group's backend needs them (NCCL: the current CUDA device), so the CPU
tensors that gloo accepts in every CPU test cannot reach NCCL in a GPU run."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from megatron_taco.parallel import comm
from tests.helpers import run_distributed

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_taco"
OWNER = PACKAGE / "parallel" / "comm.py"

COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "broadcast", "broadcast_object_list",
    "gather", "gather_object", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_single", "all_gather_single", "scatter",
    "scatter_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "send_object_list", "recv_object_list", "all_reduce_coalesced", "all_gather_coalesced",
    "_all_gather_base", "_reduce_scatter_base", "all_gather_tensor",
}  # fmt: skip
# Every module under these (distributed_c10d, _functional_collectives, nn.functional,
# deepspeed.comm.comm) counts: each reaches the same backends.
DIST_MODULES = ("torch.distributed", "deepspeed.comm")


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _resolve(name: str, aliases: dict[str, str]) -> str:
    head, _, rest = name.partition(".")
    return aliases.get(head, head) + (f".{rest}" if rest else "")


def _is_collective(full: str) -> bool:
    module, _, func = full.rpartition(".")
    under = any(module == m or module.startswith(f"{m}.") for m in DIST_MODULES)
    return func in COLLECTIVES and under


def _aliases(tree: ast.AST) -> dict[str, str]:
    """local name -> dotted module or function: imports, then plain assignments of them
    (c10d = torch.distributed; reduce = dist.all_reduce), repeated until nothing changes."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                local = a.asname or a.name.split(".")[0]
                aliases[local] = a.name if a.asname else local
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    assigns = [
        (t.id, name)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and (name := _dotted(node.value)) is not None
        for t in node.targets
        if isinstance(t, ast.Name)
    ]
    changed = True
    while changed:
        changed = False
        for local, name in assigns:
            full = _resolve(name, aliases)
            if full.split(".")[0] in ("torch", "deepspeed") and aliases.get(local) != full:
                aliases[local], changed = full, True
    return aliases


def direct_collectives(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    """'file:line name' of every call of a torch.distributed / deepspeed.comm collective,
    through any alias (import torch.distributed as dist, from torch import distributed,
    from torch.distributed import all_reduce, torch.distributed.barrier(...), a submodule
    such as distributed_c10d, a name assigned one of these) or getattr(dist, "name")."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    aliases = _aliases(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if name == "getattr" and len(node.args) >= 2:
            owner, attr = _dotted(node.args[0]), node.args[1]
            if owner is not None and isinstance(attr, ast.Constant):
                name = f"{owner}.{attr.value}"
        if name is None:
            continue
        full = _resolve(name, aliases)
        if _is_collective(full):
            found.append((node.lineno, f"{path.relative_to(root)}:{node.lineno} {full}"))
    return [hit for _, hit in sorted(found)]


def test_no_module_but_comm_calls_a_collective():
    offenders = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != OWNER
        for hit in direct_collectives(path)
    ]
    assert offenders == [], "call megatron_taco.parallel.comm instead:\n" + "\n".join(offenders)


def test_the_scan_sees_every_spelling(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "import torch\nimport torch.distributed as dist\nfrom torch import distributed as d2\n"
        "from torch.distributed import all_gather_object as ago\nimport deepspeed.comm as dc\n"
        "from torch.distributed import distributed_c10d\nimport torch.distributed.nn\n"
        "c10d = torch.distributed\nreduce = c10d.all_reduce\n"
        "dist.all_reduce(x)\nd2.barrier()\ntorch.distributed.broadcast(x, 0)\nago(out, o)\n"
        "dc.all_gather(p, x)\ndist.get_rank()\ndistributed_c10d.all_reduce(x)\n"
        "torch.distributed.nn.functional.all_reduce(x)\nc10d.barrier()\nreduce(x)\n"
        "getattr(dist, 'broadcast')(x, 0)\ngetattr(dist, 'get_rank')()\n"
        "torch.distributed._functional_collectives.all_reduce(x, 'sum', g)\n"
    )
    hits = direct_collectives(source, tmp_path)
    assert [h.split(" ")[1] for h in hits] == [
        "torch.distributed.all_reduce",
        "torch.distributed.barrier",
        "torch.distributed.broadcast",
        "torch.distributed.all_gather_object",
        "deepspeed.comm.all_gather",
        "torch.distributed.distributed_c10d.all_reduce",
        "torch.distributed.nn.functional.all_reduce",
        "torch.distributed.barrier",
        "torch.distributed.all_reduce",
        "torch.distributed.broadcast",
        "torch.distributed._functional_collectives.all_reduce",
    ]


def test_nccl_alone_needs_cuda_tensors():
    assert comm.backend_device_type("nccl") == "cuda"
    assert comm.backend_device_type("NCCL") == "cuda"
    assert comm.backend_device_type("cuda:nccl") == "cuda"
    # gloo takes the tensor where it is; a mixed group dispatches by the tensor's device.
    assert comm.backend_device_type("gloo") is None
    assert comm.backend_device_type("cpu:gloo,cuda:nccl") is None
    assert comm.backend_device_type("mpi") is None


def _collectives(rank: int, world: int):
    import torch.distributed as dist

    x = torch.tensor([1.0 + rank, -rank], dtype=torch.float64)
    same = comm.all_reduce(x, op="max")
    gathered = comm.all_gather(torch.full((2,), rank, dtype=torch.int64))
    summed = comm.all_reduce(torch.tensor([rank + 1]))
    b = comm.broadcast(torch.tensor([10 * rank + 7]), src=1)
    comm.barrier()
    objects = comm.all_gather_object({"rank": rank})
    obj = comm.broadcast_object(f"from {rank}", src=0)
    sub = dist.new_group([0, 1])
    cat = torch.cat(comm.all_gather(torch.tensor([rank]), sub))
    return (same is x, x.tolist(), [g.tolist() for g in gathered], summed.item(), b.item(),
            objects, obj, cat.tolist(), comm.backend_device(sub))  # fmt: skip


def test_collectives_over_gloo():
    results = run_distributed(_collectives, 2)
    for r in results:
        assert r == (True, [2.0, 0.0], [[0, 0], [1, 1]], 3, 17, [{"rank": 0}, {"rank": 1}],
                     "from 0", [0, 1], None)  # fmt: skip
