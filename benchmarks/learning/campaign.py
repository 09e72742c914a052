"""bench_sas_downstream --runs: a campaign of bench_sas_variants runs (variants x learning
rates x pretraining seeds, each run ending at the same training FLOPs with --equal-flops)
judged downstream, model selection kept apart from the reported figures:

1. each variant's learning rate is picked on the validation documents of --split: the
   frozen mean-pooled probe (original vs shuffled words) of its first seed's run at each
   learning rate of the grid, averaged over the probe sizes and shuffles;
2. every seed of the chosen learning rate is then evaluated on the test documents: zero-shot
   word order by the RTD head (and the MLM head), the frozen probe on 32 / 64 / 128
   labelled sentences, and with --finetune the SAS paper's Table 6 fine-tuning on the
   word-order task (train and dev rows from the validation documents' sentences, test rows
   from the test documents'; (lr, epoch) chosen on dev, the figure on test), with a [CLS]
   and a mean-pooled linear head;
3. each figure is the mean ± std over the pretraining seeds, beside random twins, and each
   of our variants is compared with its peer (SAS's with ELECTRA, TACO with BERT: PEER_OF)
   by a paired t-test over the seeds (seed k of both read the same documents in the same
   order).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re

import numpy as np
import torch

from benchmarks.learning.downstream import (
    finetune_run,
    finetune_task,
    peer_encoder,
    peer_net,
    select_and_test,
)
from benchmarks.learning.setting import Setting
from benchmarks.learning.variants import PEER_OF, PEERS, VARIANTS, train_flops_per_iteration
from megatron_taco.errors import ConfigError
from megatron_taco.evaluation.encoders import OurEncoder, twins
from megatron_taco.evaluation.word_order import (
    clip_to_fit,
    fitting,
    held_out_sentences,
    word_order,
)

# bench_sas_variants' run folders: VARIANT[_lrLR]_sSEED
RUN_FOLDER = re.compile(r"^(?P<variant>[a-z0-9_]+?)(?:_lr(?P<lr>[0-9.e+-]+))?_s(?P<seed>\d+)$")
EVALUATIONS = ("zero_shot_rtd", "zero_shot_mlm", "probe_32", "probe_64", "probe_128",
               "finetune_cls", "finetune_mean")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Run:
    variant: str
    lr: float | None
    seed: int
    folder: str

    @property
    def model(self) -> str:
        return VARIANTS[self.variant][0]

    @property
    def kind(self) -> str:
        """OurEncoder's kind of our models."""
        return "TACO" if self.model == "taco" else "SAS"


def discover(root: str, variants: list[str] | None = None) -> list[Run]:
    """The runs of ``root`` that ended (ours: a checkpoint; a peer: its weights at the
    last evaluation), of the named variants or all."""
    runs = []
    for folder in sorted(glob.glob(os.path.join(root, "*_s*"))):
        match = RUN_FOLDER.match(os.path.basename(folder))
        if match is None or match["variant"] not in VARIANTS:
            continue
        if variants and match["variant"] not in variants:
            continue
        lr = None if match["lr"] is None else float(match["lr"])
        run = Run(match["variant"], lr, int(match["seed"]), folder)
        if run.model in PEERS:
            ended = glob.glob(os.path.join(folder, "peer_iter_*.pt"))
        else:
            ended = os.path.isdir(os.path.join(folder, "checkpoints"))
        if ended:
            runs.append(run)
    return runs


def load(run: Run, s: Setting, vocab: int):
    """(encoder, iteration, training FLOPs) of the run's last checkpoint."""
    if run.model in PEERS:
        path = sorted(glob.glob(os.path.join(run.folder, "peer_iter_*.pt")))[-1]
        it = int(re.search(r"peer_iter_(\d+)\.pt$", path).group(1))
        try:
            net = peer_net(run.model, vocab, s, torch.load(path, weights_only=True))
        except RuntimeError as e:  # load_state_dict's size mismatch
            raise ConfigError(
                f"--runs: {path} is not a {run.model} of --layers {s.layers} --hidden "
                f"{s.hidden} and vocabulary {vocab} (the campaign's sizes): {str(e)[:200]}"
            ) from e
        enc = peer_encoder(net)
    else:
        info, model, _ = twins(os.path.join(run.folder, "checkpoints"), None, 0)
        enc, it = OurEncoder(model.eval(), run.kind), info.iteration
    return enc, it, it * train_flops_per_iteration(run.model, s, vocab)


def random_twins(model: str, runs: list[Run], s: Setting, vocab: int, count: int) -> list:
    if model in PEERS:
        return [peer_encoder(peer_net(model, vocab, s, None, seed=1000 + k)) for k in range(count)]
    first = next(r for r in runs if r.model == model)
    _, _, randoms = twins(os.path.join(first.folder, "checkpoints"), None, count)
    return [OurEncoder(m, first.kind) for m in randoms]


@dataclasses.dataclass
class Part:
    """One side of the held-out documents: its sentences (for fine-tuning), their rows
    that fit, and the shuffles of each seed."""

    sentences: list[str]
    originals: list
    shuffles: list


