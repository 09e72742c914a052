"""The SAS paper's claim downstream: SAS's encoder against transformers' ELECTRA's
discriminator at equal training FLOPs (ELECTRA's flops_computation.py convention) and at
equal training wall time, on evaluations a random encoder cannot win, each model beside its
random-init twins: zero-shot word order by the RTD head (a shuffled sentence should look
more "replaced") and by the MLM head's pseudo-log-likelihood (ELECTRA: its generator's), and
a frozen-feature probe (logistic regression on mean-pooled last-layer vectors) on 32, 64 and
128 labelled sentences. The evaluations are megatron_taco/evaluation's (the demo's), on the
held-out documents of --split.

--finetune replaces them with what the SAS paper judges by (its GLUE Table 6 protocol):
every encoder fine-tuned end to end under a classification head on the held-out word-order
task of megatron_taco/evaluation/word_order.py (original vs two adjacent words swapped; each
sentence in both forms, 80/20 train/dev by sentence), for each learning rate of --ft-lrs and
--ft-seeds seeds, one recipe for all: AdamW (0.9, 0.999, eps 1e-6, no weight decay), warmup
0.1 then linear decay to 0, gradient norm clipped at 1 (ELECTRA's optimiser), dropout 0.1,
--ft-epochs epochs of --ft-batch; a run scores its best epoch's dev accuracy, and the
learning rate whose mean over seeds is best is reported, mean and std over its seeds. SAS
runs as our fine-tuning builds it (models/finetune.TaskModel, the encoder's weights taken by
encoder_state_from_pretraining), ELECTRA as transformers' ElectraModel holding the
discriminator's weights under the same linear head (benchmarks/learning/downstream.py); one
training loop runs both (our driver, a DeepSpeed engine per run, is too slow for the grid on
a CPU). Only ELECTRA at SAS's FLOPs is tuned.

--runs judges a whole bench_sas_variants campaign the same way, each of our models against
its own peer (SAS's variants against ELECTRA, TACO against BERT; benchmarks/learning/
campaign.py).

Inputs are the run folders of bench_sas_variants (or bench_learning) from
one setting: a SAS variant's folder keeps its final checkpoint and metrics, ELECTRA's keeps
its weights at every evaluation (peer_iter_*.pt) and its training seconds, so ELECTRA is
taken at the evaluation nearest SAS's FLOPs and nearest SAS's training time.

    python -m benchmarks.bench_sas_downstream --data-path DATA --split 90,5,5 \\
        --sas paper=build/bench/sas_variants/paper_s1234 \\
              paper=build/bench/sas_variants/paper_s1234@2500 \\
        --electra build/bench/sas_variants/electra_s1234 --layers 2 --hidden 128 \\
        --seq-length 32 --batch 64
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys

import numpy as np
import torch

from benchmarks.harness.corpora import CORPORA, prepare
from benchmarks.harness.results import write_json
from benchmarks.learning.campaign import campaign
from benchmarks.learning.downstream import (
    POOLINGS,
    finetune_grid,
    finetune_task,
    peer_encoder,
    peer_net,
)
from benchmarks.learning.setting import Setting
from benchmarks.learning.variants import VARIANTS, train_flops_per_iteration
from megatron_taco.data.tokenizer import load_tokenizer
from megatron_taco.evaluation import encoders, word_order
from megatron_taco.evaluation.encoders import OurEncoder
from megatron_taco.evaluation.random_twins import mean_std
from megatron_taco.evaluation.word_order import held_out_sentences


def sas_train_seconds(metrics: str, upto: int) -> float:
    """Training time of our run to iteration ``upto``: each train record's mean iteration
    time x the iterations since the previous record. (Not x --log-interval: the driver also
    closes a window at every epoch's end, so windows are often shorter.)"""
    from megatron_taco.errors import ConfigError
    from megatron_taco.training.observability.log import read_metrics

    records = sorted((int(r["iteration"]), r["elapsed_ms"]) for r in read_metrics(metrics)
                     if r.get("split") == "train" and "elapsed_ms" in r)  # fmt: skip
    if not records or records[-1][0] < upto:
        last = records[-1][0] if records else 0
        raise ConfigError(f"--sas: {metrics} times the training only to iteration {last}, "
                          f"not to the checkpoint's {upto}")  # fmt: skip
    seconds, previous = 0.0, 0
    for it, ms in records:
        if it > upto:
            break
        seconds += ms * (it - previous) / 1e3
        previous = it
    return seconds


def electra_points(folder: str) -> list[tuple[int, float, str]]:
    """(iteration, training seconds, weights file) at every evaluation of the ELECTRA run."""
    from megatron_taco.training.observability.log import read_metrics

    seconds = {int(r["iteration"]): r["train_seconds"]
               for r in read_metrics(os.path.join(folder, "metrics.jsonl"))
               if r.get("split") == "valid" and "train_seconds" in r}  # fmt: skip
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "peer_iter_*.pt"))):
        it = int(re.search(r"peer_iter_(\d+)\.pt$", path).group(1))
        if it in seconds:
            out.append((it, seconds[it], path))
    return out


