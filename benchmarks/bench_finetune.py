"""Fine-tuning throughput against pretraining throughput of the same model and sequence
length, side by side in one run (target: fine-tuning >= 0.9x pretraining, in sequences/s).

One step each: forward, loss, backward and AdamW, on one process.
- pretraining: TacoForPretraining on the collator's two rows per sample (MLM row and MPM
  row), SasForPretraining with its MLM head at the replaced positions and its RTD head;
- fine-tuning: TaskModel with the classification head on [CLS] (GLUE's case);
- evaluation: TaskModel under torch.no_grad() in eval mode, as the dev evaluation runs it
  (informational).
Throughput is counted in sequences (rows of seq-length tokens) per second, so TACO's
pretraining sample counts as its two rows. The models are timed alternately, medians of
several repeats.

    python benchmarks/bench_finetune.py [--batch 16 --seq-length 128 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from bench_sas_step import sas_batch
from bench_taco_step import taco_batch
from timing import sync, time_steps

from megatron_taco.models.finetune import TaskModel
from megatron_taco.models.sas.config import SasConfig
from megatron_taco.models.sas.model import SasForPretraining
from megatron_taco.models.taco.config import TacoConfig
from megatron_taco.models.taco.model import TacoForPretraining
from megatron_taco.parallel.state import single_process_state

VOCAB = 30522
TARGET = 0.9


def _models(kind: str):
    torch.manual_seed(0)
    if kind == "TACO":
        config = TacoConfig.preset("small", vocab_size=VOCAB)
        pre = TacoForPretraining(config, single_process_state())
    else:
        config = SasConfig.preset("small", vocab_size=VOCAB)
        pre = SasForPretraining(config, single_process_state())
    ft = TaskModel(kind, config, single_process_state(), task_kind="classification",
                   num_labels=3)  # fmt: skip
    return config, pre, ft


def _train_step(model, optimizer, batch):
    def step():
        model(batch)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _eval_step(model, batch):
    def step():
        with torch.no_grad():
            model(batch)

    return step


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2, help="Timed steps per repeat.")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--results-json", help="Write the ratios here (benchmarks/run_all.py).")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    b, s = args.batch, args.seq_length
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, VOCAB, (b, s), generator=g)
    ft_batch = {"input_ids": ids, "attention_mask": torch.ones(b, s, dtype=torch.bool),
                "labels": torch.randint(0, 3, (b,), generator=g)}  # fmt: skip
    ft_batch = {k: v.to(device) for k, v in ft_batch.items()}

    steps, rows = {}, {}
    for kind in ("TACO", "SAS"):
        config, pre, ft = (m.to(device) if isinstance(m, torch.nn.Module) else m
                           for m in _models(kind))  # fmt: skip
        if kind == "TACO":
            # b samples = 2b rows (MLM rows, MPM rows), as the collator builds them.
            pre_batch = taco_batch(2 * b, s, VOCAB, config.max_position_embeddings, g, device)
            rows[f"{kind} pretrain"] = 2 * b
        else:
            pre_batch = {k: v.to(device) for k, v in sas_batch(b, s, g).items()}
            rows[f"{kind} pretrain"] = b
        rows[f"{kind} finetune"] = rows[f"{kind} eval"] = b
        pre_opt = torch.optim.AdamW(pre.parameters(), lr=1e-5)
        ft_opt = torch.optim.AdamW(ft.parameters(), lr=1e-5)
        evaluated = TaskModel(kind, config, single_process_state(), task_kind="classification",
                              num_labels=3).to(device).eval()  # fmt: skip
        steps[f"{kind} pretrain"] = _train_step(pre, pre_opt, pre_batch)
        steps[f"{kind} finetune"] = _train_step(ft, ft_opt, ft_batch)
        steps[f"{kind} eval"] = _eval_step(evaluated, ft_batch)
    for step in steps.values():  # warm-up
        step()
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            times[name].append(time_steps(step, args.steps, device))
    print(f"small models, micro-batch {b} x seq {s} on {device}, {args.repeats} repeats")
    throughput = {n: rows[n] / statistics.median(t) for n, t in times.items()}
    results = []
    for kind in ("TACO", "SAS"):
        for what in ("pretrain", "finetune", "eval"):
            name = f"{kind} {what}"
            spread = max(times[name]) / min(times[name]) - 1
            print(f"  {name:14s} {throughput[name]:8.1f} sequences/s  (spread {spread:.0%})")
        ratio = throughput[f"{kind} finetune"] / throughput[f"{kind} pretrain"]
        met = ratio >= TARGET
        print(f"{kind}-small fine-tuning / pretraining throughput: {ratio:.2f}x "
              f"(target >= {TARGET}{'' if met else f'; missed by {TARGET - ratio:.2f}'})")  # fmt: skip
        results.append({"benchmark": "bench_finetune.py", "metric": f"{kind}-small finetune/pretrain sequences/s",
                        "value": ratio, "goal": TARGET, "op": ">=", "unit": "x",
                        "note": f"batch {b} x seq {s}, classification head"})  # fmt: skip
    if args.results_json:
        with open(args.results_json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
