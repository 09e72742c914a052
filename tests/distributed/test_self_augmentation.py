"""SAS self-augmentation on real gloo groups, with S in the collator's own draw order:

* the stored tokens follow softmax(logits / T) of their own slot's position (a chi-square
  test of the probability integral transform), dropped slots keep the original token;
* the committed generation does not depend on the layout that wrote it (dp=1, dp=2 and tp=2
  write byte-identical stores from the same logits), and the next epoch's collator reads
  exactly those rows;
* the logged self_augmented share is measured over every data-parallel rank;
* at an epoch end the generations a checkpoint in --save needs are kept, the others go.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from megatron_taco.checkpoint.layout import FORMAT, TrainingState, checkpoint_tag
from megatron_taco.checkpoint.manifest import write_metadata as _write_metadata
from megatron_taco.data.replacement_store import (
    GenerationReader,
    StoreLayout,
)
from megatron_taco.data.sas_collator import ColdStart, replaced_positions
from megatron_taco.parallel.layers import pad_vocab_size
from megatron_taco.parallel.state import init_parallel, single_process_state
from megatron_taco.recipes.sas_augmentation import (
    SelfAugmentation,
    SelfAugmentationConfig,
    StoreSource,
    generations_needed,
)
from megatron_taco.training.loop import MetricAccumulator
from tests.helpers import chi2_goodness_of_fit, committed_generations, run_distributed

N, SEQ, VOCAB, MICRO = 16, 22, 300, 4
WIDTH = 3  # ceil(0.15 * (SEQ - 2))
SPECIALS = np.arange(5)
TEMPERATURE = 0.7


@functools.cache
def slots_of(instance: int) -> np.ndarray:
    """S of an instance in the production draw order (replaced_positions: whole words in a
    random order, so slot order is not position order); every third instance is shorter
    and uses only 2 slots."""
    length = 16 if instance % 3 == 0 else SEQ
    rng = np.random.default_rng(instance)
    word_starts = rng.random(SEQ) < 0.8
    word_starts[[0, 1, length - 1]] = True
    special = np.ones(SEQ, dtype=bool)
    special[1 : length - 1] = False
    return replaced_positions(word_starts, special, length, 0.15, 11, instance)


def dropped_of(instance: int, where: np.ndarray) -> np.ndarray:
    """Slots dropped as hits (--drop-replacement-hits): every fourth instance's second slot."""
    drop = np.zeros(where.size, dtype=bool)
    if instance % 4 == 1:
        drop[1] = True
    return drop


def original_of(instance: int, position: int) -> int:
    return 5 + (7 * instance + 13 * position) % (VOCAB - 5)


def logits_of(instance: int, position: int) -> torch.Tensor:
    """The MLM logits of (instance, position) over the padded vocabulary: a fixed function,
    so every layout sees the same numbers."""
    g = torch.Generator().manual_seed(1000 * instance + position)
    return torch.randn(pad_vocab_size(VOCAB, 1), generator=g, dtype=torch.float64) * 3


def micro_batch(instances: list[int], tp_rank: int, tp: int):
    """A batch as the collator builds it and the outputs as the model returns them: logits
    rows only at the kept positions of S, in flat b*s order."""
    b = len(instances)
    slots = torch.full((b, WIDTH), -1, dtype=torch.long)
    dropped = torch.zeros(b, WIDTH, dtype=torch.bool)
    input_ids = torch.zeros(b, SEQ, dtype=torch.long)
    rows, flat = [], []
    for i, inst in enumerate(instances):
        where = slots_of(inst)
        drop = dropped_of(inst, where)
        slots[i, : where.size] = torch.from_numpy(where)
        dropped[i, : where.size] = torch.from_numpy(drop)
        for p in range(SEQ):
            input_ids[i, p] = original_of(inst, p)
        for p in sorted(where[~drop].tolist()):  # the model's rows are in flat b*s order
            rows.append(logits_of(inst, p))
            flat.append(i * SEQ + p)
    full = torch.stack(rows)  # [N, V_padded(tp=1)]
    padded = pad_vocab_size(VOCAB, tp)
    full = torch.cat([full, full.new_zeros(full.shape[0], padded - full.shape[1])], dim=1)
    local = full.chunk(tp, dim=1)[tp_rank]
    kept = ((slots >= 0) & ~dropped).sum(1)
    batch = {
        "input_ids": input_ids,
        "instance_ids": torch.tensor(instances),
        "replaced_positions": slots,
        "dropped_slots": dropped,
        # Measured share: pretend even instances came from the store.
        "from_store": torch.where(torch.tensor(instances) % 2 == 0, kept, 0),
    }
    return batch, {"mlm_logits": local, "mlm_positions": torch.tensor(flat)}


