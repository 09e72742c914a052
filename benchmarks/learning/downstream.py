"""What bench_sas_downstream measures on a pretrained encoder, ours or a peer's
(transformers' ELECTRA or BERT, as peer_loop trains them): a peer read as
megatron_taco/evaluation reads ours (ELECTRA: its discriminator's vectors and RTD logits,
its generator's MLM head; BERT: its vectors and MLM head), the word-order fine-tuning task, and the
SAS paper's fine-tuning protocol (its appendix Table 6) on it with a [CLS] or a
mean-pooled linear head.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.learning.setting import Setting
from benchmarks.learning.variants import PEERS
from megatron_taco.evaluation.encoders import (
    FrozenEncoder,
    TransformersEncoder,
    pad_rows,
    token_rows,
)
from megatron_taco.evaluation.word_order import train_dev_rows

POOLINGS = ("cls", "mean")


def peer_net(model: str, vocab: int, s: Setting, state: dict | None, seed: int = 0):
    """peer_loop's ``model`` ("electra" or "bert") as peer_loop.run_peer builds it, holding
    ``state`` (a peer_iter_*.pt) or, with None, a random initialisation seeded ``seed``."""
    from benchmarks.learning.peers import BertMlm, Electra

    if model not in PEERS:
        raise ValueError(f"{model!r} is not a peer ({', '.join(PEERS)})")
    torch.manual_seed(seed)
    size = s.size()
    if model == "electra":  # ELECTRA-small's factorised embedding: half the hidden width
        net = Electra(vocab, size, embedding=size.hidden // 2)
    else:
        net = BertMlm(vocab, size)
    if state is not None:
        net.load_state_dict(state)
    return net


def peer_encoder(net) -> FrozenEncoder:
    """A peer read as ours are. ELECTRA: the discriminator's vectors and RTD logits, the
    generator's MLM head; BERT: BertForMaskedLM's vectors and MLM head."""
    from benchmarks.learning.peers import Electra

    if isinstance(net, Electra):
        return TransformersEncoder(
            net.disc.eval(), mlm=net.gen.eval(), rtd=net.disc, kind="ELECTRA"
        )
    return TransformersEncoder(net.bert.eval(), mlm=net.bert, kind="BERT")


# ---------------------------------------------------------------------------------------
# The word-order task and fine-tuning


def _rows(tok, rows: list[tuple[str, str]], seq_length: int):
    """(ids, mask, labels) of the rows that fit ``seq_length`` pieces ([CLS] and [SEP]
    included); label 0 is the original."""
    encoded = token_rows(tok, [text for text, _ in rows])
    keep = [i for i, r in enumerate(encoded) if len(r) <= seq_length]
    ids, mask, _ = pad_rows([encoded[i] for i in keep] or [[tok.cls_id]], tok.pad_id)
    labels = torch.tensor([int(rows[i][1] != "original") for i in keep])
    return ids[: len(keep)], mask[: len(keep)], labels


def finetune_task(tok, sentences: list[str], seq_length: int, corruption: str = "swap",
                  seed: int = 0, test_sentences: list[str] | None = None):  # fmt: skip
    """((ids, mask, labels) of train, of dev[, of test]): the word-order task, each sentence
    in both forms (label 0 the original), a fifth of ``sentences`` dev (split by sentence);
    ``test_sentences`` (other documents) give the test part in both forms. Rows longer than
    ``seq_length`` pieces are left out."""
    rng = np.random.default_rng(seed)
    splits = train_dev_rows(sentences, corruption, rng, both_forms=True)
    parts = [_rows(tok, splits[name], seq_length) for name in ("train", "dev")]
    if test_sentences is not None:
        test = train_dev_rows(test_sentences, corruption, rng, both_forms=True)
        parts.append(_rows(tok, test["train"] + test["dev"], seq_length))
    return tuple(parts)


class PeerClassifier(nn.Module):
    """A transformers base model (ELECTRA's discriminator's ElectraModel, BERT's BertModel),
    copied, under the head our TaskModel puts on ours (dropout + one linear layer,
    normal(initializer_range), bias 0; the SAS paper's Table 6: "linear classifier on the
    encoder"), on [CLS] or the mean of the real tokens' vectors."""

    def __init__(self, base, pooling: str, dropout: float = 0.1) -> None:
        super().__init__()
        from benchmarks.learning.peers import no_token_types

        self.base = copy.deepcopy(base)
        no_token_types(self.base)  # as pretrained: no segments, none learned now
        self.pooling = pooling
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(base.config.hidden_size, 2)
        with torch.no_grad():
            self.head.weight.normal_(0.0, base.config.initializer_range)
            self.head.bias.zero_()

    def forward(self, ids, mask) -> torch.Tensor:
        hidden = self.base(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        return self.head(self.dropout(pool(hidden, mask, self.pooling)))


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """[b, s, H] -> [b, H]: the [CLS] vector, or the mean over the real tokens."""
    if pooling == "cls":
        return hidden[:, 0]
    m = mask[..., None].to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1)


def classifier(enc: FrozenEncoder, seed: int, pooling: str = "cls"):
    """(model, step): the encoder under a fresh 2-class linear head (its init seeded) on the
    ``pooling`` vector, and step(ids, mask, labels) -> (cross-entropy loss, logits [b, 2]).
    TACO, SAS: our fine-tuning model (models/finetune.TaskModel, the encoder taken by
    encoder_state_from_pretraining); ELECTRA, BERT: PeerClassifier, the same head."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    torch.manual_seed(seed)
    if enc.kind in ("ELECTRA", "BERT"):
        model = PeerClassifier(enc.model.base_model, pooling)

        def step(ids, mask, labels):
            logits = model(ids, mask)
            return F.cross_entropy(logits, labels), logits

        return model, step
    from megatron_taco.models.finetune import TaskModel, encoder_state_from_pretraining
    from megatron_taco.parallel.state import single_process_state

    pre, kind = enc.model, enc.kind
    model = TaskModel(kind, pre.config, single_process_state(), task_kind="classification",
                      num_labels=2, classifier_dropout=0.1)  # fmt: skip
    model.encoder.load_state_dict(encoder_state_from_pretraining(kind, pre.state_dict()))

    def step(ids, mask, labels):
        if pooling == "cls":  # TaskModel's own forward
            out = model({"input_ids": ids, "attention_mask": mask, "labels": labels})
            return out["loss"], out["logits"]
        pooled = pool(model.encode(ids, mask.bool()), mask, "mean")
        logits = model.head(model.dropout(pooled))
        return F.cross_entropy(logits, labels), logits

    return model, step


def finetune_run(enc: FrozenEncoder, task, lr: float, seed: int, epochs: int, batch: int,
                 pooling: str = "cls") -> dict:  # fmt: skip
    """One fine-tuning run, the SAS paper's Table 6 settings: AdamW (0.9, 0.999, eps 1e-6,
    no weight decay), warm-up 0.1 then linear decay to 0, dropout 0.1, gradient norm
    clipped at 1 (ELECTRA's optimiser). {"dev": accuracy after each epoch, "test": the same
    on the task's test part (if it has one), "loss": mean training loss of each epoch}."""
    from megatron_taco.training.optim import AnnealingLR

    (ids, mask, labels), *held = task
    model, step = classifier(enc, seed, pooling)
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0)
    total = (len(ids) // batch) * epochs
    sched = AnnealingLR(opt, max_lr=lr, min_lr=0.0, warmup_steps=round(0.1 * total),
                        decay_steps=total, decay_style="linear")  # fmt: skip
    rng = np.random.default_rng(seed)
    out = {"dev": [], "test": [], "loss": []}
    for _ in range(epochs):
        model.train()
        seen = []
        order = torch.from_numpy(rng.permutation(len(ids)))
        for k in range(len(ids) // batch):
            i = order[k * batch : (k + 1) * batch]
            width = int(mask[i].sum(1).max())  # the batch's longest row
            loss, _ = step(ids[i, :width], mask[i, :width], labels[i])
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            seen.append(loss.detach())
        out["loss"].append(float(torch.stack(seen).mean()))
        model.eval()
        with torch.no_grad():
            for name, (x, m, y) in zip(("dev", "test"), held):
                _, logits = step(x, m, y)
                out[name].append(float((logits.argmax(-1) == y).double().mean()))
    return out


def select_lr(scores: dict) -> float:
    """The SAS paper's choice: the learning rate whose mean over seeds is best (the first
    listed of a tie)."""
    return max(scores, key=lambda lr: np.mean(scores[lr]))


def finetune_grid(encoders: list, task, args) -> dict:
    """Every learning rate x seed (a random row's seed k fine-tunes twin k mod twins): each
    run's per-epoch dev accuracies, its best epoch's, and the chosen learning rate."""
    runs = {lr: [finetune_run(encoders[seed % len(encoders)], task, lr, seed, args.ft_epochs,
                              args.ft_batch) for seed in range(args.ft_seeds)]
            for lr in args.ft_lrs}  # fmt: skip
    best = {lr: [max(r["dev"]) for r in rs] for lr, rs in runs.items()}
    lr = select_lr(best)
    return {"epochs": {str(k): [r["dev"] for r in v] for k, v in runs.items()},
            "best_epoch": {str(k): v for k, v in best.items()}, "lr": lr, "dev_acc": best[lr],
            "last_epoch_acc": [r["dev"][-1] for r in runs[lr]],
            "last_train_loss": [r["loss"][-1] for r in runs[lr]]}  # fmt: skip


def select_and_test(runs: dict[float, list[dict]]) -> dict:
    """Model selection on dev, the figure on test: the (learning rate, epoch) whose dev
    accuracy, mean over the fine-tuning seeds, is best (the first of a tie: the smaller
    lr listed first, the earlier epoch), and the test accuracy there, mean over the seeds.
    ``runs``: lr -> finetune_run outputs, one per seed."""
    best = None
    for lr, rs in runs.items():
        dev = np.mean([r["dev"] for r in rs], axis=0)  # [epochs]
        epoch = int(np.argmax(dev))
        if best is None or dev[epoch] > best[2]:
            best = (lr, epoch, float(dev[epoch]))
    lr, epoch, dev = best
    test = [r["test"][epoch] for r in runs[lr]]
    return {"lr": lr, "epoch": epoch + 1, "dev": dev, "test": float(np.mean(test)),
            "test_by_seed": test,
            "train_loss": float(np.mean([r["loss"][epoch] for r in runs[lr]]))}  # fmt: skip
