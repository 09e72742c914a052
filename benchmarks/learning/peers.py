"""Independent references that bench_learning trains beside our models, on the same
batches: transformers' BERT (MLM with [MASK]), transformers' ELECTRA (generator +
discriminator) and SAS's objective on transformers' ELECTRA encoder. The encoders, heads and
attention are transformers'; the losses, the RTD labels, the lambda schedule and the
self-augmentation store are written here from the SAS paper and the reference release's
description (../shared/README.md), sharing no code with megatron_taco/models or recipes/.

Every model's ``forward(batch)`` returns what our models return, so that one evaluation
(training/loop.py's MetricAccumulator and training/observability/monitor.py's figures) measures all:
"loss", "mlm_acc", for RTD models "rtd_acc_replaced"/"rtd_acc_original", and in eval mode the
learning monitor's inputs (last-layer vectors and the MLM targets' counts).

Batches: BERT and ELECTRA read the MLM rows (the first half) of a TACO collator batch, SAS
the SAS collator's batch, so every model sees the same token ids, masked positions and
replacements.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.learning.setting import Size
from megatron_taco.models.common.monitoring import monitoring_outputs

IGNORE = -100


def _accuracy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if target.numel() == 0:
        return logits.new_zeros(())
    return (logits.argmax(-1) == target).float().mean().detach()


def _rtd_metrics(logits, labels) -> dict[str, torch.Tensor]:
    """labels [b, s]: 1 replaced, 0 original, IGNORE elsewhere; accuracy per class."""
    with torch.no_grad():
        said = logits > 0
        out = {}
        for name, cls in (("rtd_acc_replaced", 1), ("rtd_acc_original", 0)):
            sel = labels == cls
            out[name] = (said == bool(cls))[sel].float().sum() / sel.sum().clamp(min=1)
        return out


def mlm_rows(batch: dict) -> dict:
    """The MLM half of a TACO collator batch: [MASK]ed input, true positions, labels."""
    rows = batch["input_ids"].shape[0] // 2
    return {k: batch[k][:rows] for k in ("input_ids", "attention_mask", "mlm_labels")}


def no_token_types(model: nn.Module) -> None:
    # SAS and TACO have no segment embeddings: zero and freeze transformers' (type 0 is
    # added to every token, which would otherwise be a free learned bias).
    emb = model.embeddings.token_type_embeddings
    nn.init.zeros_(emb.weight)
    emb.weight.requires_grad_(False)


class BertMlm(nn.Module):
    """transformers' BertForMaskedLM on the [MASK]ed rows (BERT's objective): the MLM half
    of a TACO collator batch, or with ``all_rows`` every row of a SAS collator batch under
    BERT's masking (the parity comparison). ``scaled_output_init``: the attention-output and
    FFN-output projections drawn as Megatron-LM draws them, normal(0.02 / sqrt(2 layers))
    (our SAS's default), instead of transformers' normal(0.02) (an ablation arm)."""

    def __init__(
        self, vocab: int, size: Size, *, all_rows: bool = False, scaled_output_init: bool = False
    ) -> None:
        super().__init__()
        from transformers import BertConfig, BertForMaskedLM

        self.bert = BertForMaskedLM(BertConfig(**size.kwargs(vocab)))
        no_token_types(self.bert.bert)
        if scaled_output_init:
            std = self.bert.config.initializer_range / math.sqrt(2.0 * size.layers)
            with torch.no_grad():
                for layer in self.bert.bert.encoder.layer:
                    for dense in (layer.attention.output.dense, layer.output.dense):
                        dense.weight.normal_(0.0, std)
        self.vocab, self.all_rows = vocab, all_rows

    def forward(self, batch: dict) -> dict:
        b = batch if self.all_rows else mlm_rows(batch)
        mask = b["attention_mask"].long()
        out = self.bert.bert(input_ids=b["input_ids"], attention_mask=mask)
        hidden = out.last_hidden_state
        labels = b["mlm_labels"]
        at = labels != IGNORE
        logits = self.bert.cls(hidden[at])
        loss = F.cross_entropy(logits, labels[at])
        result = {"loss": loss, "mlm_loss": loss.detach(), "mlm_acc": _accuracy(logits, labels[at])}
        if not self.training:
            result.update(monitoring_outputs(hidden, mask, mlm=(labels, self.vocab)))
        return result


class Electra(nn.Module):
    """transformers' ELECTRA: a generator (MLM on the [MASK]ed rows, embeddings tied with
    the discriminator's) whose samples replace the masked tokens, and a discriminator
    (RTD over every real token); loss = MLM + 50 RTD (Clark et al. 2020)."""

    def __init__(self, vocab: int, size: Size, embedding: int = 128, rtd_weight: float = 50.0):
        super().__init__()
        from transformers import ElectraConfig, ElectraForMaskedLM, ElectraForPreTraining

        self.disc = ElectraForPreTraining(
            ElectraConfig(**size.kwargs(vocab, embedding_size=embedding))
        )
        gen_size = Size(size.layers, size.hidden // 4, max(size.heads // 4, 1), size.ffn // 4)
        self.gen = ElectraForMaskedLM(
            ElectraConfig(**gen_size.kwargs(vocab, embedding_size=embedding))
        )
        self.gen.electra.embeddings = self.disc.electra.embeddings  # ELECTRA ties them
        self.gen.generator_lm_head.weight = self.disc.electra.embeddings.word_embeddings.weight
        no_token_types(self.disc.electra)
        self.vocab, self.rtd_weight = vocab, rtd_weight
        self.sampler = torch.Generator().manual_seed(0)

    def forward(self, batch: dict) -> dict:
        b = mlm_rows(batch)
        ids, mask, labels = b["input_ids"], b["attention_mask"].long(), b["mlm_labels"]
        at = labels != IGNORE
        hidden = self.gen.electra(input_ids=ids, attention_mask=mask).last_hidden_state
        logits = self.gen.generator_lm_head(self.gen.generator_predictions(hidden[at]))
        mlm = F.cross_entropy(logits, labels[at])
        with torch.no_grad():
            probs = torch.softmax(logits.float(), -1)
            sampled = torch.multinomial(probs, 1, generator=self.sampler).squeeze(1)
        original = torch.where(at, labels, ids)
        corrupted = original.clone()
        corrupted[at] = sampled
        rtd_labels = (corrupted != original).long().masked_fill(mask == 0, IGNORE)
        d_hidden = self.disc.electra(input_ids=corrupted, attention_mask=mask).last_hidden_state
        rtd_logits = self.disc.discriminator_predictions(d_hidden)
        valid = rtd_labels != IGNORE
        rtd = F.binary_cross_entropy_with_logits(rtd_logits[valid], rtd_labels[valid].float())
        result = {
            "loss": mlm + self.rtd_weight * rtd,
            "mlm_loss": mlm.detach(),
            "rtd_loss": rtd.detach(),
            "mlm_acc": _accuracy(logits, labels[at]),  # the generator's
            **_rtd_metrics(rtd_logits, rtd_labels),
        }
        if not self.training:  # the discriminator is the encoder ELECTRA keeps
            result.update(monitoring_outputs(d_hidden, mask, mlm=(labels, self.vocab)))
        return result


class SasObjective(nn.Module):
    """SAS's objective on transformers' ELECTRA encoder (SAS's architecture: BERT layers,
    ELECTRA's heads). Input: the SAS collator's batch (replacements at S, never [MASK]).
    MLM: cross entropy of the original token at S only, from dense -> GELU -> LayerNorm ->
    decoder tied to the word embeddings (with bias). RTD: dense -> GELU -> dense(1) at every
    real token, BCE averaged over them, label 1 where the input differs from the original
    (a replacement equal to the original is 0). loss = MLM + lambda RTD.

    The attribute names are transformers' ElectraForPreTraining / ElectraForMaskedLM names,
    so models/sas/hf.py's export of a SAS state dict loads here unchanged."""

    def __init__(self, vocab: int, size: Size, embedding: int | None = None) -> None:
        super().__init__()
        from transformers import ElectraConfig, ElectraModel
        from transformers.models.electra.modeling_electra import (
            ElectraDiscriminatorPredictions,
            ElectraGeneratorPredictions,
        )

        config = ElectraConfig(**size.kwargs(vocab, embedding_size=embedding or size.hidden))
        self.config = config
        self.electra = ElectraModel(config)
        no_token_types(self.electra)
        self.discriminator_predictions = ElectraDiscriminatorPredictions(config)
        self.generator_predictions = ElectraGeneratorPredictions(config)
        self.generator_lm_head = nn.Linear(config.embedding_size, vocab)
        self.generator_lm_head.weight = self.electra.embeddings.word_embeddings.weight
        self.vocab = vocab
        self.rtd_weight = 50.0

    def forward(self, batch: dict) -> dict:
        ids, mask = batch["input_ids"], batch["attention_mask"].long()
        labels = batch["mlm_labels"]  # the original token at S
        at = labels != IGNORE
        original = torch.where(at, labels, ids)
        rtd_labels = (ids != original).long().masked_fill(mask == 0, IGNORE)
        hidden = self.electra(input_ids=ids, attention_mask=mask).last_hidden_state
        logits = self.generator_lm_head(self.generator_predictions(hidden[at]))
        mlm = F.cross_entropy(logits, labels[at])
        rtd_logits = self.discriminator_predictions(hidden)
        valid = rtd_labels != IGNORE
        rtd = F.binary_cross_entropy_with_logits(
            rtd_logits[valid], rtd_labels[valid].to(hidden.dtype)
        )
        result = {
            "loss": mlm + self.rtd_weight * rtd,
            "mlm_loss": mlm.detach(),
            "rtd_loss": rtd.detach(),
            "mlm_acc": _accuracy(logits, labels[at]),
            **_rtd_metrics(rtd_logits, rtd_labels),
            "sas_logits": logits.detach(),  # for the self-augmentation draw, rows in S order
        }
        if not self.training:
            result.update(monitoring_outputs(hidden, mask, mlm=(labels, self.vocab)))
        return result


class SasMlm(nn.Module):
    """Our SAS encoder and MLM head (megatron_taco.models.sas.model.SasForPretraining, built as
    the driver builds it for these sizes) under BERT's objective: lambda 0, the batch a SAS
    collator's under BERT's masking at S (no RTD labels). The parity comparison's side of
    ours, beside BertMlm(all_rows=True) on the same batches. ``output_layer_init``: our
    --output-layer-init ('megatron', the default, or 'electra' = transformers' 0.02)."""

    def __init__(self, vocab: int, size: Size, output_layer_init: str = "megatron") -> None:
        super().__init__()
        from megatron_taco.models.sas.config import SasConfig
        from megatron_taco.models.sas.model import SasForPretraining
        from megatron_taco.parallel.state import single_process_state

        config = SasConfig(
            num_layers=size.layers,
            hidden_size=size.hidden,
            ffn_hidden_size=size.ffn,
            num_attention_heads=size.heads,
            embedding_size=size.hidden,
            max_position_embeddings=size.max_positions,
            vocab_size=vocab,
            output_layer_init=output_layer_init,
        )
        self.sas = SasForPretraining(config, single_process_state())
        self.sas.set_rtd_weight(0.0)

    def forward(self, batch: dict) -> dict:
        out = self.sas(batch)
        # Our model's self-augmentation outputs and its (empty) RTD figures are not BERT's.
        skip = ("mlm_logits", "mlm_positions", "rtd_weight")
        return {k: v for k, v in out.items() if k not in skip and not k.startswith("rtd_")}


def rtd_weight(epoch: int, whole_epochs: int, first: float = 50.0, final: float = 200.0) -> float:
    """The reference release's lambda: 50 + 150 * epoch / (epochs - 1), held after the last
    whole epoch; constant for a run of one epoch or less."""
    if whole_epochs <= 1:
        return first
    return first + (final - first) * min(epoch, whole_epochs - 1) / (whole_epochs - 1)


class SampledStore:
    """Self-augmentation kept in memory, as the reference release keeps it (one row per
    instance): after each step the model's own MLM softmax at S is sampled once per
    position (T = 1, torch.multinomial) and kept for that instance's next epoch; epoch 1
    reads the cold start. A replacement source for the SAS collator."""

    def __init__(self, cold, seq_length: int, seed: int) -> None:
        self.cold = cold
        self.rows: dict[int, np.ndarray] = {}
        self.seq_length = seq_length
        self.generator = torch.Generator().manual_seed(seed)

    def replacements(self, instance, epoch, positions, global_index=None):
        if epoch == 0:
            return self.cold.replacements(instance, epoch, positions, global_index)
        return self.rows[int(instance)][positions]

    def reads_store(self, epoch: int) -> bool:
        return epoch > 0

    def detects(self, epoch: int) -> bool:
        return epoch > 0 or self.cold.detects(epoch)

    def add(self, batch: dict, logits: torch.Tensor) -> None:
        """Sample at S (rows of ``logits`` follow S in row-major position order)."""
        with torch.no_grad():
            probs = torch.softmax(logits.float(), -1)
            drawn = torch.multinomial(probs, 1, generator=self.generator).squeeze(1).numpy()
        at = (batch["mlm_labels"] != IGNORE).numpy()
        rows, cols = np.nonzero(at)
        for k, (r, c) in enumerate(zip(rows, cols)):
            inst = int(batch["instance_ids"][r])
            row = self.rows.setdefault(inst, np.full(self.seq_length, -1, dtype=np.int64))
            row[c] = drawn[k]


def whole_epochs(samples: int, instances: int) -> int:
    return math.floor(samples / instances)