def _callback(root: str, num_instances: int) -> SelfAugmentation:
    layout = StoreLayout(num_instances=num_instances, width=WIDTH, vocab_size=VOCAB, num_shards=3)
    return SelfAugmentation(
        SelfAugmentationConfig(sampling_temperature=TEMPERATURE), root=root, layout=layout,
        seed=11, special_ids=SPECIALS, vocab_size=VOCAB,
    )  # fmt: skip


def _trainer(parallel, save=None, epochs=2):
    return SimpleNamespace(
        parallel=parallel,
        num_epochs=lambda: epochs,
        checkpoint=SimpleNamespace(save=save),
        parts=SimpleNamespace(samples_per_epoch=N),
        global_batch_size=N // 4,
        exiting=None,
    )


def _write_generation(rank, world_size, tp, root, num_instances=N, parallel=None, micro=MICRO):
    """Epoch 0 of a run: every instance once, in a shuffled order, split over dp ranks in
    micro-batches of ``micro``; returns the logged metrics."""
    parallel = parallel or init_parallel(tp)
    callback = _callback(root, num_instances)
    trainer = _trainer(parallel)
    state = TrainingState()
    callback.on_train_start(trainer, state)
    callback.on_epoch_start(trainer, state, 0)
    order = np.random.default_rng(5).permutation(num_instances).tolist()
    chunk = micro * parallel.dp_size  # one global micro-step
    acc = MetricAccumulator()  # the loop's: what the callback adds is summed over dp there
    for start in range(0, num_instances, chunk):
        mine = order[start + parallel.dp_rank * micro : start + (parallel.dp_rank + 1) * micro]
        batch, outputs = micro_batch(mine, parallel.tp_rank, tp)
        callback.after_micro_batch(trainer, state, batch, outputs)
        acc.add(outputs)
    callback.on_epoch_end(trainer, state, 0)
    return callback.metrics(acc.finish(acc.reduced(parallel).tolist(), iterations=1))


def _store_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _reference_probs(instance: int, position: int) -> np.ndarray:
    """softmax(logits / T) over the real vocabulary, specials excluded: what the sampler
    must draw from, computed here in float64 without the code under test."""
    logits = logits_of(instance, position)[:VOCAB] / TEMPERATURE
    logits[SPECIALS] = -np.inf
    return torch.softmax(logits, 0).numpy()


def test_stored_tokens_follow_the_softmax_of_their_own_slot(tmp_path):
    """Probability integral transform: with the vocabulary ordered by the reference
    probability of the slot's own position, u = P(rank < rank(token)) + U * p(token) is
    uniform on (0, 1) exactly when the token was drawn from that distribution. A sampler
    reading another slot's logits, ignoring the logits or the temperature puts u elsewhere."""
    num = 900
    _write_generation(0, 1, 1, str(tmp_path), num, parallel=single_process_state(), micro=50)
    rows = GenerationReader(str(tmp_path), 0).read(np.arange(num))
    rng = np.random.default_rng(0)
    u = []
    for inst in range(num):
        where, drop = slots_of(inst), dropped_of(inst, slots_of(inst))
        for j, position in enumerate(where):
            token = int(rows[inst, j])
            if drop[j]:  # read unreplaced, so it stays a hit in every later epoch
                assert token == original_of(inst, int(position))
                continue
            p = _reference_probs(inst, int(position))
            assert p[token] > 0, "a special token or padding was drawn"
            order = np.argsort(-p, kind="stable")
            rank = int(np.flatnonzero(order == token)[0])
            u.append(p[order[:rank]].sum() + rng.random() * p[token])
        assert (rows[inst, where.size :] == 0).all()  # unused slots
    bins = 20
    observed = np.bincount(np.minimum((np.asarray(u) * bins).astype(int), bins - 1), minlength=bins)
    statistic, pvalue = chi2_goodness_of_fit(observed, np.full(bins, len(u) / bins))
    assert len(u) > 2000 and pvalue > 1e-3, (statistic, observed)


