"""Dev-set evaluation of a fine-tuning run after every epoch, and its results.json.

Every dev split is scored on all of its features (nothing dropped). The features are taken
in order of length, so that each micro-batch, padded to its longest feature, pads little:
data-parallel rank r runs the r-th, (r + dp)-th, ... feature of that order (the order
padded by repeating its last feature to a multiple of dp), in micro-batches under
torch.no_grad(); one all-gather over the data-parallel group brings every rank the model's
outputs of all features, which are put back in feature order, and each rank then scores
them with the task's own metric (tasks/: GLUE's, the official SQuAD scripts', RACE's).
Tensor-parallel ranks read the same features, so they compute identical outputs and are
not gathered over.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_taco import io
from megatron_taco.parallel import comm
from megatron_taco.tasks import write_squad_predictions
from megatron_taco.tasks.base import Collate, row_lengths
from megatron_taco.training.callbacks import Callback
from megatron_taco.training.engine import to_device

RESULTS_FILE = "results.json"
SUBMISSION_DIR = "submission"  # the benchmark server's files of the chosen epoch
# What TaskModel returns for the evaluation to score (models/finetune.py).
OUTPUT_KEYS = ("logits", "predictions", "start_logits", "end_logits")
# Outputs with one value per token [b, s_batch]: padded back to the features' length with
# the value the model gives padding (never an answer boundary).
TOKEN_OUTPUT_KEYS = ("start_logits", "end_logits")


def evaluation_order(dataset, dp: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """(the features this rank runs, in order; the features in the order of the gathered
    outputs), both int64. The features sorted by length (stably) are dealt to the ranks
    round-robin, so every rank's micro-batches hold similar lengths and the ranks similar
    work; the gathered [dp, per_rank] outputs, transposed, are in that sorted order."""
    n = len(dataset)
    lengths = row_lengths(dataset) if hasattr(dataset, "lengths") else np.zeros(n, np.int64)
    order = np.argsort(lengths, kind="stable")
    per_rank = math.ceil(n / dp)
    padded = np.concatenate([order, np.full(per_rank * dp - n, order[-1], dtype=np.int64)])
    return padded[rank::dp], padded[:n]


def predict(trainer, dataset, micro_batch_size: int, collate_fn) -> dict[str, np.ndarray]:
    """The model's outputs on every feature of ``dataset``, in feature order, on every rank."""
    parallel, engine = trainer.parallel, trainer.model_engine
    n, dp = len(dataset), parallel.dp_size
    mine, gathered_order = evaluation_order(dataset, dp, parallel.dp_rank)
    seq_length = getattr(dataset, "seq_length", None)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.Subset(dataset, mine.tolist()),
        batch_size=micro_batch_size,
        collate_fn=collate_fn,
        num_workers=0,
    )
    chunks: dict[str, list[torch.Tensor]] = {}
    engine.eval()
    try:
        with torch.no_grad():
            for batch in loader:
                batch = {k: v for k, v in batch.items() if not k.endswith("positions")}
                outputs = engine(to_device(batch, engine.device))
                for key in OUTPUT_KEYS:
                    if key in outputs:
                        value = outputs[key].float()
                        if key in TOKEN_OUTPUT_KEYS and value.shape[-1] != seq_length:
                            lowest = torch.finfo(value.dtype).min
                            value = torch.nn.functional.pad(
                                value, (0, seq_length - value.shape[-1]), value=lowest
                            )  # [b, s_batch] -> [b, seq_length]
                        chunks.setdefault(key, []).append(value)
    finally:
        engine.train()
    back = np.argsort(gathered_order)  # feature f is at position back[f] of the sorted order
    result = {}
    for key, parts in chunks.items():
        local = torch.cat(parts)  # [per_rank, ...]
        if dist.is_initialized() and dp > 1:
            gathered = comm.all_gather(local, parallel.get_data_parallel_group())
            # [dp, per_rank, ...] -> [per_rank, dp, ...]: round-robin back to sorted order
            local = torch.stack(gathered).transpose(0, 1).reshape(-1, *local.shape[1:])
        result[key] = local[:n].cpu().numpy()[back]
    return result


def flat_scores(scores: dict[str, dict[str, float]]) -> dict[str, float]:
    """{split: {metric: v}} -> {metric: v} for one split, {split/metric: v} for several."""
    if len(scores) == 1:
        return dict(next(iter(scores.values())))
    return {f"{split}/{k}": v for split, metrics in scores.items() for k, v in metrics.items()}


