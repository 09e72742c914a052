"""Every `deepspeed`, `torchrun`, `mpirun` and `sbatch` command in README.md, docs/ and
examples/ passes our own flag, batch-layout and DeepSpeed-config checks for the number of
ranks it starts: what the run would refuse before its rendezvous is refused here. (README's
TACO-base command once asked for a global batch of 1200 from micro-batches of 16 on 4
data-parallel ranks, which its own run refuses.)

A command is read as a shell would hand it over: continuation lines joined, the variables
its file assigns (README's ARGS, a script's TRAIN_ITERS=${DEMO_TRAIN_ITERS:-300}, bash arrays
such as demo.sh's COMMON=(...) used as "${COMMON[@]}"), `${VAR:-default}` defaults and
`$((...))` arithmetic expanded, unknown variables left as placeholder words (paths). Every
sbatch script of examples/ is checked, whether or not a document submits it. The checks
read no data file: only the DeepSpeed JSONs, which are in the repository.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from megatron_taco.arguments import dataclass_from_args
from megatron_taco.errors import ConfigError
from megatron_taco.training.config import TrainingConfig
from megatron_taco.training.configure import build_parser, flag_configs
from megatron_taco.training.deepspeed_config import resolve_deepspeed_config
from tests.helpers import REPO

LAUNCHERS = ("deepspeed", "torchrun", "mpirun", "sbatch")
SCRIPTS = ("pretrain_taco.py", "pretrain_sas.py", "tools/finetune.py")
# The placeholder task of a sweep sbatch array, and its shard.
SLURM = {"SLURM_ARRAY_TASK_ID": "0"}


@dataclass
class Command:
    where: str  # file:line
    world: int  # ranks the launcher starts
    script: str
    args: list[str]


_ARRAY_START = re.compile(r"^\s*(?:export\s+)?\w+=\(")


def _join(text: str) -> list[tuple[int, str]]:
    """Logical lines with their first line number: continuations joined, and a bash array
    assignment NAME=( ... ) spread over lines kept as one (its lines joined by newlines, so
    that a comment inside ends at its own line)."""
    out, buf, start, in_array = [], "", 0, False
    for number, line in enumerate(text.splitlines(), 1):
        if not buf:
            start = number
            in_array = bool(_ARRAY_START.match(line))
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        if in_array and not re.search(r"\)\s*(#.*)?$", line):
            buf += line + "\n"
            continue
        out.append((start, buf + line))
        buf = ""
    return out


_ARRAY_USE = re.compile(r'"\$\{(\w+)\[@\]\}"|\$\{(\w+)\[@\]\}')
_ARITHMETIC = re.compile(r"\$\(\(([^()]*(?:\([^()]*\)[^()]*)*)\)\)")
_VAR = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)")


def _arithmetic(expression: str, env: dict[str, str]) -> str:
    """$((...)) of integers and variables (bare or $-prefixed), as bash computes it."""
    text = _VAR.sub(lambda m: env.get(m.group(1) or m.group(3), "_"), expression)
    text = re.sub(r"[A-Za-z_]\w*", lambda m: env.get(m.group(0), "_"), text)
    if not re.fullmatch(r"[\d\s+\-*/%()]+", text):
        return "_arithmetic_"  # a placeholder word, like an unknown variable
    return str(eval(text.replace("/", "//")))  # digits and operators only


def _expand(text: str, env: dict[str, str]) -> str:
    """Variables, arrays ("${A[@]}": its words, each shell-quoted) and arithmetic."""

    def array(m: re.Match) -> str:
        return env.get(f"{m.group(1) or m.group(2)}[@]", "")

    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(3)
        if name in env:
            return env[name]
        if m.group(2) is not None:
            return _expand(m.group(2), env)
        return f"_{name}_"

    text = _ARRAY_USE.sub(array, text)
    text = _ARITHMETIC.sub(lambda m: _arithmetic(m.group(1), env), text)
    return _VAR.sub(sub, text)


def _assignments(lines: list[tuple[int, str]], env: dict[str, str]) -> None:
    for _, line in lines:
        m = re.match(r"^\s*(?:export\s+)?(\w+)=(.*)$", line, re.S)
        if m is None:
            continue
        name, value = m.groups()
        try:
            if value.startswith("("):  # an array: kept as its words, each shell-quoted
                words = shlex.split(_expand(value[1 : value.rindex(")")], env), comments=True)
                env.setdefault(f"{name}[@]", " ".join(shlex.quote(w) for w in words))
                continue
            (value,) = shlex.split(_expand(value, env)) or [""]
        except ValueError:
            continue
        env.setdefault(name, value)


def _world(tokens: list[str], block: str, where: str) -> tuple[int, int]:
    """(ranks, index of the first token after the launcher's own options)."""
    launcher = Path(tokens[0]).name
    opts: dict[str, str] = {}
    i = 1
    while i < len(tokens) and not tokens[i].endswith(".py") and tokens[i] != "python":
        if tokens[i].startswith("-") and "=" in tokens[i]:
            key, value = tokens[i].split("=", 1)
            opts[key] = value
        elif tokens[i].startswith("-") and i + 1 < len(tokens):
            if not tokens[i + 1].startswith("-") and not tokens[i + 1].endswith(".py"):
                opts[tokens[i]] = tokens[i + 1]
                i += 1
            else:
                opts[tokens[i]] = ""
        i += 1
    if tokens[i : i + 1] == ["python"]:
        i += 1
    if launcher == "deepspeed":
        if "--hostfile" in opts:
            world = sum(int(n) for n in re.findall(r"slots=(\d+)", block))
        else:
            world = int(opts["--num_gpus"]) * int(opts.get("--num_nodes", 1))
    elif launcher == "torchrun":
        per_node = opts.get("--nproc-per-node", opts.get("--nproc_per_node"))
        world = int(per_node) * int(opts.get("--nnodes", 1))
    else:  # mpirun
        world = int(opts.get("-np", opts.get("-n")))
    assert world > 0, where
    return world, i


def _sbatch(path: Path, where: str, root: Path = REPO) -> list[Command]:
    text = path.read_text()
    header = dict(re.findall(r"^#SBATCH\s+(--[\w-]+)(?:[= ](\S+))?", text, re.M))
    if "--ntasks" in header:
        world = int(header["--ntasks"])
    else:
        world = int(header["--nodes"]) * int(header["--ntasks-per-node"])
        gpus = header.get("--gpus-per-node")
        # One rank per GPU, every GPU used: launch.sh maps each Slurm task to a rank.
        assert gpus is None or int(gpus) == int(header["--ntasks-per-node"]), where
    env = dict(SLURM)
    if "--array" in header:
        lo, hi = header["--array"].split("%")[0].split("-")
        env["SLURM_ARRAY_TASK_COUNT"] = str(int(hi) - int(lo) + 1)
    lines = _join(text)
    _assignments(lines, env)
    out = []
    for number, line in lines:
        if line.lstrip().startswith("launch_ranks"):
            tokens = [t for t in shlex.split(_expand(line, env), comments=True) if t]
            script = next(i for i, t in enumerate(tokens) if t.endswith(".py"))
            out.append(Command(f"{path.relative_to(root)}:{number}", world, tokens[script],
                               tokens[script + 1:]))  # fmt: skip
    assert out, f"{where}: no launch_ranks command in {path}"
    return out


def _blocks(path: Path) -> list[tuple[int, str]]:
    """(line number before the block's first line, block) of each shell block."""
    text = path.read_text()
    if path.suffix != ".md":
        return [(0, text)]
    return [(text[: m.start(1)].count("\n"), m.group(1))
            for m in re.finditer(r"```bash\n(.*?)```", text, re.S)]  # fmt: skip


def documented_commands(root: Path = REPO) -> tuple[list[Command], list[str]]:
    """(commands, the ones skipped because the text elides their flags with '...')."""
    files = [root / "README.md", *sorted((root / "docs").glob("*.md")),
             *sorted(p for p in (root / "examples").rglob("*") if p.suffix in (".sh", ".md"))]  # fmt: skip
    commands, elided = [], []
    submitted = set()
    for path in files:
        blocks = _blocks(path)
        env: dict[str, str] = {}
        for _, block in blocks:  # variables defined in one block are used in the others
            _assignments(_join(block), env)
        for offset, block in blocks:
            for number, line in _join(block):
                where = f"{path.relative_to(root)}:{offset + number}: {line.strip()[:60]}"
                if not re.search(rf"(^|[\s/])({'|'.join(LAUNCHERS)})\s", line):
                    continue
                for part in re.split(r"&&|;|\|\|", line):
                    words = shlex.split(_expand(part, env), comments=True)
                    words = [w for w in words if w]
                    while words and (re.match(r"^\w+=", words[0]) or words[0] == "taco-launch"):
                        words = words[1:]
                    if not words or Path(words[0]).name not in LAUNCHERS:
                        continue
                    if "..." in words:
                        elided.append(where)
                        continue
                    if Path(words[0]).name == "sbatch":
                        submitted.add(root / words[-1])
                        commands += _sbatch(root / words[-1], where, root)
                        continue
                    world, i = _world(words, block, where)
                    commands.append(Command(where, world, words[i], words[i + 1 :]))
    # A script in examples/ is a command too, whether or not a document submits it.
    for path in sorted((root / "examples").rglob("*.sbatch")):
        if path not in submitted:
            commands += _sbatch(path, str(path.relative_to(root)), root)
    return commands, elided


COMMANDS, ELIDED = documented_commands()


def test_the_documentation_has_launch_commands():
    scripts = {c.script for c in COMMANDS}
    assert scripts == set(SCRIPTS), scripts
    assert len(COMMANDS) >= 15 and any(c.where.startswith("examples/slurm") for c in COMMANDS)
    # Only README's illustration of a converted checkpoint's flags is elided.
    assert len(ELIDED) == 1 and "pretrain_taco.py ... --tensor-model-p" in ELIDED[0], ELIDED


def _check_pretraining(command: Command) -> None:
    from megatron_taco.recipes import sas, taco

    spec = taco.SPEC if command.script == "pretrain_taco.py" else sas.SPEC
    args = build_parser(spec).parse_args(command.args)
    flag_configs(spec, args, world_size=command.world, device_type="cuda")


def _check_finetuning(command: Command) -> None:
    from megatron_taco.checkpoint.config import CheckpointConfig
    from megatron_taco.parallel.config import check_world_size
    from megatron_taco.recipes.finetune import SPEC as FINETUNE
    from megatron_taco.recipes.finetune_config import CHECKPOINTS, output_paths
    from megatron_taco.recipes.sweep import SweepConfig, expand_tasks, plan_runs, run_namespace

    args = build_parser(FINETUNE).parse_args(command.args)
    tp = args.tensor_model_parallel_size
    check_world_size(command.world, tp)
    dp = command.world // tp
    sweep = dataclass_from_args(SweepConfig, args)
    if sweep.is_sweep or "," in args.task or args.task == "glue":
        runs = plan_runs(sweep, expand_tasks(args.task), args, "small")
        namespaces = [run_namespace(args, run, args.output, dp) for run in runs]
    else:
        namespaces = [args]
    for ns in namespaces:  # the TrainingConfig each run builds (recipes/finetune.py)
        training = dataclass_from_args(
            TrainingConfig,
            ns,
            train_epochs=ns.train_epochs,
            eval_iters=0,
            **output_paths(ns.output),
        )
        checkpoints = f"{ns.output}/{CHECKPOINTS}"
        dataclass_from_args(CheckpointConfig, ns, save=checkpoints, load=checkpoints)
        resolve_deepspeed_config(training, dp, device_type="cuda")


@pytest.mark.parametrize("command", COMMANDS, ids=[c.where.split(": ")[0] for c in COMMANDS])
def test_each_command_passes_our_checks(command, monkeypatch):
    monkeypatch.chdir(REPO)  # the commands run from the repository root
    try:
        if command.script == "tools/finetune.py":
            _check_finetuning(command)
        else:
            _check_pretraining(command)
    except (ConfigError, SystemExit) as e:
        pytest.fail(f"{command.where} at {command.world} ranks: {e}")


def test_commands_are_read_as_bash_hands_them_over(tmp_path):
    """Continuations, an env-var prefix, a string variable, a bash array (a comment and a
    quoted word inside) used as "${A[@]}", arithmetic, and an sbatch script no document
    submits: each reaches the checks with the words bash would pass."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "examples" / "slurm").mkdir(parents=True)
    (tmp_path / "README.md").write_text(
        '```bash\nARGS="--seq-length 64 --micro-batch-size 2"\n```\n\ntext\n\n'
        "```bash\nNCCL_DEBUG=INFO deepspeed --num_gpus 4 pretrain_taco.py $ARGS \\\n"
        "    --global-batch-size 8   # four ranks\n```\n"
    )
    (tmp_path / "examples" / "run.sh").write_text(
        'SEQ=64\nITERS=${RUN_ITERS:-300}\nCOMMON=(--data-path "$OUT/a b"  # spaces kept\n'
        '    --train-iters "$ITERS" --seq-length $SEQ)\n'
        "deepspeed --num_gpus 2 pretrain_sas.py --max-position-embeddings $((SEQ * 2)) \\\n"
        '    "${COMMON[@]}" --micro-batch-size $(( (ITERS - 290) / 5 ))\n'
    )
    (tmp_path / "examples" / "slurm" / "job.sbatch").write_text(
        "#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=4\n#SBATCH --gpus-per-node=4\n"
        'DATA=${DATA:-/data}\nlaunch_ranks "${PYTHON:-python}" pretrain_taco.py \\\n'
        '    --data-path "$DATA/x" --micro-batch-size 4\n'
    )
    commands, elided = documented_commands(tmp_path)
    assert elided == []
    got = [(c.where.split(": ")[0], c.world, c.script, c.args) for c in commands]
    assert got == [
        ("README.md:8", 4, "pretrain_taco.py",
         ["--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8"]),
        ("examples/run.sh:5", 2, "pretrain_sas.py",
         ["--max-position-embeddings", "128", "--data-path", "_OUT_/a b", "--train-iters",
          "300", "--seq-length", "64", "--micro-batch-size", "2"]),
        ("examples/slurm/job.sbatch:6", 8, "pretrain_taco.py",
         ["--data-path", "/data/x", "--micro-batch-size", "4"]),
    ]  # fmt: skip
