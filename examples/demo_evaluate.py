"""What the demo's pretraining bought: each pretrained encoder beside randomly initialised
twins of the same architecture, on held-out text (the documents --split keeps out of
training), with evaluations a random encoder cannot win from a labelled set:

1. held-out MLM accuracy against the most frequent target's share, and the collapse figure
   (mean pairwise cosine of last-layer token vectors), as the training run's validation
   measures them (the same collators, the same metric code);
2. zero-shot word order: for each held-out sentence and a shuffle of its words, does the
   model's own pretraining head prefer the original? TACO: the pseudo-log-likelihood of the
   words under its MLM head (every 5th word [MASK]ed per pass, 5 passes); SAS: its RTD head
   (the mean log-probability that each word is original: a shuffled sentence should look
   more replaced), and beside it the pseudo-log-likelihood under its MLM head (the heads' two signals).
   No labels at all, so nothing to learn from: a random encoder is at 50% by construction,
   and so is a model that learned only which words are frequent (the shuffle keeps them);
3. a frozen-feature probe: logistic regression on mean-pooled last-layer vectors, trained on
   32, 64 and 128 labelled sentences (each original or shuffled), tested on the other half of
   the sentences in both forms.

Seeds: the shuffles, the probe's sample and the random twins' initialisations; every row
gives the mean and standard deviation over them.

    python examples/demo_evaluate.py --load demo_output/taco/checkpoints \\
        --load demo_output/sas/checkpoints --data-path demo_output/demo_text_sentence \\
        --split 90,5,5 --output demo_output/evaluation.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_word_order_task import held_out_sentences, shuffle_words

from megatron_taco.data.tokenizer import Tokenizer, load_tokenizer

MASK_EVERY = 5  # zero-shot pseudo-log-likelihood: every 5th word [MASK]ed per pass
PROBE_SIZES = (32, 64, 128)


# ---------------------------------------------------------------------------------------
# models


def twins(path: str, tokenizer_model: str | None, count: int, ckpt_step: int | None = None):
    """The pretrained model of a checkpoint, and ``count`` random initialisations of it."""
    from megatron_taco.parallel.state import single_process_state
    from megatron_taco.recipes.registry import load_pretraining_model, model_builder

    model, info = load_pretraining_model(path, tokenizer_model, ckpt_step)
    _, build = model_builder(info, tokenizer_model)
    randoms = []
    for seed in range(count):
        torch.manual_seed(1000 + seed)
        randoms.append(build(single_process_state(), model.config.vocab_size).eval())
    return info, model, randoms


# ---------------------------------------------------------------------------------------
# 1. held-out MLM accuracy and collapse, as the run's validation computes them


def held_out_metrics(model, info, tokenizer: Tokenizer, batches: int = 8) -> dict:
    """On the checkpoint's own validation documents (its --data-path and --split)."""
    from megatron_taco.data.bert_dataset import build_train_valid_test_datasets
    from megatron_taco.data.config import DataConfig
    from megatron_taco.errors import ConfigError
    from megatron_taco.parallel.state import single_process_state
    from megatron_taco.training.loop import evaluate_batches

    cfg = info.configs
    data = DataConfig(**{**cfg["data"], "data_path": tuple(cfg["data"]["data_path"]),
                         "tokenizer_model": tokenizer.model_path})  # fmt: skip
    micro = cfg["training"]["micro_batch_size"]
    n = batches * micro
    _, valid, _ = build_train_valid_test_datasets(data, tokenizer, (1, n, 0))
    if valid is None:
        raise ConfigError(
            f"--load: {info.iter_dir} was trained with --split {data.split}, which leaves no "
            "validation documents to measure its held-out MLM accuracy on"
        )
    collate = _collator(info, data, tokenizer, model.config)
    stream = (collate([valid[i] for i in range(k, k + micro)]) for k in range(0, n, micro))
    return evaluate_batches(model, stream, single_process_state(), batches)


def _collator(info, data, tokenizer, model_config):
    cfg = info.configs
    if info.model == "TACO":
        from megatron_taco.data.masking import TokenMaskingConfig
        from megatron_taco.data.position_masking import PositionMaskingConfig
        from megatron_taco.data.taco_collator import TacoMaskingCollator

        return TacoMaskingCollator.from_tokenizer(
            tokenizer,
            seq_length=data.seq_length,
            seed=data.seed,
            masking=TokenMaskingConfig(**cfg["masking"]),
            position_masking=PositionMaskingConfig(**cfg["position_masking"]),
            num_positions=model_config.max_position_embeddings,
        )
    from megatron_taco.data.sas_collator import (
        ReplacementConfig,
        SasCollator,
        cold_start_probs,
        make_cold_start,
    )

    replacement = ReplacementConfig(**cfg["replacement"])
    probs = cold_start_probs(replacement, data.prefixes, data.weights, tokenizer.is_special_mask())
    return SasCollator(pad_id=tokenizer.pad_id, seq_length=data.seq_length, seed=data.seed,
                       config=replacement,
                       source=make_cold_start(replacement, probs, data.seed,
                                              mask_id=tokenizer.mask_id))  # fmt: skip


