"""Fine-tuning models: a pretrained encoder (TACO or SAS) under one task head.

The encoder is the pretraining model's own (``TacoModel``, ``SasModel``) on the same
tensor-parallel layers, so fine-tuning runs at any tensor-parallel size and ZeRO stage
pretraining does. Its output is replicated over tp; the head is a small replicated linear
layer on it (the SAS paper's "linear classifier on the encoder"; BERT's span head):

* classification: dropout + linear(H -> C) on the [CLS] token, cross entropy;
* regression (STS-B): dropout + linear(H -> 1) on [CLS], mean squared error;
* span (SQuAD): linear(H -> 2) at every token, no dropout before it -> start/end logits,
  padding excluded, the mean of the start and end cross entropies (BERT);
* multiple choice (RACE): every option is its own row; dropout + linear(H -> 1) on each
  row's [CLS], cross entropy over the options.

TACO's token representation is [h_WE; h_PE] (the paper feeds the complete representation
to task layers), with true positions 0..s-1 as in pretraining. Token-type embeddings do not
exist in either model (both were pretrained on single segments): sentence pairs are told
apart by the [SEP] between them, as in RoBERTa.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from megatron_taco.models.common.host import host_numbers
from megatron_taco.models.common.lm_head import replicated_linear
from megatron_taco.models.common.relative import bucket_range
from megatron_taco.parallel.cross_entropy import at_least_float32
from megatron_taco.parallel.state import ParallelState

TASK_KINDS = ("classification", "regression", "span", "multiple_choice")
ENCODER_KINDS = ("TACO", "SAS")
_LAYER = re.compile(r"^encoder\.layers\.(\d+)\.")


def build_encoder(kind: str, config, parallel: ParallelState, rng_tracker=None) -> nn.Module:
    if kind == "TACO":
        from megatron_taco.models.taco.model import TacoModel

        return TacoModel(config, parallel, rng_tracker)
    if kind == "SAS":
        from megatron_taco.models.sas.model import SasModel

        return SasModel(config, parallel, rng_tracker)
    raise ValueError(f"unknown encoder kind {kind!r}; expected one of {ENCODER_KINDS}")


# The pretraining model's attribute that holds its encoder: its state-dict prefix.
PRETRAINING_ENCODER_PREFIX = {"TACO": "taco.", "SAS": "sas."}


class TaskModel(nn.Module):
    """forward(batch) -> dict(loss, acc (classification, multiple choice; percent), and the outputs
    the evaluation scores: logits [b, C] | predictions [b] | start_logits, end_logits [b, s])."""

    def __init__(
        self,
        encoder_kind: str,
        config,
        parallel: ParallelState,
        rng_tracker=None,
        *,
        task_kind: str,
        num_labels: int,
        classifier_dropout: float | None = None,
    ) -> None:
        super().__init__()
        if task_kind not in TASK_KINDS:
            raise ValueError(f"unknown task kind {task_kind!r}; expected one of {TASK_KINDS}")
        if task_kind == "classification" and num_labels < 2:
            raise ValueError(f"classification needs >= 2 labels, got {num_labels}")
        self.encoder_kind, self.task_kind = encoder_kind, task_kind
        self.num_layers = config.num_layers
        self.encoder = build_encoder(encoder_kind, config, parallel, rng_tracker)
        p = config.hidden_dropout if classifier_dropout is None else classifier_dropout
        # Replicated activations: default-RNG dropout, the same mask on every tp rank.
        self.dropout = nn.Dropout(p)
        outputs = num_labels if task_kind == "classification" else 2 if task_kind == "span" else 1
        self.head = replicated_linear(config.hidden_size, outputs, config.init_method_std)

    def train_flops(self, rows: int, seq_length: int, forwards: int = 1) -> float:
        """Model FLOPs of a training step over ``rows`` encoder rows of ``seq_length`` (a
        multiple-choice sample is one row per choice) in ``forwards`` micro-batches: the
        encoder without its pretraining heads, and the task head (models/flops.py)."""
        from megatron_taco.models import flops

        config = self.encoder.config
        if self.encoder_kind == "TACO":
            encoder = flops.taco_forward_flops(
                config, seq_length, rows, labelled_fraction=0.0, forwards=forwards
            )
        else:
            shape = flops.sas_encoder_shape(config, seq_length)
            used = self.encoder.relative_rows_used(seq_length)
            encoder = flops.sas_forward_flops(
                shape, rows, 0.0, relative_rows=used, rtd=False, forwards=forwards
            )
        head = 2 * self.head.in_features * self.head.out_features
        head_rows = rows * seq_length if self.task_kind == "span" else rows
        return 3.0 * (encoder + head_rows * head)

    @staticmethod
    def host_layout(batch: dict[str, torch.Tensor]) -> dict[str, bool]:
        """What the forward needs on the host (models/common/host.py), from the CPU batch."""
        return {"has_padding": not bool(batch["attention_mask"].bool().all())}

    def encode(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        has_padding: bool | None = None,
    ) -> torch.Tensor:
        """[b, s] -> the last layer's token representations [b, s, H]. ``has_padding``:
        whether any token is padding, known on the host (host_layout); None reads it from
        the device (one sync)."""
        if self.encoder_kind == "TACO":
            b, s = input_ids.shape
            # True positions, as the pretraining collator gives real tokens (padding's are
            # never attended to).
            positions = torch.arange(s, device=input_ids.device).expand(b, s)
            # Positions 0..s-1 on every row: their bucket range is known from s alone.
            k = self.encoder.config.max_relative_distance
            layout = None if has_padding is None else (*bucket_range(s - 1, 0, k), has_padding)
            h_we, h_pe = self.encoder(input_ids, positions, attention_mask, layout)
            return torch.cat([h_we, h_pe], dim=-1)  # [b, s, d_WE + d_PE]
        return self.encoder(input_ids, attention_mask, has_padding)

    def parameter_depth(self, name: str) -> tuple[int, int]:
        """ELECTRA's depths for layer-wise LR decay: embeddings (and the relative tables
        they hold) 0, layer i (0-based) i + 1, the task head num_layers + 2."""
        deepest = self.num_layers + 2
        if not name.startswith("encoder."):
            return deepest, deepest
        match = _LAYER.match(name)
        return (int(match.group(1)) + 1 if match else 0), deepest

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ids, mask = batch["input_ids"], batch["attention_mask"].bool()
        has_padding = host_numbers(batch, self.host_layout)["has_padding"]
        kind = self.task_kind
        if kind == "multiple_choice":
            b, choices, s = ids.shape
            flat_ids, flat_mask = ids.reshape(b * choices, s), mask.reshape(b * choices, s)
            cls = self.encode(flat_ids, flat_mask, has_padding)[:, 0]
            logits = at_least_float32(self.head(self.dropout(cls))).view(b, choices)
            return self._classification(logits, batch.get("labels"))
        hidden = self.encode(ids, mask, has_padding)  # [b, s, H]
        if kind == "span":
            return self._span(hidden, mask, batch)
        out = at_least_float32(self.head(self.dropout(hidden[:, 0])))  # [b, C]
        if kind == "regression":
            predictions = out.squeeze(-1)
            result = {"predictions": predictions.detach()}
            if "labels" in batch:  # absent at inference
                result["loss"] = F.mse_loss(predictions, batch["labels"].to(predictions.dtype))
            return result
        return self._classification(out, batch.get("labels"))

    @staticmethod
    def _classification(logits: torch.Tensor, labels) -> dict[str, torch.Tensor]:
        if labels is None:  # inference
            return {"logits": logits.detach()}
        loss = F.cross_entropy(logits, labels)
        # In percent, as the benchmarks report their dev accuracies.
        acc = 100.0 * (logits.detach().argmax(-1) == labels).float().mean()
        return {"loss": loss, "acc": acc, "logits": logits.detach()}

    def _span(self, hidden, mask, batch) -> dict[str, torch.Tensor]:
        # BERT's span head: a plain linear layer, no dropout before it (run_squad's
        # create_model; transformers' BertForQuestionAnswering and our exported
        # TacoForQuestionAnswering alike).
        logits = at_least_float32(self.head(hidden))  # [b, s, 2]
        # Padding can never be an answer boundary.
        logits = logits.masked_fill(~mask.unsqueeze(-1), torch.finfo(logits.dtype).min)
        start, end = logits.unbind(-1)  # [b, s] each
        out = {"start_logits": start.detach(), "end_logits": end.detach()}
        if "start_positions" not in batch:
            return out
        sp, ep = batch["start_positions"], batch["end_positions"]
        loss = 0.5 * (F.cross_entropy(start, sp) + F.cross_entropy(end, ep))
        with torch.no_grad():
            exact = (start.argmax(-1) == sp) & (end.argmax(-1) == ep)
        return {"loss": loss, "span_acc": 100.0 * exact.float().mean(), **out}


def encoder_state_from_pretraining(
    kind: str, full_state: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The encoder's tensors of a pretraining model's full state dict, keyed as
    TaskModel.encoder's (the pretraining heads are dropped)."""
    prefix = PRETRAINING_ENCODER_PREFIX[kind]
    return {k[len(prefix) :]: v for k, v in full_state.items() if k.startswith(prefix)}
