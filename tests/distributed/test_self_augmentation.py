"""SAS self-augmentation on real gloo groups: the committed generation does not depend on
the layout that wrote it (dp=1, dp=2 and tp=2 write byte-identical stores from the same
logits), and the next epoch's collator reads exactly those rows."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from megatron_taco.data.replacement_store import GenerationReader, StoreLayout
from megatron_taco.data.sas_collator import ColdStart
from megatron_taco.parallel.layers import pad_vocab_size
from megatron_taco.parallel.state import init_parallel
from megatron_taco.recipes.sas_augmentation import (
    SelfAugmentation,
    SelfAugmentationConfig,
    StoreSource,
)
from megatron_taco.training.checkpointing import TrainingState
from tests.helpers import run_distributed

N, WIDTH, SEQ, VOCAB, MICRO = 16, 3, 8, 300, 4
SPECIALS = np.arange(5)


def slots_of(instance: int) -> np.ndarray:
    """S of an instance (fixed positions); instance 3 uses only 2 of its 3 slots."""
    used = 2 if instance == 3 else WIDTH
    return np.sort(np.random.default_rng(instance).choice(np.arange(1, SEQ - 1), used, False))


def logits_of(instance: int, position: int) -> torch.Tensor:
    """The MLM logits of (instance, position) over the padded vocabulary: a fixed function,
    so every layout sees the same numbers."""
    g = torch.Generator().manual_seed(1000 * instance + position)
    full = torch.randn(pad_vocab_size(VOCAB, 1), generator=g, dtype=torch.float64) * 3
    return full


def micro_batch(instances: list[int], tp_rank: int, tp: int):
    b = len(instances)
    slots = torch.full((b, WIDTH), -1, dtype=torch.long)
    rows, flat = [], []
    for i, inst in enumerate(instances):
        where = slots_of(inst)
        slots[i, : where.size] = torch.from_numpy(where)
        for p in sorted(where.tolist()):  # the model's rows are in flat b*s order
            rows.append(logits_of(inst, p))
            flat.append(i * SEQ + p)
    full = torch.stack(rows)  # [N, V_padded(tp=1)]
    padded = pad_vocab_size(VOCAB, tp)
    full = torch.cat([full, full.new_zeros(full.shape[0], padded - full.shape[1])], dim=1)
    local = full.chunk(tp, dim=1)[tp_rank]
    batch = {
        "input_ids": torch.zeros(b, SEQ, dtype=torch.long),
        "instance_ids": torch.tensor(instances),
        "replaced_positions": slots,
    }
    return batch, {"mlm_logits": local, "mlm_positions": torch.tensor(flat)}


def _write_generation(rank, world_size, tp, root):
    parallel = init_parallel(tp)
    layout = StoreLayout(num_instances=N, width=WIDTH, vocab_size=VOCAB, num_shards=3)
    callback = SelfAugmentation(
        SelfAugmentationConfig(), root=root, layout=layout, seed=11,
        special_ids=SPECIALS, vocab_size=VOCAB,
    )  # fmt: skip
    trainer = SimpleNamespace(parallel=parallel, num_epochs=lambda: 2)
    state = TrainingState()
    callback.on_train_start(trainer, state)
    callback.on_epoch_start(trainer, state, 0)
    order = np.random.default_rng(5).permutation(N).tolist()
    chunk = MICRO * parallel.dp_size  # one global micro-step
    for start in range(0, N, chunk):
        mine = order[start + parallel.dp_rank * MICRO : start + (parallel.dp_rank + 1) * MICRO]
        batch, outputs = micro_batch(mine, parallel.tp_rank, tp)
        callback.after_micro_batch(trainer, state, batch, outputs)
    callback.on_epoch_end(trainer, state, 0)
    return True


def _store_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_generation_is_layout_independent_and_read_back_exactly(tmp_path):
    layouts = {"dp1": (1, 1), "dp2": (2, 1), "tp2": (2, 2)}  # name: (world, tp)
    for name, (world, tp) in layouts.items():
        run_distributed(_write_generation, world, tp, str(tmp_path / name))
    stores = {name: _store_files(tmp_path / name) for name in layouts}
    assert "gen_00000/manifest.json" in stores["dp1"]
    for name in ("dp2", "tp2"):
        assert stores[name].keys() == stores["dp1"].keys()
        for file, data in stores["dp1"].items():
            assert stores[name][file] == data, (name, file)

    # Epoch 2 (index 1) reads generation 0 exactly at S; epoch 1 (index 0) the cold start.
    cold = ColdStart(np.r_[np.zeros(5), np.ones(VOCAB - 5)] / (VOCAB - 5), seed=3)
    source = StoreSource(cold, str(tmp_path / "dp2"))
    rows = GenerationReader(str(tmp_path / "dp1"), 0).read(np.arange(N))
    for inst in range(N):
        where = slots_of(inst)
        got = source.replacements(inst, 1, where)
        np.testing.assert_array_equal(got, rows[inst, : where.size])
        assert (got >= 5).all() and (got < VOCAB).all()  # never a special, never padding
        np.testing.assert_array_equal(
            source.replacements(inst, 0, where), cold.replacements(inst, 0, where)
        )
    assert os.path.isfile(tmp_path / "dp1" / "gen_00000" / "manifest.json")


def _epoch_start_on_a_damaged_store(rank, world_size, root):
    from megatron_taco.arguments import ConfigError

    parallel = init_parallel(1)
    layout = StoreLayout(num_instances=N, width=WIDTH, vocab_size=VOCAB, num_shards=3)
    callback = SelfAugmentation(
        SelfAugmentationConfig(), root=root, layout=layout, seed=11,
        special_ids=SPECIALS, vocab_size=VOCAB,
    )  # fmt: skip
    trainer = SimpleNamespace(parallel=parallel, num_epochs=lambda: 3)
    try:
        callback.on_epoch_start(trainer, TrainingState(), 1)
    except ConfigError as e:
        return str(e)
    return None


def test_damaged_generation_is_refused_on_every_rank_by_name(tmp_path):
    root = tmp_path / "store"
    run_distributed(_write_generation, 2, 1, str(root))
    shard = root / "gen_00000" / "shard_00001.bin"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 4)
    messages = run_distributed(_epoch_start_on_a_damaged_store, 2, str(root))
    for message in messages:
        assert message is not None and message.startswith("--replacement-store: ")
        assert "shard_00001.bin" in message and "truncated" in message
