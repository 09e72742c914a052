"""Frozen encoders read one way, whoever built them: our TACO and SAS checkpoints
(recipes/registry.load_pretraining_model) and transformers' BERT, ELECTRA and DeBERTa-v2
models. An evaluation asks an encoder for its last-layer vectors, its MLM head's negative
log-likelihood at labelled positions and, for RTD models, its RTD logits; ``heads`` says
which heads it has, the pretraining head first.

Inputs everywhere: ``ids`` int64 [b, s], ``mask`` bool [b, s] (True = real token, [CLS]
first), ``pos`` int64 [b, s] (0..n-1 on real tokens; only TACO reads it). transformers is
the hf extra: imported only by the functions that load or build its models."""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F

from megatron_taco.errors import ConfigError


class FrozenEncoder:
    """The interface. ``kind``: "TACO", "SAS" or transformers' model type (or the caller's
    name); ``max_positions``: the longest row it takes; ``we_width``: TACO's h_WE width
    (its vectors are [h_WE; h_PE]), None for one-stream encoders."""

    kind: str
    heads: tuple[str, ...] = ()
    max_positions: int | None = None
    we_width: int | None = None

    def hidden(self, ids, mask, pos) -> torch.Tensor:
        """[b, s, H] last-layer vectors."""
        raise NotImplementedError

    def mlm_nll(self, ids, pos, mask, labels) -> torch.Tensor:
        """float64 [n]: every labelled token's (labels != -100) negative log-likelihood."""
        raise NotImplementedError(f"{self.kind} has no MLM head here")

    def rtd_logits(self, ids, mask) -> torch.Tensor:
        """[b, s] "replaced" logits."""
        raise NotImplementedError(f"{self.kind} has no RTD head here")


class OurEncoder(FrozenEncoder):
    """A TACO or SAS pretraining model (TacoForPretraining / SasForPretraining)."""

    def __init__(self, model, kind: str) -> None:
        self.model, self.kind = model, kind
        self.heads = ("mlm",) if kind == "TACO" else ("rtd", "mlm")  # the pretraining head first
        self.max_positions = model.config.max_position_embeddings
        self.we_width = model.config.we_hidden_size if kind == "TACO" else None

    def hidden(self, ids, mask, pos) -> torch.Tensor:
        """[b, s, H] (TACO: [h_WE; h_PE])."""
        if self.kind == "TACO":
            we, pe = self.model.taco(ids, pos, mask)
            return torch.cat([we, pe], -1)
        return self.model.sas(ids, mask)

    def mlm_nll(self, ids, pos, mask, labels) -> torch.Tensor:
        at = labels != -100
        m = self.model
        if self.kind == "TACO":
            word = m.taco.embeddings.word_embeddings.weight
            nll, _ = m.heads.mlm(self.hidden(ids, mask, pos)[at], labels[at], word)
            return nll.double()
        word = m.sas.embeddings.word_embeddings.weight
        logits = m.heads.mlm_logits(m.sas(ids, mask)[at], word)[:, : m.config.vocab_size]
        return F.cross_entropy(logits.double(), labels[at], reduction="none")

    def rtd_logits(self, ids, mask) -> torch.Tensor:
        return self.model.heads.rtd_logits(self.model.sas(ids, mask))


class TransformersEncoder(FrozenEncoder):
    """A transformers model: ``model``'s base model gives the vectors; ``mlm``, a
    *ForMaskedLM (``model`` itself, or ELECTRA's generator), the MLM head; ``rtd``, an
    ElectraForPreTraining (ELECTRA's discriminator, usually ``model``), the RTD head.
    Positions are transformers' own (0..n-1; right padding leaves real tokens' alone)."""

    def __init__(self, model, *, mlm=None, rtd=None, kind: str | None = None) -> None:
        self.model, self.mlm, self.rtd = model.eval(), mlm, rtd
        for head in (mlm, rtd):
            if head is not None:
                head.eval()
        config = model.config
        self.kind = kind or config.model_type
        self.heads = (("rtd",) if rtd is not None else ()) + (("mlm",) if mlm is not None else ())
        self.max_positions = getattr(config, "max_position_embeddings", None)
        self.we_width = config.we_hidden_size if config.model_type == "taco" else None

    def hidden(self, ids, mask, pos) -> torch.Tensor:
        return self.model.base_model(input_ids=ids, attention_mask=mask.long()).last_hidden_state

    def mlm_nll(self, ids, pos, mask, labels) -> torch.Tensor:
        if self.mlm is None:
            return super().mlm_nll(ids, pos, mask, labels)
        at = labels != -100
        logits = self.mlm(input_ids=ids, attention_mask=mask.long()).logits[at]  # [n, V]
        return F.cross_entropy(logits.double(), labels[at], reduction="none")

    def rtd_logits(self, ids, mask) -> torch.Tensor:
        if self.rtd is None:
            return super().rtd_logits(ids, mask)
        return self.rtd(input_ids=ids, attention_mask=mask.long()).logits


def load_transformers_encoder(path: str, trust_remote_code: bool = False) -> TransformersEncoder:
    """A transformers model directory's base model (read from disk only; no heads). Modeling
    code shipped in the directory (config.json's auto_map) runs only when trusted."""
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        meta = json.load(f)
    if meta.get("auto_map") and not trust_remote_code:
        raise ConfigError(
            f"--load: {path} ships its own modeling code (config.json auto_map); "
            "pass --trust-remote-code to run it"
        )
    from transformers import AutoModel

    return TransformersEncoder(
        AutoModel.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    )


def twins(path: str, tokenizer_model: str | None, count: int, ckpt_step: int | None = None):
    """(info, the pretrained model of a checkpoint, ``count`` random initialisations of it
    seeded 1000, 1001, ...), all in eval mode."""
    from megatron_taco.parallel.state import single_process_state
    from megatron_taco.recipes.registry import load_pretraining_model, model_builder

    model, info = load_pretraining_model(path, tokenizer_model, ckpt_step)
    _, build = model_builder(info, tokenizer_model)
    randoms = []
    for seed in range(count):
        torch.manual_seed(1000 + seed)
        randoms.append(build(single_process_state(), model.config.vocab_size).eval())
    return info, model, randoms


def token_rows(tokenizer, sentences: list[str]) -> list[list[int]]:
    """[CLS] pieces [SEP] of each sentence (our Tokenizer)."""
    return [[tokenizer.cls_id, *tokenizer.encode(s), tokenizer.sep_id] for s in sentences]


def pad_rows(rows: list[list[int]], pad: int):
    """(ids, mask, pos) [len(rows), longest row] of right-padded rows."""
    rows_t = [torch.tensor(r, dtype=torch.long) for r in rows]
    ids = torch.nn.utils.rnn.pad_sequence(rows_t, batch_first=True, padding_value=pad)
    mask = ids != pad
    mask[:, 0] = True
    return ids, mask, torch.arange(ids.shape[1]).expand_as(ids) * mask