def row(name: str, init: str, iteration, flops, seconds, zs: dict, probes: dict) -> dict:
    return {"model": name, "init": init, "iteration": iteration, "train_flops": flops,
            "train_seconds": seconds, "zero_shot_rtd": zs.get("rtd"),
            "zero_shot_mlm": zs.get("mlm"), "probe": probes}  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_sas_downstream", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--sas", nargs="+", metavar="VARIANT=FOLDER",
                   help="SAS variants' run folders (checkpoints/ and metrics.jsonl).")  # fmt: skip
    p.add_argument("--electra", help="The ELECTRA run's folder.")
    p.add_argument("--runs", metavar="OUT",
                   help="Instead of --sas/--electra: a bench_sas_variants --out holding a "
                   "campaign (variants x --lrs x --seeds, --equal-flops): each variant's lr "
                   "picked on the validation documents, its seeds evaluated on the test "
                   "documents, paired tests against each model's peer (SAS's: ELECTRA; "
                   "TACO's: BERT; benchmarks/learning/campaign.py).")  # fmt: skip
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS),
                   help="--runs: only these variants (default: every one found).")  # fmt: skip
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument("--data-path", help="The dataset prefix the SAS runs trained on.")
    data.add_argument(
        "--corpus",
        choices=list(CORPORA),
        help="Or the benchmarks/harness/corpora.py corpus they trained on (built in "
        "build/corpora with --vocab-size pieces, as bench_sas_variants --corpus builds it).",
    )
    p.add_argument("--vocab-size", type=int, default=2000, help="--corpus's tokenizer pieces.")
    p.add_argument("--split", required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--sentences", type=int, default=300)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--random-twins", type=int, default=2)
    p.add_argument("--finetune", action="store_true",
                   help="Fine-tune every encoder on the word-order task instead of the "
                   "zero-shot and probe evaluations.")  # fmt: skip
    p.add_argument("--ft-corruption", choices=("swap", "shuffle"), default="swap",
                   help="The task's corrupted form (make_word_order_task.py's --corruption).")  # fmt: skip
    p.add_argument("--ft-lrs", type=float, nargs="+",
                   help="Default 1e-4 7.5e-5 with --runs (Table 6, small models), else 1e-4 "
                   "3e-4 1e-3.")  # fmt: skip
    p.add_argument("--ft-seeds", type=int, default=3)
    p.add_argument("--ft-epochs", type=int,
                   help="Default 20 with --runs (Table 6's budget for small tasks), else 10.")  # fmt: skip
    p.add_argument("--ft-batch", type=int, default=32)
    p.add_argument("--ft-poolings", nargs="+", choices=POOLINGS, default=list(POOLINGS),
                   help="--runs: the heads fine-tuned, on [CLS] and/or mean-pooled vectors.")  # fmt: skip
    p.add_argument("--json")
    args = p.parse_args(argv)
    table6 = bool(args.runs)
    args.ft_lrs = args.ft_lrs or ([1e-4, 7.5e-5] if table6 else [1e-4, 3e-4, 1e-3])
    args.ft_epochs = args.ft_epochs or (20 if table6 else 10)
    if args.runs and (args.sas or args.electra):
        p.error("--runs replaces --sas and --electra (a campaign's folders are found in it)")
    if not args.runs and not (args.sas and args.electra):
        p.error("give --sas and --electra, or --runs")
    if args.runs and not os.path.isdir(args.runs):
        p.error(f"--runs {args.runs}: not a folder")
    for name in ("sentences", "seeds", "random_twins", "ft_seeds", "ft_epochs", "ft_batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(not lr > 0 for lr in args.ft_lrs):
        p.error(f"--ft-lrs must all be > 0, got {args.ft_lrs}")

    if args.runs:
        return run_campaign(args, p)
    runs = {}  # label -> (variant, folder, iteration or None for the latest)
    for item in args.sas:
        name, _, where = item.partition("=")
        folder, _, step = where.partition("@")
        sas = name in VARIANTS and VARIANTS[name][0] in ("sas", "sas_c", "sas_da")
        if (not sas or not os.path.isdir(os.path.join(folder, "checkpoints"))
                or not os.path.isfile(os.path.join(folder, "metrics.jsonl"))
                or not (step == "" or step.isdigit())):  # fmt: skip
            p.error(f"--sas {item}: expected VARIANT=FOLDER[@ITERATION], a bench_sas_variants "
                    "SAS variant and its run folder holding checkpoints/ and metrics.jsonl "
                    "(TACO's campaign: --runs)")  # fmt: skip
        runs[f"{name}@{step}" if step else name] = (name, folder, int(step) if step else None)
    if not os.path.isfile(os.path.join(args.electra, "metrics.jsonl")):
        p.error(f"--electra {args.electra}: no metrics.jsonl (a bench_learning peer's folder)")
    points = electra_points(args.electra)
    if not points:
        p.error(f"--electra {args.electra}: no peer_iter_*.pt with train_seconds in metrics.jsonl")
    from megatron_taco.checkpoint.errors import CheckpointError
    from megatron_taco.data.indexed_dataset import IndexedDatasetError
    from megatron_taco.errors import ConfigError

    if args.corpus:
        args.data_path = prepare(args.corpus, vocab_size=args.vocab_size).prefix
    try:
        return compare(args, runs, points)
    except (ConfigError, CheckpointError, IndexedDatasetError) as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2


def run_campaign(args, p) -> int:
    from megatron_taco.checkpoint.errors import CheckpointError
    from megatron_taco.data.indexed_dataset import IndexedDatasetError
    from megatron_taco.errors import ConfigError

    if args.corpus:
        corpus = prepare(args.corpus, vocab_size=args.vocab_size)
        args.data_path, tokenizer = corpus.prefix, corpus.tokenizer
    else:
        p.error("--runs needs --corpus (the tokenizer of the campaign's runs)")
    tok = load_tokenizer(tokenizer)
    s = Setting(prefix=args.data_path, tokenizer=tokenizer, cache="", split=args.split,
                seq_length=args.seq_length, batch=args.batch, iters=0, lr=0.0,
                warmup_fraction=0.0, eval_interval=0, eval_iters=0, seed=0,
                layers=args.layers, hidden=args.hidden)  # fmt: skip
    try:
        result = campaign(args, s, tok)
    except (ConfigError, CheckpointError, IndexedDatasetError) as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        write_json(args.json, result)
    return 0


def compare(args, runs: dict, points: list) -> int:
    from megatron_taco.checkpoint.plan import find_checkpoint
    from megatron_taco.data.tokenizer import file_sha256
    from megatron_taco.errors import ConfigError
    from megatron_taco.recipes.registry import checkpoint_tokenizer

    tokenizers = {label: checkpoint_tokenizer(find_checkpoint(os.path.join(folder, "checkpoints"),
                                                              step), None)
                  for label, (_, folder, step) in runs.items()}  # fmt: skip
    first = next(iter(tokenizers.values()))
    for label, (file, _) in tokenizers.items():
        if file_sha256(file) != file_sha256(first[0]):
            raise ConfigError(f"--sas {label}: trained with the tokenizer {file}, not the first "
                              f"run's {first[0]}; the runs must share one")  # fmt: skip
    tok = load_tokenizer(*first)
    s = Setting(prefix=args.data_path, tokenizer=tok.model_path, cache="", split=args.split,
                   seq_length=args.seq_length, batch=args.batch, iters=0, lr=0.0,
                   warmup_fraction=0.0, eval_interval=0, eval_iters=0, seed=0,
                   layers=args.layers, hidden=args.hidden)  # fmt: skip
    try:
        sentences = held_out_sentences(args.data_path, tok, args.split)
    except IndexError as e:  # sentencepiece: "piece id is out of range"
        raise ConfigError(f"--data-path: {args.data_path} holds piece ids that the SAS runs' "
                          f"{tok.vocab_size}-piece tokenizer lacks (another tokenizer's dataset)") from e  # fmt: skip
    rng = np.random.default_rng(0)
    if len(sentences) > args.sentences:
        sentences = [sentences[i] for i in
                     sorted(rng.choice(len(sentences), args.sentences, replace=False))]  # fmt: skip
    task = (finetune_task(tok, sentences, args.seq_length, args.ft_corruption)
            if args.finetune else None)  # fmt: skip
    if task is not None:
        print(f"word-order ({args.ft_corruption}) fine-tuning: {len(task[0][0])} train, {len(task[1][0])} dev rows; "
              f"lrs {args.ft_lrs} x {args.ft_seeds} seeds, {args.ft_epochs} epochs of "
              f"{args.ft_batch}")  # fmt: skip
        if len(task[0][0]) < args.ft_batch or not len(task[1][0]):
            raise ConfigError(f"--data-path: {len(task[0][0])} training rows of the word-order "
                              f"task, fewer than --ft-batch {args.ft_batch}, or no dev row")  # fmt: skip
    originals, shuffles = word_order.fitting(tok, sentences, args.seeds, args.seq_length)
    if len(originals) < 2:
        raise ConfigError(f"--data-path: {len(originals)} held-out sentences of --split "
                          f"{args.split} fit --seq-length {args.seq_length}; need 2 or more")  # fmt: skip
    print(f"{len(originals)} held-out sentences that fit {args.seq_length} positions; "
          f"{args.seeds} shuffles; {args.random_twins} random twins")  # fmt: skip
    f_electra = train_flops_per_iteration("electra", s, tok.vocab_size)
    rows = []

    def add(name, init, encoders, it, flops, seconds):
        if task is not None:
            rows.append({**row(name, init, it, flops, seconds, {}, {}),
                         "finetune": finetune_grid(encoders, task, args)})  # fmt: skip
            print(f"  {name} ({init}): {ft_cell(rows[-1]['finetune'])}", flush=True)
            return
        zs, probes = word_order.word_order(encoders, originals, shuffles, tok)
        rows.append(row(name, init, it, flops, seconds, zs, probes))

    for name, (variant, folder, step) in runs.items():
        info, model, randoms = encoders.twins(os.path.join(folder, "checkpoints"), None,
                                        args.random_twins, step)  # fmt: skip
        it = info.iteration
        shape = (model.config.num_layers, model.config.hidden_size)
        if shape != (args.layers, args.hidden):
            raise ConfigError(f"--sas {name}: a {shape[0]} x {shape[1]} model, not --layers "
                              f"{args.layers} --hidden {args.hidden} (the FLOPs count reads them)")  # fmt: skip
        flops = it * train_flops_per_iteration(VARIANTS[variant][0], s, tok.vocab_size)
        seconds = sas_train_seconds(os.path.join(folder, "metrics.jsonl"), it)
        add(f"SAS {name}", "pretrained", [OurEncoder(model.eval(), "SAS")], it, flops, seconds)
        if task is None or name == next(iter(runs)):  # fine-tuned once: the same twins
            add(f"SAS {name}", f"random x{len(randoms)}",
                [OurEncoder(m, "SAS") for m in randoms], 0, 0, 0)  # fmt: skip
        chosen = {"equal FLOPs": nearest(points, lambda q: q[0] * f_electra, flops)}
        if task is None:  # fine-tuning: the FLOPs match only (the grid is costly)
            chosen["equal time"] = nearest(points, lambda q: q[1], seconds)
        for how, got, want in (("FLOPs", chosen["equal FLOPs"][0] * f_electra, flops),
                               ("time", chosen.get("equal time", (0, seconds))[1], seconds)):  # fmt: skip
            # The nearest evaluation of a run that ended (or began) far away is no match.
            if abs(got - want) > 0.1 * want:
                print(f"note: SAS {name}: ELECTRA's nearest evaluation in training {how} is "
                      f"{got / want:.2f}x SAS's; its 'equal {how}' row is not equal")  # fmt: skip
        for how, (e_it, e_s, path) in chosen.items():
            try:
                net = peer_net("electra", tok.vocab_size, s, torch.load(path, weights_only=True))
            except RuntimeError as e:  # load_state_dict's size mismatches
                raise ConfigError(
                    f"--electra {path}: not an ELECTRA of --layers {args.layers} "
                    f"--hidden {args.hidden} over the SAS runs' {tok.vocab_size}-"
                    f"piece vocabulary: {str(e).strip().splitlines()[-1].strip()}"
                ) from e
            add(f"ELECTRA ({how} as SAS {name})", "pretrained", [peer_encoder(net)], e_it,
                e_it * f_electra, e_s)  # fmt: skip
    electra_twins = [peer_encoder(peer_net("electra", tok.vocab_size, s, None, seed=1000 + k))
                     for k in range(args.random_twins)]  # fmt: skip
    add("ELECTRA", f"random x{len(electra_twins)}", electra_twins, 0, 0, 0)
    (print_finetune_table if task is not None else print_table)(rows)
    if args.json:
        write_json(args.json, rows)
    return 0


def nearest(points: list, measure, target: float):
    """The point whose ``measure`` is nearest ``target`` (the first of a tie)."""
    return min(points, key=lambda q: abs(measure(q) - target))


# ---------------------------------------------------------------------------------------
# --finetune


def ft_cell(ft: dict) -> str:
    return (
        f"lr {ft['lr']:g}: {mean_std(ft['dev_acc'])} (last epoch {mean_std(ft['last_epoch_acc'])}"
        f", train loss {np.mean(ft['last_train_loss']):.3f})"
    )


def print_finetune_table(rows: list[dict]) -> None:
    lrs = list(rows[0]["finetune"]["best_epoch"])
    w = max(len(r["model"]) for r in rows)
    print(f"\n{'model':<{w}} {'init':<12} {'iter':>5} {'TFLOPs':>7} "
          + " ".join(f"{f'lr {float(lr):g} %':>13}" for lr in lrs)
          + f" {'chosen lr':>9} {'dev acc %':>13} {'last epoch %':>13} {'train loss':>10}")  # fmt: skip
    for r in rows:
        ft = r["finetune"]
        print(f"{r['model']:<{w}} {r['init']:<12} {r['iteration']:>5} "
              f"{r['train_flops'] / 1e12:>7.2f} "
              + " ".join(f"{mean_std(ft['best_epoch'][lr]):>13}" for lr in lrs)
              + f" {ft['lr']:>9g} {mean_std(ft['dev_acc']):>13} "
              f"{mean_std(ft['last_epoch_acc']):>13} {np.mean(ft['last_train_loss']):>10.3f}")  # fmt: skip
    print("\n(dev accuracy of the word-order task, mean ± std over the fine-tuning seeds: each "
          "run's best epoch; the chosen lr is the one with the best mean; train loss: its "
          "runs' last epoch, mean)")  # fmt: skip


def print_table(rows: list[dict]) -> None:
    sizes = sorted({n for r in rows for n in r["probe"]})
    w = max(len(r["model"]) for r in rows)
    print(f"\n{'model':<{w}} {'init':<12} {'iter':>5} {'TFLOPs':>7} {'train s':>8} "
          f"{'zero-shot RTD %':>15} {'zero-shot MLM %':>15} "
          + " ".join(f"{f'probe n={n} %':>14}" for n in sizes))  # fmt: skip
    for r in rows:
        print(f"{r['model']:<{w}} {r['init']:<12} {r['iteration']:>5} "
              f"{r['train_flops'] / 1e12:>7.2f} {r['train_seconds']:>8.0f} "
              f"{mean_std(r['zero_shot_rtd']):>15} {mean_std(r['zero_shot_mlm']):>15} "
              + " ".join(f"{mean_std(r['probe'][n]):>14}" for n in sizes))  # fmt: skip
    print("\n(mean ± std over the shuffles' seeds and the random twins; a random encoder is at "
          "50 on the zero-shot columns by construction)")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
