"""SAS's self-augmentation (paper, eqs. 1-2): the tokens the model reads at an instance's
replaced set S in epoch t+1 are sampled from its own MLM softmax at S in epoch t.

* Sampling reuses the MLM logits the loss already computed (no extra forward): one token per
  slot of S from softmax(logits / T), exact under tensor parallelism without gathering the
  vocabulary (parallel/sampling.py: an inverse-CDF draw with a counter-based uniform keyed
  by (seed, instance, position, epoch), so a resumed run, or another layout, draws the same
  tokens).
* The rows go to the sharded on-disk store (data/replacement_store/, docs/replacement_store.md):
  generation t holds what epoch t sampled. Shard k is written only by data-parallel rank
  k mod dp (tensor-parallel rank 0): each micro-batch's rows are all-gathered over the
  data-parallel group and every rank keeps those of its shards, so no two processes ever
  write one file and the shard count does not depend on the layout.
* Checkpoints flush the rows written so far; the end of epoch t commits generation t
  (flush everywhere, barrier, one manifest written atomically by rank 0) before epoch t+1's
  data loader exists. A crash and ``--load`` replays the steps since the checkpoint and
  rewrites the same rows with the same tokens, so the committed store is byte-identical.
* Retention: a checkpoint taken in epoch e needs generation e-1 (read in epoch e) and the
  rows of generation e written before it; at every epoch end every generation that a
  checkpoint still in --save needs is kept (so with --save-retain only those of the retained
  ones), the others are deleted. The last epoch commits its generation too, so a finished
  run can be extended with more epochs.
* ``--drop-replacement-hits`` (the reference release): a slot whose stored token equals the
  original is dropped from S by the collator; the sampler writes the original there again,
  so the slot stays dropped in every later epoch and S only shrinks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_taco.arguments import flag_of, option, require
from megatron_taco.checkpoint.errors import (
    CheckpointInvalid,
    CheckpointTooNew,
    CheckpointUnreadable,
)
from megatron_taco.checkpoint.layout import checkpoint_tag, complete_iterations
from megatron_taco.checkpoint.manifest import read_metadata
from megatron_taco.data.replacement_store import (
    LAYOUT_NAME,
    GenerationReader,
    GenerationWriter,
    ReplacementStoreError,
    StoreLayout,
    check_origin,
    commit_generation,
    delete_generations,
    generation_dir,
    list_generations,
    manifest_path,
    read_layout_file,
)
from megatron_taco.data.sas_collator import ReplacementSource
from megatron_taco.data.tokenizer import tokenizer_file, tokenizer_flag
from megatron_taco.errors import ConfigError, RunError
from megatron_taco.model_outputs import COUNT_SUFFIX
from megatron_taco.parallel import comm
from megatron_taco.parallel.sampling import sample_row_keys, vocab_parallel_sample
from megatron_taco.runtime.faults import hook_point
from megatron_taco.training.callbacks import Callback

logger = logging.getLogger(__name__)
SAMPLING_SEED_OFFSET = 7919  # keeps the sampling noise apart from other uses of --seed
# Per iteration over the data-parallel ranks: the kept (not dropped) slots of S, and those
# whose token was read from the store (self_augmented is their ratio).
KEPT_KEY = "replaced" + COUNT_SUFFIX
FROM_STORE_KEY = "replaced_from_store" + COUNT_SUFFIX
# DataConfig fields that do not decide the rows (where files are, how they are read), and
# those recorded by content instead of by path (the data and the tokenizer may be moved).
_DATA_NOT_RECORDED = (
    "data_path",
    "tokenizer_model",
    "vocab_file",
    "data_cache_path",
    "num_workers",
)


def _file_digest(path: str) -> str:
    """sha256 of a file, or of a directory's files by name (a tokenizer of several files)."""
    digest = hashlib.sha256()
    paths = (
        [path]
        if not os.path.isdir(path)
        else sorted(os.path.join(root, name) for root, _, names in os.walk(path) for name in names)
    )
    for name in paths:
        digest.update(os.path.relpath(name, path).encode())
        with open(name, "rb") as f:
            for chunk in iter(lambda f=f: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def _by_flag(config: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        flag_of(type(config), f.name): getattr(config, f.name)
        for f in dataclasses.fields(config)
        if f.name not in skip
    }


def store_origin(data, replacement, augmentation: SelfAugmentationConfig) -> tuple:
    """What decides which instance and slot a store row belongs to, by flag: every field of
    the data and replacement configs (so a field added later is covered), each --data-path
    dataset by name, weight and size, the tokenizer by content. StoreLayout.origin."""
    # By the name the files have, not the one a symlink or a relative path gives them.
    datasets = [
        [
            weight,
            os.path.basename(os.path.realpath(prefix + ".bin"))[: -len(".bin")],
            *(os.path.getsize(prefix + ext) for ext in (".bin", ".idx")),
        ]
        for prefix, weight in zip(data.prefixes, data.weights)
    ]
    origin = {
        **_by_flag(data, skip=_DATA_NOT_RECORDED),
        "--data-path": datasets,
        # --tokenizer-model or --vocab-file, whichever --tokenizer-type reads.
        tokenizer_flag(data): f"sha256:{_file_digest(tokenizer_file(data))}",
        **_by_flag(replacement),
        "--drop-replacement-hits": augmentation.drop_replacement_hits,
    }
    return tuple((flag, json.dumps(value, sort_keys=True)) for flag, value in origin.items())


def check_store_origin(root: str, layout_origin: tuple) -> None:
    """Before any process group, for a resume: every generation in the store was written
    with this run's origin, else one line naming the first flag that differs."""
    probe = StoreLayout(1, 1, 1, 1, origin=layout_origin)
    for generation in list_generations(root):
        path = os.path.join(generation_dir(root, generation), LAYOUT_NAME)
        try:
            stored = read_layout_file(path)
        except ReplacementStoreError:
            continue  # missing or damaged: named by the store's own checks, with the file
        differs = stored.origin_mismatch(probe)
        if differs is not None:
            raise ConfigError(f"{differs} ({path})")


@dataclasses.dataclass(frozen=True)
class SelfAugmentationConfig:
    self_augmentation: bool = option(
        True,
        "Replace with tokens sampled from the model's own MLM head in the previous epoch "
        "(SAS); --no-self-augmentation keeps the cold start in every epoch (the paper's "
        "Unig-MLM-RTD ablation).",
        flag="--self-augmentation",
    )
    sampling_temperature: float = option(
        1.0,
        "Temperature T of the MLM softmax the replacements are sampled from.",
        flag="--sampling-temperature",
    )
    replacement_store: str | None = option(
        None,
        "Directory of the sharded replacement store (default: replacement_store under --save).",
        flag="--replacement-store",
    )
    replacement_store_shards: int = option(
        64,
        "Shards per generation (fixed for the run; shard k is written by data-parallel rank "
        "k mod dp).",
        flag="--replacement-store-shards",
    )
    drop_replacement_hits: bool = option(
        False,
        "From epoch 2 on, drop from S every position whose stored sample equals the original "
        "token (a hit): it is read unreplaced, has no MLM label and stays out of S in later "
        "epochs, so S shrinks (the reference release). Off: hits stay in S with RTD label 0 "
        "(the paper).",
        flag="--drop-replacement-hits",
    )

    def __post_init__(self) -> None:
        cls = type(self)
        require(
            self.self_augmentation or not self.drop_replacement_hits,
            cls,
            "drop_replacement_hits",
            "drops stored samples equal to the original; without self-augmentation there is "
            "no store (drop --no-self-augmentation or --drop-replacement-hits)",
        )
        require(
            0 < self.sampling_temperature < math.inf,
            cls,
            "sampling_temperature",
            f"must be finite and > 0, got {self.sampling_temperature}",
        )
        require(
            isinstance(self.replacement_store_shards, int) and self.replacement_store_shards >= 1,
            cls,
            "replacement_store_shards",
            f"must be an integer >= 1, got {self.replacement_store_shards!r}",
        )

    def store_dir(self, save: str | None) -> str | None:
        if self.replacement_store is not None:
            return self.replacement_store
        return None if save is None else os.path.join(save, "replacement_store")


class StoreSource:
    """The collator's replacements: the cold start in epoch 0, generation t-1 of the store
    in epoch t. Picklable (DataLoader workers reopen the store lazily)."""

    def __init__(self, cold: ReplacementSource, root: str) -> None:
        self.cold, self.root = cold, root
        self._readers: dict[int, GenerationReader] = {}

    def replacements(
        self, instance: int, epoch: int, positions: np.ndarray, global_index: int | None = None
    ) -> np.ndarray:
        if not self.reads_store(epoch):
            return self.cold.replacements(instance, epoch, positions, global_index)
        reader = self._readers.get(epoch - 1)
        if reader is None:
            # Verified once by the callback before the epoch's loader was created.
            reader = self._readers[epoch - 1] = GenerationReader(self.root, epoch - 1, verify=False)
        row = reader.read(np.asarray([instance]))[0]
        return row[: positions.shape[0]].astype(np.int64)

    def reads_store(self, epoch: int) -> bool:
        return epoch >= 1

    def detects(self, epoch: int) -> bool:
        return self.reads_store(epoch) or self.cold.detects(epoch)

    def __getstate__(self) -> dict[str, Any]:
        return {"cold": self.cold, "root": self.root, "_readers": {}}


class SelfAugmentation(Callback):
    name = "self_augmentation"

    def __init__(
        self,
        config: SelfAugmentationConfig,
        *,
        root: str,
        layout: StoreLayout,
        seed: int,
        special_ids: np.ndarray,
        vocab_size: int,
    ) -> None:
        self.config, self.root, self.layout = config, root, layout
        self.seed = seed + SAMPLING_SEED_OFFSET
        self.special_ids = torch.as_tensor(special_ids, dtype=torch.long)
        self.vocab_size = vocab_size
        self.writer: GenerationWriter | None = None
        self.epoch = 0
        self.write_seconds = 0.0
        self.steps = 0
        # The last micro-batch's rows on their way to the host, written at the next one.
        self._pending: HostRows | None = None
        # A failed row write (a full disk, a quota, EIO): no more rows are written, and every
        # rank stops at the next save or epoch end, where the ranks agree (_flush_agreed).
        self._write_error: str | None = None

    # -- ownership and layout -----------------------------------------------------------

    def _owned_shards(self, parallel) -> list[int]:
        if parallel.tp_rank != 0:
            return []  # tp ranks hold the same rows; one of them writes
        return list(range(parallel.dp_rank, self.layout.num_shards, parallel.dp_size))

    def _verify(self, parallel, generation: int) -> None:
        """Epoch t reads generation t-1: refuse a missing, truncated or corrupt one before any
        batch is built, on every rank, naming the file (rank 0 reads it once)."""

        def verify() -> None:
            reader = GenerationReader(self.root, generation, verify=True)
            reader.close()
            path = manifest_path(self.root, generation)
            if reader.layout.sizes() != self.layout.sizes():  # another data set or rate
                raise ReplacementStoreError(
                    f"{path}: generation {generation} was written for "
                    f"{reader.layout.describe()}, this run has {self.layout.describe()}"
                )
            check_origin(path, reader.layout, self.layout)

        _agreed(parallel, parallel.rank == 0, verify, ConfigError, self.root)

    def _commit(self, trainer, epoch: int) -> None:
        hook_point("store_commit", epoch)
        try:
            commit_generation(self.root, epoch, self.layout)
        except ReplacementStoreError as e:
            raise ReplacementStoreError(f"{e}; {_rewrite_hint(trainer, epoch)}") from None
        if trainer.exiting is not None:
            # Within the grace time of an exit: the next epoch end (maybe the next run's)
            # deletes what no checkpoint needs.
            logger.info("%s: old generations are left to the next epoch end", self.root)
            return
        # Epoch t+1 reads generation t; the checkpoints in --save need theirs.
        try:
            needed = generations_needed(trainer.checkpoint.save, self.layout.num_instances)
        except (CheckpointUnreadable, CheckpointTooNew) as e:
            logger.warning("%s; every generation of %s is kept until it can be read", e, self.root)
            return
        delete_generations(self.root, keep={epoch} | needed)

    # -- hooks --------------------------------------------------------------------------

    def on_train_start(self, trainer, state) -> None:
        os.makedirs(self.root, exist_ok=True)

    def on_epoch_start(self, trainer, state, epoch: int) -> None:
        self.epoch = epoch
        if epoch >= 1:
            self._verify(trainer.parallel, epoch - 1)
        self.writer = None
        owned = self._owned_shards(trainer.parallel)

        def open_writer() -> None:
            self.writer = GenerationWriter(self.root, epoch, self.layout, owned)

        # A resume reopens the generation being written: a shard cut short, another run's
        # layout, a full disk while the shards are created stop every rank, not its owner.
        _agreed(trainer.parallel, bool(owned), open_writer, ConfigError, self.root)

    @torch.no_grad()
    def after_micro_batch(self, trainer, state, batch: dict, outputs: dict) -> None:
        # Counted on the device, summed and read by the loop with the model's outputs.
        kept = (batch["replaced_positions"] >= 0) & ~batch["dropped_slots"]
        outputs[KEPT_KEY] = kept.sum()
        outputs[FROM_STORE_KEY] = batch["from_store"].sum()
        start = time.perf_counter()
        # The previous micro-batch's rows first: their copy to the host was queued a whole
        # micro-batch ago, so waiting for it costs nothing, where reading this micro-batch's
        # rows now would wait for its backward to finish (the GPU then idles until the CPU
        # has queued the next forward).
        self._write_pending()
        tokens = self._sample(trainer.parallel, batch, outputs)  # [b, W]
        instances = batch["instance_ids"].to(tokens.device)
        group = trainer.parallel.get_data_parallel_group()
        if trainer.parallel.dp_size > 1:
            # Every dp rank's rows, so that each keeps those of the shards it owns.
            tokens = torch.cat(comm.all_gather(tokens, group))
            instances = torch.cat(comm.all_gather(instances, group))
        if self.writer is not None:
            self._pending = HostRows(instances, tokens)
        self.write_seconds += time.perf_counter() - start
        self.steps += 1

    def _write_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None and self.writer is not None and self._write_error is None:
            ids, rows = pending.numpy()
            mine = np.isin(self.layout.shard_of(ids), self.writer.owned_shards)
            try:
                self.writer.write(ids[mine], rows[mine])
            except OSError as e:
                # Copy-on-write or compressed storage: the pre-fill reserved nothing.
                self._write_error = f"{e.filename or self.writer.directory}: {e.strerror or e}"

    def _flush_agreed(self, parallel, close: bool = False) -> None:
        """Collective: the rows written so far made durable on every rank; a write or
        fsync that failed on any rank stops every rank with its line (RunError), before the
        checkpoint that would need the rows is written: the last good one stays latest."""

        def flush() -> None:
            if self._write_error is not None:
                raise ReplacementStoreError(
                    f"writing rows failed: {self._write_error} (the last checkpoint is kept: "
                    "none is saved without its rows)"
                )
            if self.writer is not None:
                self.writer.flush()
                if close:
                    self.writer.close()

        self._write_pending()
        try:
            _agreed(parallel, True, flush, RunError, self.root)
        finally:
            if close:
                self.writer = None

    def _sample(self, parallel, batch: dict, outputs: dict) -> torch.Tensor:
        """One token per slot of S [b, W] (0 in unused slots): drawn from the MLM logits at
        the slot's position, or the original token at a dropped slot (so it stays a hit).

        Fixed shapes throughout, so nothing is read back from the device: every slot gets a
        draw (an unused or dropped one from logits row 0, then overwritten). A slot's draw
        depends on its own key only (instance, position, epoch), so the extra rows change
        nothing."""
        logits = outputs["mlm_logits"]  # [N, V_padded/tp], rows at S in flat b*s order
        flat = outputs["mlm_positions"]  # [N] indices into b*s
        device = logits.device
        slots = batch["replaced_positions"].to(device)  # [b, W] in draw order, -1 = unused
        used = slots >= 0
        dropped = batch["dropped_slots"].to(device) & used  # [b, W]
        drawn_slots = used & ~dropped
        originals = batch["input_ids"].to(device).gather(1, slots.clamp(min=0))  # [b, W]
        # A dropped slot was read unreplaced: its input is the original token.
        tokens = torch.where(dropped, originals, torch.zeros_like(slots))
        if logits.shape[0] == 0:  # no slot of S in this micro-batch
            return tokens
        # Copied once: a copy from pageable host memory per micro-batch would be a sync.
        if self.special_ids.device != device:
            self.special_ids = self.special_ids.to(device)
        b, s = batch["input_ids"].shape
        row_of = torch.zeros(b * s, dtype=torch.long, device=device)
        row_of[flat] = torch.arange(flat.shape[0], device=device)
        index = torch.arange(b, device=device)[:, None] * s + slots.clamp(min=0)
        rows = row_of[index]  # [b, W] logits row of every slot (0 where none)
        keys = sample_row_keys(
            batch["instance_ids"].to(device)[:, None].expand_as(slots), slots, self.epoch
        )
        drawn = vocab_parallel_sample(
            logits.index_select(0, rows.reshape(-1)),
            parallel.tp_group,
            vocab_size=self.vocab_size,
            row_keys=keys.reshape(-1),
            seed=self.seed,
            temperature=self.config.sampling_temperature,
            exclude_ids=self.special_ids,
        ).view_as(slots)
        return torch.where(drawn_slots, drawn, tokens)

    def on_save(self, trainer, state) -> None:
        self._flush_agreed(trainer.parallel)

    def on_epoch_end(self, trainer, state, epoch: int) -> None:
        self._flush_agreed(trainer.parallel, close=True)  # every owner flushed
        # A row that changed on disk since it was written (or was never written) stops every
        # rank with one line naming it.
        _agreed(
            trainer.parallel,
            trainer.parallel.rank == 0,
            lambda: self._commit(trainer, epoch),
            RunError,
            self.root,
        )

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        out = {"store_write_ms": 1000.0 * self.write_seconds / max(self.steps, 1)}
        self.write_seconds, self.steps = 0.0, 0
        if KEPT_KEY in sums:
            # Measured over every data-parallel rank: the share of the kept slots of S whose
            # token was read from the store.
            kept = sums[KEPT_KEY]
            out["self_augmented"] = sums[FROM_STORE_KEY] / kept if kept else 0.0
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"generation_being_written": self.epoch, "root": self.root}