def test_generation_is_layout_independent_and_read_back_exactly(tmp_path):
    layouts = {"dp1": (1, 1), "dp2": (2, 1), "tp2": (2, 2)}  # name: (world, tp)
    metrics = {}
    for name, (world, tp) in layouts.items():
        metrics[name] = run_distributed(_write_generation, world, tp, str(tmp_path / name))
    stores = {name: _store_files(tmp_path / name) for name in layouts}
    assert "gen_00000/manifest.json" in stores["dp1"]
    for name in ("dp2", "tp2"):
        assert stores[name].keys() == stores["dp1"].keys()
        for file, data in stores["dp1"].items():
            assert stores[name][file] == data, (name, file)

    # The share of S read from the store, over all ranks: the even instances' kept slots.
    kept = {i: int((~dropped_of(i, slots_of(i))).sum()) for i in range(N)}
    share = sum(kept[i] for i in range(0, N, 2)) / sum(kept.values())
    for name in layouts:
        for rank_metrics in metrics[name]:
            assert rank_metrics["self_augmented"] == share, name

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
    assert source.reads_store(1) and not source.reads_store(0)


def _epoch_start_on_a_damaged_store(rank, world_size, root):
    from megatron_taco.errors import ConfigError

    parallel = init_parallel(1)
    callback = _callback(root, N)
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


def _fake_checkpoint(save: Path, iteration: int, consumed: int) -> None:
    path = save / checkpoint_tag(iteration)
    path.mkdir(parents=True)
    meta = {"format": FORMAT, "iteration": iteration, "consumed_samples": consumed,
            "world_size": 1, "tensor_model_parallel_size": 1, "data_parallel_size": 1,
            "model": "SAS", "configs": {}}  # fmt: skip
    _write_metadata(str(path), meta, {})


def _run_epochs(rank, world_size, root, save, epochs):
    parallel = init_parallel(1)
    callback = _callback(root, N)
    trainer = _trainer(parallel, save, epochs)
    state = TrainingState()
    callback.on_train_start(trainer, state)
    for epoch in range(epochs):
        callback.on_epoch_start(trainer, state, epoch)
        for start in range(0, N, MICRO * parallel.dp_size):
            mine = list(
                range(start + parallel.dp_rank * MICRO, start + (parallel.dp_rank + 1) * MICRO)
            )
            batch, outputs = micro_batch(mine, 0, 1)
            callback.after_micro_batch(trainer, state, batch, outputs)
        callback.on_epoch_end(trainer, state, epoch)
    return committed_generations(root)


def test_generations_kept_for_the_checkpoints_in_save(tmp_path):
    """Checkpoints (as --save-retain left them) at 2.5 epochs and at 4: generation 1 (read
    in epoch 2) and 2 (half written) for the first, 3 for the second; every epoch commits
    its generation, the last one's too."""
    save = tmp_path / "ckpt"
    _fake_checkpoint(save, 10, int(2.5 * N))  # inside epoch 2 (0-based)
    _fake_checkpoint(save, 16, 4 * N)  # the end of the run
    assert generations_needed(str(save), N) == {1, 2, 3}
    assert generations_needed(None, N) == set()
    kept = run_distributed(_run_epochs, 2, str(tmp_path / "store"), str(save), 5)
    assert kept == [[1, 2, 3, 4]] * 2  # 0 is needed by no checkpoint; 4 is the last epoch's
    no_save = run_distributed(_run_epochs, 1, str(tmp_path / "store2"), None, 3)
    assert no_save == [[2]]
    assert os.path.isfile(tmp_path / "store" / "gen_00004" / "manifest.json")


def _slow_commit(rank, world_size, root):
    """Rank 0's commit (a full scan of the generation) held 8 s by the documented
    MEGATRON_TACO_TEST_PAUSE_AT while the collectives time out after 3 s (issue 27 item 9):
    the others wait on the file group's barrier, not in the gather."""
    from datetime import timedelta

    from megatron_taco.runtime.faults import PAUSE_ENV

    os.environ[PAUSE_ENV] = "store_commit@0:8"
    torch.distributed.distributed_c10d._set_pg_timeout(timedelta(seconds=3), None)
    return _run_epochs(rank, world_size, root, None, 1)


def test_a_slow_store_commit_on_rank_0_is_no_collective_timeout(tmp_path):
    assert run_distributed(_slow_commit, 2, str(tmp_path / "store")) == [[0], [0]]