class DevEvaluation(Callback):
    """Scores every dev split at the end of each epoch, logs the scores (split name =
    the dev split's), keeps their history in the checkpoint, writes OUTPUT/results.json,
    and (``save_every_epoch``) saves a checkpoint so a restart resumes at this epoch. With
    test splits loaded (--predict-test), an epoch that becomes the chosen one also predicts
    them and writes the benchmark server's files to OUTPUT/submission/, so they are always
    the chosen epoch's (ELECTRA's write_test_outputs, for the epoch the run reports)."""

    name = "dev_evaluation"

    def __init__(
        self,
        task_data,
        *,
        output: str,
        selection: str,
        save_every_epoch: bool,
        micro_batch_size: int,
        summary: dict[str, Any],
        collate_fn=None,
    ) -> None:
        self.task = task_data
        self.output = output
        self.selection = selection
        self.save_every_epoch = save_every_epoch
        self.micro_batch_size = micro_batch_size
        self.summary = summary
        self.collate_fn = collate_fn or Collate()
        self.history: list[dict[str, Any]] = []
        self.submission: dict[str, Any] | None = None  # {"epoch", "files"} once written

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history, "submission": self.submission}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = list(state.get("history", []))
        self.submission = state.get("submission")

    def on_epoch_end(self, trainer, state, epoch: int) -> None:
        scores = {}
        for split, dataset in self.task.dev.items():
            outputs = predict(trainer, dataset, self.micro_batch_size, self.collate_fn)
            scores[split] = {k: float(v) for k, v in self.task.score(split, outputs).items()}
            if self.task.info.kind == "span" and trainer.parallel.rank == 0:
                self.write_predictions(split, epoch + 1, outputs)
            trainer.logger.log(split, state.iteration, {"epoch": epoch + 1, **scores[split]})
        self.history.append({"epoch": epoch + 1, "iteration": state.iteration, "scores": scores})
        if self.task.test and self.chosen() is self.history[-1]:
            self.write_submission(trainer, epoch + 1)
        if trainer.parallel.rank == 0:
            self.write_results(finished=epoch + 1 == trainer.num_epochs())
        if self.save_every_epoch:
            trainer.save(state)

    def write_predictions(self, split: str, epoch: int, outputs: dict[str, Any]) -> None:
        """SQuAD: the answers in the official evaluation scripts' input format
        (predictions.json, v2.0's null_odds.json, nbest_predictions.json)."""
        folder = os.path.join(self.output, "predictions", split, f"epoch{epoch}")
        write_squad_predictions(folder, self.task.predict(split, outputs))

    def write_submission(self, trainer, epoch: int) -> None:
        """The test splits' predictions in the server's files (every rank predicts: the
        outputs are gathered over the data-parallel group; rank 0 writes)."""
        files = []
        for split, dataset in self.task.test.items():
            outputs = predict(trainer, dataset, self.micro_batch_size, self.collate_fn)
            name, text = self.task.submission(split, outputs)
            if trainer.parallel.rank == 0:
                folder = os.path.join(self.output, SUBMISSION_DIR)
                os.makedirs(folder, exist_ok=True)
                io.atomic_write(os.path.join(folder, name), text)
            files.append(name)
        self.submission = {"epoch": epoch, "files": files}

    def chosen(self) -> dict[str, Any] | None:
        if not self.history:
            return None
        if self.selection == "last":
            return self.history[-1]
        info = self.task.info
        first = info.dev_splits[0]

        def key(record):
            value = record["scores"][first][info.main_metric]
            return value if math.isfinite(value) else -math.inf

        # The earliest epoch among equals: max() keeps the first maximum.
        return max(self.history, key=key)

    def write_results(self, *, finished: bool) -> None:
        chosen = self.chosen()
        info = self.task.info
        results = {
            **self.summary,
            "finished": finished,
            "main_metric": info.main_metric,
            "main_split": info.dev_splits[0],
            "selection": self.selection,
            "epochs": [
                {"epoch": r["epoch"], "iteration": r["iteration"], **flat_scores(r["scores"])}
                for r in self.history
            ],
            "chosen_epoch": chosen["epoch"] if chosen else None,
            "dev": flat_scores(chosen["scores"]) if chosen else {},
        }
        if self.submission is not None:
            results["submission"] = {"directory": SUBMISSION_DIR, **self.submission}
        write_json_atomic(os.path.join(self.output, RESULTS_FILE), results)


def write_json_atomic(path: str, data: Any) -> None:
    io.atomic_write(path, json.dumps(data, indent=2, allow_nan=True))