def _rewrite_hint(trainer, epoch: int) -> str:
    """The way on from a generation that cannot be committed: a row written before the
    last checkpoint is not written again by resuming from it, but every row is by resuming
    from a checkpoint saved before the epoch that writes the generation began."""
    save = trainer.checkpoint.save
    start = epoch * trainer.parts.samples_per_epoch // trainer.global_batch_size
    earlier = [i for i in complete_iterations(save) if i <= start] if save else []
    if earlier:
        return (
            f"resume from a checkpoint saved before epoch {epoch + 1} began, which writes "
            f"the generation anew: --load {save} --ckpt-step {earlier[-1]}"
        )
    where = f"in --save {save} " if save else ""
    again = " with --override-existing-checkpoints" if save else ""
    return (
        f"no checkpoint {where}predates epoch {epoch + 1} (iteration {start}), which would "
        f"write the generation anew: start the run again{again}"
    )


def _agreed(parallel, runs: bool, work, error: type[Exception], root: str) -> None:
    """``work()`` on the ranks where ``runs``; the first store error (or OSError) any rank
    meets is raised on every rank as ``error``, one line naming the file. The ranks wait
    for the work (a full scan of the store, on rank 0 alone for a commit) on the file
    group's barrier, whose timeout is not the collectives'; the gather then agrees."""
    problem = None
    if runs:
        try:
            work()
        except ReplacementStoreError as e:
            problem = str(e)
        except OSError as e:
            problem = f"{e.filename or root}: {e.strerror or e}"
    problems = [problem]
    if dist.is_initialized():
        parallel.file_barrier()
        problems = comm.all_gather_object(problem)
    first = next((p for p in problems if p is not None), None)
    if first is not None:
        raise error(f"--replacement-store: {first}")