# ---------------------------------------------------------------------------------------
# 2. zero-shot word order and 3. frozen features


def _encode(tokenizer: Tokenizer, sentences: list[str]) -> list[list[int]]:
    return [[tokenizer.cls_id, *tokenizer.encode(s), tokenizer.sep_id] for s in sentences]


def _pad(rows: list[list[int]], pad: int):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    mask = ids != pad
    mask[:, 0] = True
    return ids, mask, torch.arange(width).expand(len(rows), width) * mask


class Encoder:
    """What the evaluations read from one pretrained model (ours, or a peer's in
    benchmarks/bench_sas_downstream.py): its last-layer vectors, its MLM head's negative
    log-likelihood at labelled positions and, for RTD models, its RTD logits."""

    def __init__(self, model, kind: str) -> None:
        self.model, self.kind = model, kind
        self.heads = ("mlm",) if kind == "TACO" else ("rtd", "mlm")  # the pretraining head first

    def hidden(self, ids, mask, pos) -> torch.Tensor:
        """[b, s, H] (TACO: [h_WE; h_PE])."""
        if self.kind == "TACO":
            we, pe = self.model.taco(ids, pos, mask)
            return torch.cat([we, pe], -1)
        return self.model.sas(ids, mask)

    def mlm_nll(self, ids, pos, mask, labels) -> torch.Tensor:
        """float64 [n]: every labelled token's negative log-likelihood under the MLM head."""
        at = labels != -100
        m = self.model
        if self.kind == "TACO":
            word = m.taco.embeddings.word_embeddings.weight
            nll, _ = m.heads.mlm(self.hidden(ids, mask, pos)[at], labels[at], word)
            return nll.double()
        word = m.sas.embeddings.word_embeddings.weight
        logits = m.heads.mlm_logits(m.sas(ids, mask)[at], word)[:, : m.config.vocab_size]
        return torch.nn.functional.cross_entropy(logits.double(), labels[at], reduction="none")

    def rtd_logits(self, ids, mask) -> torch.Tensor:
        """[b, s] "replaced" logits."""
        return self.model.heads.rtd_logits(self.model.sas(ids, mask))


@torch.no_grad()
def encode_vectors(enc: Encoder, rows: list[list[int]], pad: int, batch: int = 64):
    """[len(rows), H] mean-pooled last-layer vectors."""
    out = []
    for k in range(0, len(rows), batch):
        ids, mask, pos = _pad(rows[k : k + batch], pad)
        hidden = enc.hidden(ids, mask, pos)
        m = mask[..., None].to(hidden.dtype)
        out.append((hidden * m).sum(1) / m.sum(1))
    return torch.cat(out).double().numpy()


@torch.no_grad()
def originality_scores(enc: Encoder, rows: list[list[int]], tok: Tokenizer, head: str = "mlm",
                       batch: int = 64):  # fmt: skip
    """Higher = the model finds the sentence more like real text. ``head`` "mlm": the
    pseudo-log-likelihood per word from the MLM head (every 5th word [MASK]ed per pass);
    "rtd": the RTD head's mean log-probability that a token is original, log sigmoid(-z).
    Not the mean logit z: a head sure that the pieces inside a word are original (z of -7)
    outweighs, in a mean of logits, the one misplaced word it flags (+5), and a long-trained
    SAS then scored shuffles as more original (23% "zero-shot", measured)."""
    scores = np.zeros(len(rows))
    if head == "mlm":
        passes = [(i, j) for i in range(len(rows)) for j in range(MASK_EVERY)]
        for k in range(0, len(passes), batch):
            chunk = passes[k : k + batch]
            ids, mask, pos = _pad([rows[i] for i, _ in chunk], tok.pad_id)
            labels = torch.full_like(ids, -100)
            for r, (i, j) in enumerate(chunk):
                at = torch.arange(1 + j, len(rows[i]) - 1, MASK_EVERY)
                labels[r, at] = ids[r, at]
                ids[r, at] = tok.mask_id
            nll = enc.mlm_nll(ids, pos, mask, labels)
            owner = torch.tensor([i for i, _ in chunk]).unsqueeze(1).expand_as(labels)
            np.add.at(scores, owner[labels != -100].numpy(), -nll.numpy())
        return scores / np.array([max(len(r) - 2, 1) for r in rows])
    for k in range(0, len(rows), batch):
        ids, mask, _ = _pad(rows[k : k + batch], tok.pad_id)
        logits = enc.rtd_logits(ids, mask).double()
        words = mask.clone()
        words[:, 0] = False
        words &= ids != tok.sep_id
        not_replaced = torch.nn.functional.logsigmoid(-logits)
        scores[k : k + batch] = ((not_replaced * words).sum(1) / words.sum(1).clamp(min=1)).numpy()
    return scores