def part(prefix: str, tok, split: str, name: str, limit: int, seeds: int, seq: int) -> Part:
    """Sentences cut to the words that fit ``seq``: at 32 positions only 74 of 600 Wikipedia
    validation sentences fit whole, and a choice on 74 flipped on a 0.2-point difference."""
    sentences = clip_to_fit(tok, held_out_sentences(prefix, tok, split, parts=(name,)), seq)
    if len(sentences) > limit:
        rng = np.random.default_rng(0)
        sentences = [sentences[i] for i in sorted(rng.choice(len(sentences), limit, False))]
    originals, shuffles = fitting(tok, sentences, seeds, seq)
    return Part(sentences, originals, shuffles)


def frozen(encoders: list, p: Part, tok) -> dict[str, float]:
    """Zero-shot word order and the probes, each the mean over the shuffles (and twins)."""
    zs, probes = word_order(encoders, p.originals, p.shuffles, tok)
    out = {f"zero_shot_{head}": float(np.mean(v)) for head, v in zs.items()}
    out.update({f"probe_{n}": float(np.mean(v)) for n, v in probes.items()})
    return out


def dev_score(scores: dict[str, float]) -> float:
    """The learning-rate choice's criterion: the probes' mean."""
    probes = [v for k, v in scores.items() if k.startswith("probe_")]
    if not probes:
        raise ConfigError("--sentences: too few validation sentences for a probe of 32 (64 "
                          "needed) to choose the learning rate on")  # fmt: skip
    return float(np.mean(probes))


# The learning-rate choice reads at most this many validation-document sentences, with this
# many shuffles: the same choice in bench_sas_variants --select-lr and here.
SELECTION_SENTENCES, SELECTION_SHUFFLES = 600, 3


def selection_part(prefix: str, tok, split: str, seq: int) -> Part:
    return part(prefix, tok, split, "valid", SELECTION_SENTENCES, SELECTION_SHUFFLES, seq)


def choose_lr(runs: list[Run], dev: Part, s: Setting, tok) -> tuple[float | None, dict]:
    """(the chosen lr, {lr: dev score}) of one variant's runs: the best frozen probe on the
    validation documents among its first seed's runs (the smaller lr of a tie); no choice
    to make with one lr."""
    lrs = sorted({r.lr for r in runs}, key=lambda v: -1 if v is None else v)
    if len(lrs) == 1:
        return lrs[0], {}
    first = min(r.seed for r in runs)
    by_lr = {}
    for lr in lrs:
        run = next((r for r in runs if r.lr == lr and r.seed == first), None)
        if run is not None:
            by_lr[lr] = dev_score(frozen([load(run, s, tok.vocab_size)[0]], dev, tok))
            print(f"  {run.variant} lr {lr:g}: dev probe {100 * by_lr[lr]:.1f}", flush=True)
    return max(by_lr, key=by_lr.get), by_lr


def finetuned(encoders: list, task, args) -> dict[str, dict]:
    """Table 6's grid per pooling: every fine-tuning lr x seed (seed k fine-tunes encoder k
    mod len(encoders)), (lr, epoch) chosen on dev, the figure on test."""
    out = {}
    for pooling in args.ft_poolings:
        runs = {lr: [finetune_run(encoders[k % len(encoders)], task, lr, k, args.ft_epochs,
                                  args.ft_batch, pooling) for k in range(args.ft_seeds)]
                for lr in args.ft_lrs}  # fmt: skip
        out[f"finetune_{pooling}"] = select_and_test(runs)
    return out


def evaluate(encoders: list, test: Part, task, tok, args) -> dict:
    scores = frozen(encoders, test, tok)
    if task is not None:
        for key, ft in finetuned(encoders, task, args).items():
            scores[key] = ft["test"]
            scores[f"{key}_selection"] = ft
    return scores


