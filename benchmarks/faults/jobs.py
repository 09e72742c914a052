"""Jobs as a scheduler runs them: the tiny corpus, the command of a configuration, a job started
in a session of its own, its processes (found by an environment marker, since torchrun puts
its ranks in sessions of their own and orphans are re-parented), and its metrics as they
are logged."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.faults.plan import LAYOUTS, Config
from megatron_taco.runtime.procfs import proc_stat

REPO = Path(__file__).resolve().parents[2]
SHIM_DIR = Path(__file__).resolve().parent / "shim"
BIN = Path(sys.executable).parent
CORPUS_TEXT = REPO / "tests" / "fixtures" / "text" / "botchan_excerpt.txt"
JOB_ENV = "FAULTS_JOB"
RANK_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


# -- the corpus ---------------------------------------------------------------------------


def build_corpus(directory: Path) -> dict[str, str]:
    """A sentencepiece model (800 pieces) and an indexed data set of the Botchan excerpt in
    documents of 20 lines, made by the project's own tools; built once per --out."""
    from megatron_taco.cli.train_tokenizer import TrainTokenizerConfig, train_tokenizer
    from megatron_taco.preprocessing.preprocess import PreprocessConfig, preprocess

    done = directory / "corpus.json"
    if done.is_file():
        return json.loads(done.read_text())
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(
        TrainTokenizerConfig(
            input=(str(CORPUS_TEXT),),
            model_prefix=str(directory / "spm"),
            vocab_size=800,
            model_type="unigram",
            num_threads=1,
        )
    )
    lines = CORPUS_TEXT.read_text(encoding="utf-8").splitlines()
    with open(directory / "botchan.jsonl", "w", encoding="utf-8") as f:
        for i in range(0, len(lines), 20):
            f.write(json.dumps({"text": " ".join(lines[i : i + 20])}) + "\n")
    summary = preprocess(
        PreprocessConfig(
            input=(str(directory / "botchan.jsonl"),),
            output_prefix=str(directory / "botchan"),
            split_sentences=True,
            tokenizer_model=tokenizer,
        ),
        progress=False,
    )
    corpus = {
        "prefix": summary["datasets"]["text"]["prefix"],
        "tokenizer": tokenizer,
        "cache": str(directory / "cache"),
    }
    done.write_text(json.dumps(corpus))
    return corpus


# -- commands -----------------------------------------------------------------------------


def training_args(config: Config, corpus: dict[str, str]) -> list[str]:
    """The flags of a configuration; --save = --load = ckpt in the job's directory, as a
    requeued job runs."""
    tp, zero = LAYOUTS[config.layout]
    shape = config.shape
    args = [
        "--model-size", "tiny", "--seq-length", "64",
        "--data-path", corpus["prefix"], "--tokenizer-model", corpus["tokenizer"],
        "--data-cache-path", corpus["cache"], "--split", "80,10,10",
        "--lr", "1e-3", "--lr-warmup-iters", "1", "--log-interval", "1",
        "--eval-iters", "1", "--eval-interval", "4", "--num-workers", str(config.workers),
        "--tensor-model-parallel-size", str(tp),
        "--deepspeed-config", str(REPO / "ds_configs" / f"zero{zero}_fp32.json"),
        "--save", "ckpt", "--load", "ckpt", "--save-interval", str(shape.save_interval),
    ]  # fmt: skip
    if config.model == "taco":
        args += ["--micro-batch-size", "2", "--global-batch-size", "4",
                 "--train-iters", str(shape.train_iters)]  # fmt: skip
    else:
        epochs = shape.train_iters // shape.epoch_iters
        args += ["--micro-batch-size", "16", "--global-batch-size", "32",
                 "--train-epochs", str(epochs), "--replacement-store-shards", "4"]  # fmt: skip
        if config.model == "sas_da":
            args.append("--disentangled-attention")
    return args


def script(config: Config) -> str:
    return str(REPO / ("pretrain_taco.py" if config.model == "taco" else "pretrain_sas.py"))