def zero_shot(original_scores: np.ndarray, shuffled_scores: np.ndarray) -> float:
    """The share of sentences whose original order the model prefers (ties count half)."""
    a, b = original_scores, shuffled_scores
    return float(np.mean((a > b) + 0.5 * (a == b)))


def probe(features_orig, features_shuf, size: int, seed: int) -> float:
    """Train on ``size`` labelled sentences (each sentence in one form only), test on the
    other half of the sentences (both forms)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    rng = np.random.default_rng(seed)
    order = rng.permutation(len(features_orig))
    half = len(order) // 2
    train_idx, test_idx = order[:half][:size], order[half:]
    form = rng.integers(0, 2, len(train_idx))  # 1 = original
    x = np.where(form[:, None] == 1, features_orig[train_idx], features_shuf[train_idx])
    clf = make_pipeline(StandardScaler(), LogisticRegression(max_iter=3000, C=0.1))
    clf.fit(x, form)
    x_test = np.concatenate([features_orig[test_idx], features_shuf[test_idx]])
    y_test = np.concatenate([np.ones(len(test_idx)), np.zeros(len(test_idx))])
    return float(clf.score(x_test, y_test))


# ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    model: str
    init: str  # "pretrained" or "random (N)"
    mlm_acc: float
    baseline: float
    collapse: float
    zero_shot: list[float]  # the pretraining head's: TACO's MLM, SAS's RTD
    probe: dict[int, list[float]]
    zero_shot_mlm: list[float] | None = None  # SAS: its MLM head's pseudo-log-likelihood


def _ms(values: list[float]) -> str:
    return f"{100 * np.mean(values):5.1f} ± {100 * np.std(values):4.1f}"


def fitting(tok: Tokenizer, sentences: list[str], seeds: int, limit: int):
    """(original rows, one list of shuffled rows per seed) of the sentences whose pieces, with
    [CLS] and [SEP], fit ``limit`` positions in every form: a cut sentence and its cut shuffle
    would hold different words, which the comparisons must not see."""
    shuffled = [[shuffle_words(s, np.random.default_rng(seed)) for s in sentences]
                for seed in range(seeds)]  # fmt: skip
    forms = [_encode(tok, sentences), *(_encode(tok, f) for f in shuffled)]
    keep = [i for i in range(len(sentences)) if all(len(f[i]) <= limit for f in forms)]
    return [forms[0][i] for i in keep], [[f[i] for i in keep] for f in forms[1:]]


def evaluate_checkpoint(path: str, args, sentences: list[str]) -> list[Row]:
    from megatron_taco.errors import ConfigError
    from megatron_taco.recipes.registry import checkpoint_tokenizer

    info, pretrained, randoms = twins(path, args.tokenizer_model, args.random_twins)
    tok = load_tokenizer(*checkpoint_tokenizer(info, args.tokenizer_model))
    kind = info.model
    limit = pretrained.config.max_position_embeddings
    originals, shuffles = fitting(tok, sentences, args.seeds, limit)
    if len(originals) < len(sentences):
        print(f"{kind}: {len(sentences) - len(originals)} of {len(sentences)} sentences are "
              f"longer than its {limit} positions; left out")  # fmt: skip
    if not originals:
        raise ConfigError(f"--load: no held-out sentence fits the {limit} positions of {path}")
    skipped = [n for n in PROBE_SIZES if n > len(originals) // 2]
    if skipped:
        print(f"{kind}: probes on {', '.join(map(str, skipped))} labelled sentences need twice as "
              f"many held-out sentences ({len(originals)}); skipped")  # fmt: skip
    rows = []
    for name, models in (("pretrained", [pretrained]), (f"random x{len(randoms)}", randoms)):
        held = [held_out_metrics(m, info, tok) for m in models]
        zs, probes = word_order([Encoder(m, kind) for m in models], originals, shuffles, tok)
        first = next(iter(zs))
        rows.append(Row(kind, name, float(np.mean([h["mlm_acc"] for h in held])),
                        float(np.mean([h["mlm_baseline_acc"] for h in held])),
                        float(np.mean([h["collapse_cosine"] for h in held])), zs[first], probes,
                        zs.get("mlm") if first != "mlm" else None))  # fmt: skip
    return rows


def word_order(encoders: list[Encoder], originals, shuffles, tok: Tokenizer):
    """({head: zero-shot scores}, {probe size: accuracies}) over the encoders and the seeds'
    shuffles; probes that need more sentences than there are are left out."""
    heads = encoders[0].heads
    zs = {head: [] for head in heads}
    probes = {n: [] for n in PROBE_SIZES if n <= len(originals) // 2}
    for enc in encoders:
        f_orig = encode_vectors(enc, originals, tok.pad_id)
        s_orig = {head: originality_scores(enc, originals, tok, head) for head in heads}
        for seed, shuffled in enumerate(shuffles):
            for head in heads:
                zs[head].append(
                    zero_shot(s_orig[head], originality_scores(enc, shuffled, tok, head))
                )
            f_shuf = encode_vectors(enc, shuffled, tok.pad_id)
            for n in probes:
                probes[n].append(probe(f_orig, f_shuf, n, seed))
    return zs, probes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="demo_evaluate.py", description=__doc__.split("\n")[0])
    p.add_argument("--load", action="append", required=True, help="A pretraining checkpoint.")
    p.add_argument("--data-path", required=True, help="The dataset prefix (held-out documents).")
    p.add_argument("--split", default=None,
                   help="Whose validation and test documents are held out (default: the first "
                   "checkpoint's --split).")  # fmt: skip
    p.add_argument("--tokenizer-model", default=None)
    p.add_argument("--sentences", type=int, default=300, help="Held-out sentences used.")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--random-twins", type=int, default=2)
    p.add_argument("--output", default=None, help="Write the rows as JSON here.")
    args = p.parse_args(argv)
    for name in ("sentences", "seeds", "random_twins"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    from megatron_taco.checkpoint.errors import CheckpointError
    from megatron_taco.data.indexed_dataset import IndexedDatasetError
    from megatron_taco.errors import ConfigError

    try:
        return evaluate(args)
    except (ConfigError, CheckpointError, IndexedDatasetError) as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2


def evaluate(args) -> int:
    from megatron_taco.errors import ConfigError

    tok_file, split = _tokenizer_and_split_of(args.load[0], args.tokenizer_model)
    split = args.split or split
    if split is None:
        raise ConfigError(f"--split: {args.load[0]} records none; give the one it trained with")
    sentences = held_out_sentences(args.data_path, load_tokenizer(*tok_file), split)
    if not sentences:
        raise ConfigError(
            f"--data-path: {args.data_path} has no held-out sentence of 8-40 words in the "
            f"validation and test documents of --split {split}"
        )
    rng = np.random.default_rng(0)
    if len(sentences) > args.sentences:
        sentences = [
            sentences[i] for i in sorted(rng.choice(len(sentences), args.sentences, replace=False))
        ]
    print(
        f"{len(sentences)} held-out sentences; {args.seeds} seeds; {args.random_twins} random twins"
    )
    rows = [row for path in args.load for row in evaluate_checkpoint(path, args, sentences)]
    sizes = [n for n in PROBE_SIZES if any(n in r.probe for r in rows)]
    print(f"\n{'model':<6} {'init':<12} {'MLM acc':>8} {'baseline':>8} {'collapse':>8} "
          f"{'zero-shot order %':>18} {'(SAS: MLM head)':>16} "
          + " ".join(f"{f'probe n={n} %':>15}" for n in sizes))  # fmt: skip
    for r in rows:
        pll = _ms(r.zero_shot_mlm) if r.zero_shot_mlm else "-"
        print(f"{r.model:<6} {r.init:<12} {100 * r.mlm_acc:8.2f} {100 * r.baseline:8.2f} "
              f"{r.collapse:8.3f} {_ms(r.zero_shot):>18} {pll:>16} "
              + " ".join(f"{_ms(r.probe[n]) if n in r.probe else '-':>15}" for n in sizes))  # fmt: skip
    print("\n(MLM acc and baseline in %: the held-out accuracy of the pretraining head and the "
          "most frequent target's share; zero-shot: a random encoder is at 50 by construction)")  # fmt: skip
    if args.output:
        with open(args.output, "w") as f:
            json.dump([dataclasses.asdict(r) for r in rows], f, indent=1)
    return 0


def _tokenizer_and_split_of(path: str, tokenizer_model: str | None):
    from megatron_taco.checkpoint.plan import find_checkpoint
    from megatron_taco.recipes.registry import checkpoint_tokenizer

    info = find_checkpoint(path)
    split = (info.configs.get("data") or {}).get("split")
    return checkpoint_tokenizer(info, tokenizer_model), split


if __name__ == "__main__":
    raise SystemExit(main())
