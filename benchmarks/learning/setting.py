"""One learning comparison's models and run settings: which of ours run through the real
driver (and with which flags), which peers run in benchmarks/learning/peer_loop.py, and the
``Setting`` they all share (data, size, optimizer, schedule, evaluation), turned into our
driver's flags or the peers' TrainingConfig."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from benchmarks.harness.paths import REPO

# Ours, trained by the real driver: model -> (script, its flags).
OURS = {
    "taco": ("pretrain_taco.py", ["--model-size", "small"]),
    "sas": ("pretrain_sas.py", ["--model-size", "small", "--num-layers", "4"]),
    "sas_c": ("pretrain_sas.py", ["--model-size", "small", "--num-layers", "4",
                                  "--rtd-weight-final", "50"]),
    "sas_da": ("pretrain_sas.py", ["--model-size", "small", "--num-layers", "4",
                                   "--disentangled-attention"]),
}  # fmt: skip
# The parity comparison (BERT's objective on identical batches and masks, one loop): our
# SAS encoder and MLM head vs transformers' BertForMaskedLM, and each with the other's
# output-layer init (the ablation arms of the one architectural difference in init).
PARITY = ("sas_mlm", "bert_mlm", "sas_mlm_init02", "bert_mlm_scaled")
PEERS = ("bert", "electra", "sas_ref", *PARITY)
MODELS = ("taco", "bert", "electra", "sas", "sas_ref", "sas_c", "sas_da", *PARITY)
LABELS = {
    "taco": "TACO (ours)",
    "bert": "BERT (transformers, [MASK] MLM)",
    "electra": "ELECTRA generator (transformers)",
    "sas": "SAS (ours)",
    "sas_ref": "SAS objective on transformers' ELECTRA encoder",
    "sas_c": "SAS^c (ours)",
    "sas_da": "SAS^DA (ours)",
    "sas_paper": "SAS, the paper's recipe (ours)",
    "sas_mlm": "our SAS encoder + MLM head, BERT's objective (parity)",
    "bert_mlm": "transformers' BertForMaskedLM, the same batches (parity)",
    "sas_mlm_init02": "sas_mlm with --output-layer-init electra (std 0.02)",
    "bert_mlm_scaled": "bert_mlm with Megatron's scaled output-layer init",
}
SAS_LIKE = ("sas", "sas_ref", "sas_c", "sas_da")


def sas_like(name: str) -> bool:
    # bench_learning's --with may add curves of other runs under their own names; "sas..."
    # names are SAS-like. The parity models train BERT's objective (no RTD): not SAS-like.
    return name not in PARITY and (name in SAS_LIKE or name.startswith("sas"))


def label(name: str) -> str:
    return LABELS.get(name, name)


@dataclasses.dataclass(frozen=True)
class Size:
    """A BERT-style encoder size shared by every model of a comparison."""

    layers: int = 4
    hidden: int = 256
    heads: int = 4
    ffn: int = 1024
    max_positions: int = 512

    def kwargs(self, vocab: int, **extra) -> dict:
        return dict(
            vocab_size=vocab,
            hidden_size=self.hidden,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            intermediate_size=self.ffn,
            max_position_embeddings=self.max_positions,
            hidden_act="gelu",
            hidden_dropout_prob=0.1,
            attention_probs_dropout_prob=0.1,
            layer_norm_eps=1e-12,
            **extra,
        )


@dataclasses.dataclass(frozen=True)
class Setting:
    prefix: str
    tokenizer: str
    cache: str
    seq_length: int
    batch: int
    iters: int
    lr: float
    warmup_fraction: float
    eval_interval: int
    eval_iters: int
    split: str
    seed: int
    cold_start: str = "unigram"  # SAS's first-epoch replacements (ours and the reference)
    layers: int = 4  # the encoders' depth and width (SAS and the peers; TACO-small's own)
    hidden: int = 256

    def size(self) -> Size:
        return Size(self.layers, self.hidden, max(self.hidden // 64, 1), 4 * self.hidden)

    def sas_size_flags(self) -> list[str]:
        size = self.size()
        return ["--num-layers", str(size.layers), "--hidden-size", str(size.hidden),
                "--ffn-hidden-size", str(size.ffn), "--num-attention-heads", str(size.heads),
                "--embedding-size", str(size.hidden)]  # fmt: skip

    def driver_flags(self) -> list[str]:
        return [
            "--data-path", self.prefix, "--tokenizer-model", self.tokenizer,
            "--data-cache-path", self.cache, "--split", self.split,
            "--seq-length", str(self.seq_length), "--seed", str(self.seed),
            "--micro-batch-size", str(self.batch), "--global-batch-size", str(self.batch),
            "--train-iters", str(self.iters), "--lr", str(self.lr), "--min-lr", "0",
            "--lr-warmup-fraction", str(self.warmup_fraction), "--lr-decay-style", "linear",
            "--weight-decay", "0.01", "--clip-grad", "1.0", "--adam-eps", "1e-6",
            "--eval-interval", str(self.eval_interval), "--eval-iters", str(self.eval_iters),
            "--log-interval", str(self.eval_interval), "--num-workers", "0",
            "--deepspeed-config", os.path.join(REPO, "ds_configs", "zero0_fp32.json"),
            "--no-progress-bar",
        ]  # fmt: skip

    def training_config(self):
        from megatron_taco.training.config import TrainingConfig

        return TrainingConfig(
            train_iters=self.iters, micro_batch_size=self.batch, global_batch_size=self.batch,
            lr=self.lr, min_lr=0.0, lr_warmup_fraction=self.warmup_fraction,
            lr_decay_style="linear", weight_decay=0.01, clip_grad=1.0, adam_eps=1e-6,
            eval_interval=self.eval_interval, eval_iters=self.eval_iters,
        )  # fmt: skip


def job_command(
    model: str,
    s: Setting,
    metrics: str,
    workdir: str,
    flags: dict[str, list[str]],
    resume: bool = False,
) -> list[str]:
    """``resume``: our driver loads its own --save (Megatron's requeue: the latest
    checkpoint there, or a fresh start rewriting its own store when it died before the
    first); the peers keep no checkpoints and start again."""
    if model in OURS:
        script, extra = OURS[model]
        # A checkpoint at every evaluation, for downstream evaluations at equal FLOPs or
        # training time (bench_sas_downstream).
        save = os.path.join(workdir, "checkpoints")
        cmd = [sys.executable, os.path.join(REPO, script), *extra, *s.driver_flags(),
               "--metrics-file", metrics, "--save", save,
               "--save-interval", str(s.eval_interval), *flags.get(script, [])]  # fmt: skip
        if resume:
            cmd += ["--load", save]
        if model.startswith("sas"):
            cmd += [*s.sas_size_flags(), "--replacement-store", os.path.join(workdir, "store"),
                    "--cold-start", s.cold_start]  # fmt: skip
        return cmd
    return [sys.executable, "-m", "benchmarks.learning.peer_loop", model,
            json.dumps(dataclasses.asdict(s)), metrics]  # fmt: skip
