"""Tokens/s and peak activation memory of a TACO training step (fwd + bwd + AdamW) against
transformers' DeBERTa-v2, side by side in one run.

The DeBERTa baseline is matched to the TACO config: hidden = d_WE + d_PE, same depth, heads
= h_WE + h_PE of the same head size, FFN = the two streams' FFNs added, relative attention
c2p|p2c with the same maximum position, same rows x sequence length per step. DeBERTa-lab
runs HF's encoder and MLM head with the head on the labelled tokens only, as TACO's heads
run: the peer of the goal (issue 16: TACO-base >= 1.0x DeBERTa-lab tokens/s at seq 512,
peak memory per token no worse). The models are timed alternately (A B C A B C ...), the
median of the per-repeat ratios is reported with its range. --compile adds TACO with
torch.compile'd layers to the rotation.

On a GPU every model runs in bf16 (--dtype; the bf16 configs' precision) and MFU is model
FLOPs over the detected GPU's dense bf16 peak (megatron_taco/training/observability/peaks.py; a GEMM measured here
on CPU or an unknown GPU). TACO's batch carries the host numbers its collator counts
(models/common/host.py), so its step reads nothing back from the GPU. transformers'
DeBERTa-v2 has no SDPA attention (transformers 5.23): it runs its own.

    python -m benchmarks.bench_taco_step                          # base, seq 512, 2 rows
    python -m benchmarks.bench_taco_step --model-size small --seq-length 128 --rows 8
    python -m benchmarks.bench_taco_step --threads 1 --clock cpu  # a loaded shared machine
    python -m benchmarks.bench_taco_step --profile docs/taco_profile.md
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

from benchmarks.harness.batches import taco_batch
from benchmarks.harness.timing import (
    add_common_args,
    compute_peak,
    interleaved_times,
    model_dtype,
    peak_activation_bytes,
    profile_table,
    ratio_row,
    report,
    setup,
)
from megatron_taco.models.flops import taco_train_flops
from megatron_taco.models.taco.config import TacoConfig
from megatron_taco.models.taco.model import TacoForPretraining
from megatron_taco.parallel.state import single_process_state

GOAL_SPEED = 1.0  # TACO / DeBERTa-lab tokens/s
GOAL_MEMORY = 1.0  # TACO / DeBERTa-lab peak activation bytes per token


def deberta_batch(rows: int, seq: int, vocab: int, g: torch.Generator, device) -> dict:
    ids = torch.randint(5, vocab, (rows, seq), generator=g)
    labels = torch.full((rows, seq), -100)
    pick = torch.rand(rows, seq, generator=g) < 0.15
    labels[pick] = ids[pick]
    ids[pick] = 4
    batch = dict(
        input_ids=ids, attention_mask=torch.ones(rows, seq, dtype=torch.long), labels=labels
    )
    return {k: v.to(device) for k, v in batch.items()}


def build_deberta(cfg: TacoConfig, dropout: bool):
    from transformers import DebertaV2Config, DebertaV2ForMaskedLM

    # Same heads x head size as TACO (h_WE + h_PE heads of kv_channels) when that width
    # equals the hidden size (small preset: 8 x 32 = 256). HF's DeBERTa projects the
    # attention output with a [hidden, hidden] matrix, so otherwise (TACO-base: 18 x 64 =
    # 1152 != 768) it gets hidden / kv_channels heads (base: 12 x 64, DeBERTa-base's own
    # shape): fewer and narrower heads than TACO, which errs in DeBERTa's favour.
    heads = cfg.we_attention_heads + cfg.pe_attention_heads
    if heads * cfg.kv_channels != cfg.hidden_size:
        heads = cfg.hidden_size // cfg.kv_channels
    dcfg = DebertaV2Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=heads,
        attention_head_size=cfg.hidden_size // heads,
        intermediate_size=cfg.we_ffn_hidden_size + cfg.pe_ffn_hidden_size,
        max_position_embeddings=cfg.max_position_embeddings,
        relative_attention=True,
        pos_att_type=["c2p", "p2c"],
        position_biased_input=False,
        max_relative_positions=-1,
        hidden_dropout_prob=cfg.hidden_dropout if dropout else 0.0,
        attention_probs_dropout_prob=cfg.attention_dropout if dropout else 0.0,
        layer_norm_eps=cfg.layernorm_epsilon,
        type_vocab_size=0,
    )
    return DebertaV2ForMaskedLM(dcfg), dcfg


def deberta_train_flops(dcfg, seq: int, rows: int, head_fraction: float = 1.0) -> float:
    """ELECTRA-style count for the HF model: parameter matmuls per token, attention products
    per sequence (content, c2p and p2c against 2*att_span buckets, values), relative
    projections per step, the MLM head on ``head_fraction`` of the tokens; x3 for fwd + bwd."""
    h, L = dcfg.hidden_size, dcfg.num_hidden_layers
    heads, d = dcfg.num_attention_heads, dcfg.attention_head_size
    att = heads * d
    n = 2 * dcfg.max_position_embeddings  # HF uses all 2*att_span rows whatever seq is
    per_token = 2 * L * (4 * h * att + 2 * h * dcfg.intermediate_size)
    per_token += head_fraction * 2 * (h * h + h * dcfg.vocab_size)
    per_seq = 2 * L * (heads * seq * seq * d * 2 + 2 * heads * seq * n * d)
    rel = 2 * L * n * h * 2 * att
    return 3.0 * (rows * seq * per_token + rows * per_seq + rel)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_taco_step",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    TacoConfig.add_args(parser)
    parser.add_argument(
        "--rows", type=int, default=2, help="Sequences per step (TACO: half MLM, half MPM rows)."
    )
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--vocab-size", type=int, default=30522)
    parser.add_argument("--dropout", action=argparse.BooleanOptionalAction, default=True)
    add_common_args(parser, repeats=3, steps=1, warmup=1)
    args = parser.parse_args(argv)
    if not hasattr(args, "model_size"):
        args.model_size = "base"
    if args.rows % 2:
        parser.error("--rows must be even (TACO pairs an MLM row with an MPM row)")
    device = setup(args)

    overrides = {} if args.dropout else dict(hidden_dropout=0.0, attention_dropout=0.0)
    cfg = TacoConfig.from_args(args, vocab_size=args.vocab_size, **overrides)
    compiled = cfg.compile
    cfg = dataclasses.replace(cfg, compile=False)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)

    dtype = model_dtype(args, device)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32, the training default (--tf32)
    taco = TacoForPretraining(cfg, single_process_state()).to(device, dtype).train()
    deberta, dcfg = build_deberta(cfg, args.dropout)
    deberta = deberta.to(device, dtype).train()
    opt_t = torch.optim.AdamW(taco.parameters(), lr=1e-4)
    opt_d = torch.optim.AdamW(deberta.parameters(), lr=1e-4)
    tb = taco_batch(
        args.rows, args.seq_length, cfg.vocab_size, cfg.max_position_embeddings, g, device
    )
    db = deberta_batch(args.rows, args.seq_length, cfg.vocab_size, g, device)
    labelled = (db["labels"] != -100).nonzero(as_tuple=True)

    def taco_fb(model=taco):
        model(tb)["loss"].backward()

    def deberta_fb():
        deberta(**db).loss.backward()

    def deberta_labelled_fb():
        # HF's MaskedLM projects every token onto the vocabulary; TACO's heads only see the
        # labelled ones. This variant runs HF's own encoder and head, the head on the
        # labelled tokens only, to separate the encoders' speed from that choice.
        hidden = deberta.deberta(input_ids=db["input_ids"], attention_mask=db["attention_mask"])[0]
        scores = deberta.cls(hidden[labelled])
        torch.nn.functional.cross_entropy(scores, db["labels"][labelled]).backward()

    def stepper(fb, opt):
        def step():
            opt.zero_grad(set_to_none=True)
            fb()
            opt.step()

        return step

    steps = {
        "TACO": stepper(taco_fb, opt_t),
        "DeBERTa": stepper(deberta_fb, opt_d),
        "DeBERTa-lab": stepper(deberta_labelled_fb, opt_d),
    }
    if compiled:
        torch.manual_seed(0)
        taco_c = TacoForPretraining(dataclasses.replace(cfg, compile=True), single_process_state())
        taco_c = taco_c.to(device, dtype).train()
        opt_c = torch.optim.AdamW(taco_c.parameters(), lr=1e-4)
        steps["TACO+compile"] = stepper(lambda: taco_fb(taco_c), opt_c)

    for _ in range(args.warmup):  # the first warm-up compiles
        for step in steps.values():
            step()
    times = interleaved_times(steps, args.repeats, args.steps, device, args.clock)
    med = {name: statistics.median(ts) for name, ts in times.items()}

    tokens = args.rows * args.seq_length
    peak, peak_note = compute_peak(device, dtype)
    f_taco = taco_train_flops(cfg, args.seq_length, args.rows, vocab_size=cfg.vocab_size)
    flops = {
        "TACO": f_taco,
        "TACO+compile": f_taco,
        "DeBERTa": deberta_train_flops(dcfg, args.seq_length, args.rows),
        "DeBERTa-lab": deberta_train_flops(
            dcfg, args.seq_length, args.rows, head_fraction=len(labelled[0]) / tokens
        ),
    }
    n_taco = sum(p.numel() for p in taco.parameters())
    n_deb = sum(p.numel() for p in deberta.parameters())
    params = {"TACO": n_taco, "TACO+compile": n_taco, "DeBERTa": n_deb, "DeBERTa-lab": n_deb}

    print(
        f"device={device} threads={torch.get_num_threads()} clock={args.clock} rows={args.rows} "
        f"seq={args.seq_length} preset={cfg.model_size} layers={cfg.num_layers} "
        f"hidden=({cfg.we_hidden_size},{cfg.pe_hidden_size}) "
        f"heads=({cfg.we_attention_heads},{cfg.pe_attention_heads})x{cfg.kv_channels} "
        f"vocab={cfg.vocab_size} dtype={dtype} repeats={args.repeats}x{args.steps} steps"
    )
    print(
        f"DeBERTa: hidden={dcfg.hidden_size} heads={dcfg.num_attention_heads}x"
        f"{dcfg.attention_head_size} ffn={dcfg.intermediate_size} layers="
        f"{dcfg.num_hidden_layers} c2p|p2c over {2 * dcfg.max_position_embeddings} buckets"
    )
    print(f"MFU against: {peak_note}")
    print(f"{'model':<14}{'params':>10}{'step ms':>10}{'tokens/s':>12}{'GFLOP/step':>12}{'MFU':>8}")
    for name, t in med.items():
        f = flops[name]
        print(
            f"{name:<14}{params[name] / 1e6:>9.2f}M{t * 1e3:>10.1f}{tokens / t:>12.0f}"
            f"{f / 1e9:>12.2f}{f / t / peak:>8.1%}"
        )
    for name, ts in times.items():
        print(f"per-repeat {name} ms: {[round(x * 1e3, 1) for x in ts]}")

    # Tokens/s ratios from per-repeat time ratios (same tokens per step).
    rows = [
        ratio_row(
            "taco_vs_deberta_lab_tokens_per_s",
            times["DeBERTa-lab"],
            times["TACO"],
            GOAL_SPEED,
            ">=",
            "TACO / DeBERTa-lab tokens/s",
        ),  # fmt: skip
        ratio_row(
            "taco_vs_deberta_tokens_per_s",
            times["DeBERTa"],
            times["TACO"],
            None,
            ">=",
            "TACO / DeBERTa (MLM head on every token) tokens/s",
        ),  # fmt: skip
    ]
    if compiled:
        rows.append(
            ratio_row(
                "taco_compiled_vs_eager_tokens_per_s",
                times["TACO"],
                times["TACO+compile"],
                None,
                ">=",
                "TACO --compile / eager tokens/s",
            )  # fmt: skip
        )
        rows.append(
            ratio_row(
                "taco_compiled_vs_deberta_lab_tokens_per_s",
                times["DeBERTa-lab"],
                times["TACO+compile"],
                GOAL_SPEED,
                ">=",
                "TACO --compile / DeBERTa-lab tokens/s",
            )  # fmt: skip
        )
    if args.memory:
        mem_taco = peak_activation_bytes(taco_fb, taco.parameters())
        mem_deb = peak_activation_bytes(deberta_labelled_fb, deberta.parameters())
        for name, m in (("TACO", mem_taco), ("DeBERTa-lab", mem_deb)):
            print(
                f"peak activation memory {name}: {m / 2**20:.0f} MiB, {m / tokens / 1024:.0f} KiB/token"
            )
        rows.append(
            dict(
                metric="taco_vs_deberta_lab_peak_memory_per_token",
                value=mem_taco / mem_deb,
                goal=GOAL_MEMORY,
                op="<=",
                unit="x",
                note=f"peak activation bytes (weight grads excluded) per token, "
                f"{mem_taco / tokens / 1024:.0f} vs {mem_deb / tokens / 1024:.0f} KiB",
            )  # fmt: skip
        )
    report(args, "bench_taco_step.py", rows, f"{cfg.model_size} seq {args.seq_length}")

    if args.profile:
        profiled = {"TACO": steps["TACO"], "DeBERTa-lab": steps["DeBERTa-lab"]}
        profile_table(args.profile, profiled, f"{cfg.model_size}, seq {args.seq_length}, "
                      f"{args.rows} rows, {torch.get_num_threads()} threads")  # fmt: skip


if __name__ == "__main__":
    main()
