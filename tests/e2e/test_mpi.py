"""pretrain_taco.py started by MPI (MPICH's Hydra from the `mpich` wheel, mpi4py), two ways,
each training the same 3 iterations as 2 ranks started as `deepspeed --num_gpus 2` starts
them, with identical losses:

* `mpirun -np 2 python pretrain_taco.py`: the ranks have only MPI's variables (PMI_RANK,
  PMI_SIZE); init_distributed runs DeepSpeed's MPI discovery (mpi4py) and rank 0 picks the
  rendezvous port;
* `deepspeed --launcher mpich --hostfile H` with H naming this machine twice, under two
  names (DeepSpeed refuses a repeated name): DeepSpeed's multi-node path, two "nodes" of one
  rank each. `--launcher_args "-launcher fork"` makes Hydra start both nodes' proxies here
  instead of through ssh; `--no_ssh_check` skips DeepSpeed's own ssh probe.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.helpers import BIN, TACO_METRIC_KEYS, free_port, launch, run, train_records

pytestmark = pytest.mark.e2e

ITERS = 3


@pytest.fixture(scope="module")
def mpi():
    if not (BIN / "mpirun").is_file() or importlib.util.find_spec("mpi4py") is None:
        pytest.skip(
            f"no mpirun/mpi4py beside {sys.executable}: pip install -r requirements/cpu.txt"
        )


def args(dataset, metrics) -> list[str]:
    return [
        "--model-size", "tiny", "--seq-length", "64",
        "--data-path", dataset["prefix"], "--tokenizer-model", dataset["tokenizer"],
        "--data-cache-path", str(dataset["dir"] / "cache"), "--split", "80,10,10",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERS),
        "--lr", "1e-3", "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters", "0",
        "--num-workers", "1", "--deepspeed-config", "ds_configs/zero1_fp32.json",
        "--metrics-file", str(metrics),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def reference(botchan_dataset, tmp_path_factory):
    """The same run on 2 ranks as `deepspeed --num_gpus 2` and torchrun start them."""
    metrics = tmp_path_factory.mktemp("deepspeed") / "metrics.jsonl"
    res = launch("pretrain_taco.py", *args(botchan_dataset, metrics), world=2)
    assert "world size 2 = tensor parallel 1 x data parallel 2" in res.stdout
    return train_records(metrics)


def _assert_same(records, reference):
    assert sorted(records) == list(range(1, ITERS + 1))
    for it in range(1, ITERS + 1):
        for key in (*TACO_METRIC_KEYS, "lr", "grad_norm", "consumed_samples"):
            assert records[it][key] == reference[it][key], (it, key)


def test_mpirun_matches_deepspeed(mpi, botchan_dataset, reference, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    # MASTER_ADDR on loopback (discovery would take rank 0's first `hostname -I` address);
    # no MASTER_PORT, so the port comes from rank 0 through MPI.
    res = run(
        [str(BIN / "mpirun"), "-np", "2", "-genv", "MASTER_ADDR", "127.0.0.1",
         sys.executable, "pretrain_taco.py", *args(botchan_dataset, metrics)],
        timeout=240,
    )  # fmt: skip
    assert "world size 2 = tensor parallel 1 x data parallel 2" in res.stdout
    assert "global batch 8 = micro-batch 2 x grad accumulation 2 x data parallel 2" in res.stdout
    _assert_same(train_records(metrics), reference)


def test_deepspeed_mpich_launcher_two_nodes_matches_deepspeed(
    mpi, botchan_dataset, reference, tmp_path
):
    metrics = tmp_path / "metrics.jsonl"
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    res = run(
        [str(BIN / "deepspeed"), "--hostfile", str(hostfile), "--launcher", "mpich",
         "--launcher_args", "-launcher fork", "--no_ssh_check",
         "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
         "pretrain_taco.py", *args(botchan_dataset, metrics)],
        timeout=240,
    )  # fmt: skip
    # DeepSpeed's multi-node runner: one rank on each of the two "nodes".
    assert "mpirun -n 2 -ppn 1 -launcher fork" in res.stdout + res.stderr
    assert "-hosts localhost,127.0.0.1" in res.stdout + res.stderr
    assert "world size 2 = tensor parallel 1 x data parallel 2" in res.stdout
    _assert_same(train_records(metrics), reference)