def _resumed_epoch(rank, world_size, root, damage=None):
    """Epoch 0 up to a checkpoint halfway (its rows flushed), then the processes die; maybe
    the store is damaged on disk then (DAMAGES); the resumed run opens the generation again,
    replays the steps after the checkpoint and ends the epoch. Returns the committed
    generations, or the line the run stopped with."""
    from megatron_taco.errors import ConfigError, RunError

    parallel = init_parallel(1)
    order = np.random.default_rng(5).permutation(N).tolist()
    chunk = MICRO * parallel.dp_size
    steps = [order[s + parallel.dp_rank * MICRO : s + (parallel.dp_rank + 1) * MICRO]
             for s in range(0, N, chunk)]  # fmt: skip
    half = len(steps) // 2
    trainer, state = _trainer(parallel), TrainingState()
    try:
        for resumed, run in enumerate((steps[:half], steps[half:])):
            callback = _callback(root, N)
            callback.on_train_start(trainer, state)
            callback.on_epoch_start(trainer, state, 0)
            for mine in run:
                callback.after_micro_batch(trainer, state, *micro_batch(mine, 0, 1))
            if not resumed:
                callback.on_save(trainer, state)  # the checkpoint
                callback.writer.close()  # the crash: the kernel closes its files
                torch.distributed.barrier()
                if damage is not None and rank == 0:
                    DAMAGES[damage](Path(root) / "gen_00000", callback.layout, order[0])
                torch.distributed.barrier()
        callback.on_epoch_end(trainer, state, 0)
    except (ConfigError, RunError) as e:
        return str(e)
    return committed_generations(root)


def _change_token(directory: Path, layout: StoreLayout, instance: int) -> None:
    """A token of a row written before the checkpoint, changed to another valid id."""
    k, row = divmod(instance, layout.rows_per_shard)
    with open(directory / layout.shard_file(k), "r+b") as f:
        f.seek(row * layout.record_bytes)
        token = int(np.frombuffer(f.read(2), dtype=layout.dtype)[0])
        f.seek(row * layout.record_bytes)
        f.write(np.array([(token + 1) % VOCAB], dtype=layout.dtype).tobytes())


def _truncate_shard_1(directory: Path, layout: StoreLayout, _instance: int) -> None:
    """Shard 1, which dp rank 1 alone owns, cut to half its size."""
    path = directory / layout.shard_file(1)
    os.truncate(path, path.stat().st_size // 2)


def _other_layout(directory: Path, layout: StoreLayout, _instance: int) -> None:
    """The generation's layout.json as a run with other settings would have written it."""
    path = directory / "layout.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "width": WIDTH + 1}))


def _version_1_layout(directory: Path, layout: StoreLayout, _instance: int) -> None:
    """The generation's layout.json as the store's format 1 (no row checksums) wrote it."""
    path = directory / "layout.json"
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items()
                                if k != "version"}))  # fmt: skip


DAMAGES = {"token": _change_token, "truncated shard": _truncate_shard_1,
           "another run's layout": _other_layout, "format 1": _version_1_layout}  # fmt: skip


def test_a_row_changed_between_its_write_and_the_commit_stops_every_rank(tmp_path):
    """The issue's fault: in-range bytes changed in the generation being written, then a
    resume. Without the change, the resumed generation is the uninterrupted one."""
    run_distributed(_write_generation, 2, 1, str(tmp_path / "reference"))
    clean = run_distributed(_resumed_epoch, 2, str(tmp_path / "clean"))
    assert clean == [[0], [0]]
    assert _store_files(tmp_path / "clean") == _store_files(tmp_path / "reference")
    messages = run_distributed(_resumed_epoch, 2, str(tmp_path / "changed"), "token")
    first = int(np.random.default_rng(5).permutation(N)[0])
    layout = _callback(str(tmp_path), N).layout
    k, row = divmod(first, layout.rows_per_shard)
    shard = tmp_path / "changed" / "gen_00000" / layout.shard_file(k)
    assert (
        messages
        == [
            f"--replacement-store: {shard}: row {row} (instance {first}) does not match the "
            "checksum written with it (the shard changed on disk after the row was written); 1 "
            "such row(s); refusing to commit generation 0; no checkpoint predates epoch 1 "
            "(iteration 0), which would write the generation anew: start the run again"
        ]
        * 2
    )
    assert not (tmp_path / "changed" / "gen_00000" / "manifest.json").exists()