def command(config: Config, corpus: dict[str, str], port: int) -> list[str]:
    base = config.base_launcher
    if base == "deepspeed":
        launcher = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(port)]
    else:
        launcher = [str(BIN / "torchrun"), "--nproc-per-node", "2", "--master-port", str(port)]
    cmd = [*launcher, script(config), *training_args(config, corpus)]
    if config.launcher.startswith("taco-launch"):
        cmd = [str(BIN / "taco-launch"), *cmd]
    return cmd


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env(shim: dict[str, Any] | None) -> dict[str, str]:
    """The caller's environment for a job: the shim first on PYTHONPATH (inert without a
    spec), this repository next, one thread per rank, no rank variables of our own."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARS}
    paths = [str(SHIM_DIR), str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env.update(
        PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)),
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
    )
    env.pop("FAULTS_SHIM", None)
    if shim is not None:
        env["FAULTS_SHIM"] = json.dumps(shim)
    return env


# -- processes ----------------------------------------------------------------------------


def _environ(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def _parent(pid: int) -> int | None:
    stat = proc_stat(pid)
    return stat and stat.ppid


def _alive(pid: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and stat.state != "Z"


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


class Job:
    """One attempt: the command in a new session, stdout and stderr to ``log``."""

    def __init__(self, cmd: list[str], cwd: Path, env: dict[str, str], log: Path) -> None:
        self.id = uuid.uuid4().hex
        self.env = {**env, JOB_ENV: self.id}
        self.log = log
        self.started = time.time()
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=cwd, env=self.env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def pids(self) -> list[int]:
        needle = f"{JOB_ENV}={self.id}".encode()
        out = []
        for name in os.listdir("/proc"):
            if name.isdigit() and needle in _environ(int(name)) and _alive(int(name)):
                out.append(int(name))
        return out

    def describe(self, out_dir: Path) -> list[dict]:
        """What each process still alive is and where it waits, for a hung trial: pid,
        parent, state and command line, and a ``py-spy dump`` of its Python stacks in
        ``out_dir/<pid>.txt`` where py-spy is installed."""
        from megatron_taco.runtime.procfs import cmdline

        spy = Path(sys.executable).parent / "py-spy"
        out_dir.mkdir(parents=True, exist_ok=True)
        rows = []
        for pid in self.pids():
            stat = proc_stat(pid)
            rows.append(
                {
                    "pid": pid,
                    "ppid": stat and stat.ppid,
                    "state": stat and stat.state,
                    "cmdline": cmdline(pid)[:400],
                }
            )
            if spy.is_file():
                with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                    cmd = [str(spy), "dump", "--pid", str(pid)]
                    dump = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
                    (out_dir / f"{pid}.txt").write_text(dump.stdout + dump.stderr)
        return rows

    def ranks(self) -> dict[int, int]:
        """{global rank: pid}: processes with RANK whose parent has none (DataLoader
        workers inherit their rank's variables)."""
        pids = set(self.pids())
        out = {}
        for pid in pids:
            env = dict(e.split(b"=", 1) for e in _environ(pid) if b"=" in e)
            parent = _parent(pid)
            parent_has = parent in pids and any(e.startswith(b"RANK=") for e in _environ(parent))
            if b"RANK" in env and not parent_has:
                out[int(env[b"RANK"])] = pid
        return out

    def launchers(self) -> list[int]:
        """The processes above the ranks, top first (taco-launch, the deepspeed runner and
        its per-node launcher, torchrun's agent)."""
        ranks = set(self.ranks().values())
        chain, pid = [], next(iter(ranks), None)
        while pid is not None:
            pid = _parent(pid)
            if pid is None or pid <= 1:
                break
            chain.append(pid)
            if pid == self.proc.pid:
                break
        return list(reversed(chain)) if self.proc.pid in chain else [self.proc.pid]

    def signal(self, pid: int, sig: int) -> bool:
        try:
            os.kill(pid, sig)
            return True
        except OSError:
            return False

    def signal_all(self, sig: int) -> None:
        for pid in self.pids():
            self.signal(pid, sig)

    def kill_all(self) -> None:
        """Freeze, then kill every process of the job (a node lost)."""
        pids = self.pids()
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                self.signal(pid, sig)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=max(timeout, 0))
        except subprocess.TimeoutExpired:
            return None

    def wait_gone(self, timeout: float) -> bool:
        """Every process of the job gone (a requeue starts only then)."""
        deadline = time.monotonic() + timeout
        while self.pids():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")

    def cleanup(self) -> None:
        self.kill_all()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


class MetricsWatch:
    """The training records a job appends to metrics.jsonl after ``start`` (the file's size
    when the attempt began), with the time each was first seen."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.is_file() else 0
        self.pending = b""
        self.train: list[tuple[float, dict]] = []
        self.lock = threading.Lock()  # the fault's thread and the attempt's loop both poll

    def poll(self) -> list[tuple[float, dict]]:
        with self.lock:
            return self._poll()

    def _poll(self) -> list[tuple[float, dict]]:
        if not self.path.is_file():
            return self.train
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        lines = (self.pending + data).split(b"\n")
        self.pending = lines.pop()
        now = time.time()
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("split") == "train":
                self.train.append((now, record))
        return self.train