def campaign(args, s: Setting, tok) -> dict:
    """Every variant of args.runs: the learning-rate choice on dev, its seeds on test,
    random twins, paired tests against each one's peer. The rows, for the JSON."""
    runs = discover(args.runs, args.variants)
    if not runs:
        raise ConfigError(f"--runs {args.runs}: no bench_sas_variants run that ended")
    vocab = tok.vocab_size
    common = dict(prefix=args.data_path, tok=tok, split=args.split, seeds=args.seeds,
                  seq=args.seq_length, limit=args.sentences)  # fmt: skip
    dev = selection_part(args.data_path, tok, args.split, args.seq_length)
    test = part(name="test", **common)
    print(f"held-out sentences cut to fit {args.seq_length} positions: {len(dev.originals)} "
          f"(validation documents: the lr choice), {len(test.originals)} (test documents: the "
          f"figures); {args.seeds} shuffles")  # fmt: skip
    task = None
    if args.finetune:  # train and dev rows from the validation documents
        valid = part(name="valid", **common)
        task = finetune_task(tok, valid.sentences, args.seq_length, args.ft_corruption,
                             test_sentences=test.sentences)  # fmt: skip
        print(f"word-order ({args.ft_corruption}) fine-tuning: {len(task[0][0])} train, "
              f"{len(task[1][0])} dev, {len(task[2][0])} test rows; lrs {args.ft_lrs} x "
              f"{args.ft_seeds} seeds, {args.ft_epochs} epochs of {args.ft_batch}, heads "
              f"{', '.join(args.ft_poolings)}")  # fmt: skip
    rows = []
    for variant in dict.fromkeys(r.variant for r in runs):
        mine = [r for r in runs if r.variant == variant]
        chosen, by_lr = choose_lr(mine, dev, s, tok)
        per_seed = {}
        for run in sorted((r for r in mine if r.lr == chosen), key=lambda r: r.seed):
            enc, it, flops = load(run, s, vocab)
            per_seed[run.seed] = {"iteration": it, "train_flops": flops,
                                  **evaluate([enc], test, task, tok, args)}  # fmt: skip
            print(f"  {variant} lr {chosen} seed {run.seed}: {_brief(per_seed[run.seed])}",
                  flush=True)  # fmt: skip
        rows.append({"variant": variant, "model": mine[0].model, "lr": chosen,
                     "dev_probe_by_lr": {str(k): v for k, v in by_lr.items()},
                     "by_seed": per_seed})  # fmt: skip
    for model in dict.fromkeys(r.model for r in runs):
        twins = random_twins(model, runs, s, vocab, args.random_twins)
        scores = evaluate(twins, test, task, tok, args)
        print(f"  {model} random x{len(twins)}: {_brief(scores)}", flush=True)
        rows.append({"variant": f"{model} random x{len(twins)}", "model": model, "lr": None,
                     "dev_probe_by_lr": {}, "by_seed": {0: scores}})  # fmt: skip
    paired(rows)
    print_campaign(rows)
    return {"rows": rows}


def _brief(scores: dict) -> str:
    return ", ".join(f"{k} {100 * scores[k]:.1f}" for k in EVALUATIONS if k in scores)


def paired(rows: list[dict]) -> None:
    """Each of our pretrained variants against its peer's (PEER_OF; the first such row):
    per evaluation, the mean of the per-seed differences and a paired t-test over the seeds
    both have ("vs_peer", and "peer": the peer's variant)."""
    from scipy import stats

    pretrained = [r for r in rows if "random" not in r["variant"]]  # lr None: no grid
    for row in pretrained:
        ref = next((r for r in pretrained if r["model"] == PEER_OF.get(row["model"])), None)
        if ref is None:
            continue
        seeds = sorted(set(row["by_seed"]) & set(ref["by_seed"]))
        row["peer"], row["vs_peer"] = ref["variant"], {}
        for key in EVALUATIONS:
            a = [row["by_seed"][k].get(key) for k in seeds]
            b = [ref["by_seed"][k].get(key) for k in seeds]
            if len(seeds) < 2 or None in a or None in b:
                continue
            diff = [x - y for x, y in zip(a, b)]
            p = float(stats.ttest_rel(a, b).pvalue) if len(seeds) > 2 and np.std(diff) else None
            row["vs_peer"][key] = {"diff": float(np.mean(diff)), "p": p, "seeds": seeds}


def _ms(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{100 * values[0]:.1f}"
    return f"{100 * np.mean(values):.1f} ± {100 * np.std(values, ddof=1):.1f}"


def print_campaign(rows: list[dict]) -> None:
    keys = [k for k in EVALUATIONS if any(k in v for r in rows for v in r["by_seed"].values())]
    w = max(len(r["variant"]) for r in rows)
    print(f"\n{'variant':<{w}} {'lr':>7} {'seeds':>5} {'iter':>5} {'TFLOPs':>6} "
          + " ".join(f"{k:>14}" for k in keys))  # fmt: skip
    for r in rows:
        seeds = list(r["by_seed"].values())
        it = "-" if "iteration" not in seeds[0] else str(seeds[0]["iteration"])
        tf = "-" if "train_flops" not in seeds[0] else f"{seeds[0]['train_flops'] / 1e12:.1f}"
        lr = "-" if r["lr"] is None else f"{r['lr']:g}"
        cells = [_ms([v[k] for v in seeds if k in v]) for k in keys]
        print(f"{r['variant']:<{w}} {lr:>7} {len(seeds):>5} {it:>5} {tf:>6} "
              + " ".join(f"{c:>14}" for c in cells))  # fmt: skip
    print("\n(test documents; % mean ± std over pretraining seeds, each seed's figure the "
          "mean over the shuffles / fine-tuning seeds; random rows: over the twins)")  # fmt: skip
    for r in rows:
        if r.get("vs_peer"):
            cells = [
                f"{k} {100 * v['diff']:+.1f} (p {_p(v['p'])})" for k, v in r["vs_peer"].items()
            ]
            print(f"  {r['variant']} - {r['peer']}, paired over seeds: {'; '.join(cells)}")


def _p(p: float | None) -> str:
    return "-" if p is None else f"{p:.3f}"