def generations_needed(save_dir: str | None, samples_per_epoch: int) -> set[int]:
    """Store generations the checkpoints in ``save_dir`` need to resume: one taken after c
    samples, in epoch e = c // N, reads generation e-1 and, inside the epoch, keeps the
    rows of generation e written before it (the replay rewrites only those after it)."""
    needed: set[int] = set()
    if save_dir is None:
        return needed
    for iteration in complete_iterations(save_dir):
        try:
            meta = read_metadata(os.path.join(save_dir, checkpoint_tag(iteration)))
        except CheckpointInvalid:
            continue  # proven corrupt, so it needs nothing (unreadable or newer: raised)
        epoch, into = divmod(int(meta.get("consumed_samples", 0)), samples_per_epoch)
        needed.update(g for g in (epoch - 1, epoch if into else -1) if g >= 0)
    return needed


class HostRows:
    """(instance ids [n], token rows [n, W]) copied to the host without waiting: into pinned
    buffers, with an event on the current stream, when they are on a GPU. ``numpy()`` waits
    for that copy only."""

    def __init__(self, instances: torch.Tensor, tokens: torch.Tensor) -> None:
        pin = tokens.is_cuda  # pinned memory needs CUDA; on CPU this is a plain copy
        self.ids = torch.empty(instances.shape, dtype=instances.dtype, pin_memory=pin)
        self.rows = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=pin)
        self.ids.copy_(instances, non_blocking=True)
        self.rows.copy_(tokens, non_blocking=True)
        self.event = None
        if pin:
            self.event = torch.cuda.Event()
            self.event.record()

    def numpy(self) -> tuple[np.ndarray, np.ndarray]:
        if self.event is not None:
            self.event.synchronize()
        return self.ids.numpy(), self.rows.numpy()