def test_a_damaged_generation_being_written_stops_every_rank_when_reopened(tmp_path):
    """A resume reopens the generation being written: a shard that one rank owns cut short,
    the layout of a run with other settings or of the store's format 1 is the same one line
    on every rank (not a traceback on the owners while the others wait in a barrier)."""
    layout = _callback(str(tmp_path), N).layout
    shard, size = tmp_path / "t" / "gen_00000" / layout.shard_file(1), layout.shard_bytes(1)
    line = f"{shard}: truncated (size {size // 2} bytes, expected {size})"
    truncated = run_distributed(_resumed_epoch, 2, str(tmp_path / "t"), "truncated shard")
    assert truncated == [f"--replacement-store: {line}"] * 2
    directory = tmp_path / "o" / "gen_00000"
    stored = StoreLayout(num_instances=N, width=WIDTH + 1, vocab_size=VOCAB, num_shards=3)
    line = (f"{directory / 'layout.json'}: generation 0 was started with {stored}, not "
            f"{layout}; delete {directory} to start it afresh")  # fmt: skip
    other = run_distributed(_resumed_epoch, 2, str(tmp_path / "o"), "another run's layout")
    assert other == [f"--replacement-store: {line}"] * 2
    line = (f"{tmp_path / 'v1' / 'gen_00000' / 'layout.json'}: layout: format version 1, this "
            "version reads 2 (rows with checksums); delete the generation to write it anew")  # fmt: skip
    old = run_distributed(_resumed_epoch, 2, str(tmp_path / "v1"), "format 1")
    assert old == [f"--replacement-store: {line}"] * 2


def _rows_lost_on_rank_1(rank, world_size, root):
    """A write of rows that fails on rank 1 alone mid-epoch (a real EFBIG: a file-size limit
    below its shard's rows, as a full copy-on-write disk fails a write the pre-fill made
    room for), then the checkpoint's on_save."""
    import resource
    import signal

    from megatron_taco.errors import RunError

    parallel = init_parallel(1)
    trainer, state = _trainer(parallel), TrainingState()
    callback = _callback(root, N)
    callback.on_train_start(trainer, state)
    callback.on_epoch_start(trainer, state, 0)
    order = np.random.default_rng(5).permutation(N).tolist()
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (1, limit[1]))
    try:
        for s in range(0, N, MICRO * parallel.dp_size):  # the whole epoch
            mine = order[s + parallel.dp_rank * MICRO : s + (parallel.dp_rank + 1) * MICRO]
            callback.after_micro_batch(trainer, state, *micro_batch(mine, 0, 1))
        callback.on_save(trainer, state)
    except RunError as e:
        return str(e)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    return "saved"


def test_a_store_write_failing_on_one_rank_stops_every_rank_before_the_save(tmp_path):
    # Issue 27 item 5: before, rank 1 raised a traceback mid-epoch and rank 0 waited in the
    # next collective until "rank 1 died" or the timeout; the exit save was lost.
    lines = run_distributed(_rows_lost_on_rank_1, 2, str(tmp_path))
    directory = tmp_path / "gen_00000"
    assert (
        lines
        == [
            f"--replacement-store: writing rows failed: {directory}: File too large (the last "
            "checkpoint is kept: none is saved without its rows)"
        ]
        * 2
    )


def test_a_generation_that_cannot_be_committed_names_the_way_on(tmp_path):
    """Rows written before the last checkpoint are not written again by resuming from it;
    every row is by resuming from a checkpoint saved before the epoch began (the fault
    campaign's trial 14: every requeue stopped with a line naming no way on)."""
    from megatron_taco.recipes.sas_augmentation import _rewrite_hint

    save = tmp_path / "ckpt"
    for iteration in (4, 8, 12):  # epochs of 8 iterations: epoch 2 (index 1) began at 8
        (save / f"iter_{iteration:07d}").mkdir(parents=True)
        (save / f"iter_{iteration:07d}" / "metadata.json").write_text("{}")
    trainer = _trainer(None, str(save))
    trainer.parts.samples_per_epoch, trainer.global_batch_size = 64, 8
    assert _rewrite_hint(trainer, 1) == (
        f"resume from a checkpoint saved before epoch 2 began, which writes the generation "
        f"anew: --load {save} --ckpt-step 8"
    )
    assert _rewrite_hint(trainer, 0) == (
        f"no checkpoint in --save {save} predates epoch 1 (iteration 0), which would write the "
        "generation anew: start the run again with --override-existing-checkpoints"
    )
