"""Tokens/s of a TACO training step (fwd + bwd + AdamW) against transformers' DeBERTa-v2.

The DeBERTa baseline is matched to the TACO config: hidden = d_WE + d_PE, same depth, heads
= h_WE + h_PE of the same head size, FFN = the two streams' FFNs added, relative attention
c2p|p2c with the same maximum position, same rows x sequence length per step. The two models
are timed alternately, several repeats each, so machine load drifts hit both alike; the
median of the repeats is reported. MFU is against a torch float32 GEMM peak measured here.

    python benchmarks/bench_taco_step.py                       # small preset, seq 128
    python benchmarks/bench_taco_step.py --model-size base --seq-length 512 --rows 2
"""

from __future__ import annotations

import argparse
import statistics

import torch
from timing import gemm_peak, time_steps

from megatron_taco.models.flops import taco_train_flops
from megatron_taco.models.taco.config import TacoConfig
from megatron_taco.models.taco.model import TacoForPretraining
from megatron_taco.parallel.state import single_process_state


def taco_batch(rows: int, seq: int, vocab: int, max_pos: int, g: torch.Generator, device) -> dict:
    """Rows [0, rows/2) MLM (15% tokens masked), rows [rows/2, rows) MPM (15% positions)."""
    b = rows // 2
    ids = torch.randint(5, vocab, (rows, seq), generator=g)
    pos = torch.arange(seq).repeat(rows, 1)
    mlm = torch.full((rows, seq), -100)
    mpm = torch.full((rows, seq), -100)
    pick = torch.rand(rows, seq, generator=g) < 0.15
    mlm[:b][pick[:b]] = ids[:b][pick[:b]]
    ids[:b][pick[:b]] = 4
    mpm[b:][pick[b:]] = pos[b:][pick[b:]]
    pos[b:][pick[b:]] = -1
    mask = torch.ones(rows, seq, dtype=torch.bool)
    batch = dict(
        input_ids=ids, position_ids=pos, attention_mask=mask, mlm_labels=mlm, mpm_labels=mpm
    )
    return {k: v.to(device) for k, v in batch.items()}


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
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    TacoConfig.add_args(parser)
    parser.add_argument(
        "--rows", type=int, default=8, help="Sequences per step (TACO: half MLM, half MPM rows)."
    )
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=30522)
    parser.add_argument(
        "--repeats", type=int, default=5, help="Alternating timing rounds per model."
    )
    parser.add_argument("--steps", type=int, default=3, help="Training steps per timing round.")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU).")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dropout", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args(argv)
    if not hasattr(args, "model_size"):
        args.model_size = "small"
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rows % 2:
        parser.error("--rows must be even (TACO pairs an MLM row with an MPM row)")

    overrides = {} if args.dropout else dict(hidden_dropout=0.0, attention_dropout=0.0)
    cfg = TacoConfig.from_args(args, vocab_size=args.vocab_size, **overrides)
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)

    taco = TacoForPretraining(cfg, single_process_state()).to(device).train()
    deberta, dcfg = build_deberta(cfg, args.dropout)
    deberta = deberta.to(device).train()
    opt_t = torch.optim.AdamW(taco.parameters(), lr=1e-4)
    opt_d = torch.optim.AdamW(deberta.parameters(), lr=1e-4)
    tb = taco_batch(
        args.rows, args.seq_length, cfg.vocab_size, cfg.max_position_embeddings, g, device
    )
    db = deberta_batch(args.rows, args.seq_length, cfg.vocab_size, g, device)

    def taco_step():
        opt_t.zero_grad(set_to_none=True)
        taco(tb)["loss"].backward()
        opt_t.step()

    def deberta_step():
        opt_d.zero_grad(set_to_none=True)
        deberta(**db).loss.backward()
        opt_d.step()

    labelled = (db["labels"] != -100).nonzero(as_tuple=True)

    def deberta_labelled_step():
        # HF's MaskedLM projects every token onto the vocabulary; TACO's heads only see the
        # labelled ones. This variant runs HF's own encoder and head, the head on the
        # labelled tokens only, to separate the encoders' speed from that choice.
        opt_d.zero_grad(set_to_none=True)
        hidden = deberta.deberta(input_ids=db["input_ids"], attention_mask=db["attention_mask"])[0]
        scores = deberta.cls(hidden[labelled])
        torch.nn.functional.cross_entropy(scores, db["labels"][labelled]).backward()
        opt_d.step()

    steps = {"TACO": taco_step, "DeBERTa": deberta_step, "DeBERTa-lab": deberta_labelled_step}
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    times = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            times[name].append(time_steps(step, args.steps, device))
    tt, td, tl = (statistics.median(times[name]) for name in steps)

    tokens = args.rows * args.seq_length
    peak = gemm_peak(device)
    f_taco = taco_train_flops(cfg, args.seq_length, args.rows, vocab_size=cfg.vocab_size)
    f_deb = deberta_train_flops(dcfg, args.seq_length, args.rows)
    f_lab = deberta_train_flops(
        dcfg, args.seq_length, args.rows, head_fraction=len(labelled[0]) / tokens
    )
    n_taco = sum(p.numel() for p in taco.parameters())
    n_deb = sum(p.numel() for p in deberta.parameters())

    print(
        f"device={device} threads={torch.get_num_threads()} rows={args.rows} seq={args.seq_length} "
        f"preset={cfg.model_size} layers={cfg.num_layers} hidden=({cfg.we_hidden_size},{cfg.pe_hidden_size}) "
        f"heads=({cfg.we_attention_heads},{cfg.pe_attention_heads})x{cfg.kv_channels} vocab={cfg.vocab_size}"
    )
    print(
        f"DeBERTa: hidden={dcfg.hidden_size} heads={dcfg.num_attention_heads}x{dcfg.attention_head_size} "
        f"ffn={dcfg.intermediate_size} layers={dcfg.num_hidden_layers} c2p|p2c over "
        f"{2 * dcfg.max_position_embeddings} buckets"
    )
    print(f"float32 GEMM peak: {peak / 1e9:.1f} GFLOP/s")
    print(f"{'model':<12}{'params':>10}{'step ms':>10}{'tokens/s':>12}{'GFLOP/step':>12}{'MFU':>8}")
    rows = (
        ("TACO", n_taco, tt, f_taco),
        ("DeBERTa", n_deb, td, f_deb),
        ("DeBERTa-lab", n_deb, tl, f_lab),
    )
    for name, n, t, f in rows:
        print(
            f"{name:<12}{n / 1e6:>9.2f}M{t * 1e3:>10.1f}{tokens / t:>12.0f}{f / 1e9:>12.2f}{f / t / peak:>8.1%}"
        )
    print(f"TACO / DeBERTa tokens/s: {td / tt:.2f}x (target >= 0.8x)")
    print(f"TACO / DeBERTa-lab (MLM head on labelled tokens only) tokens/s: {tl / tt:.2f}x")
    for name, ts in times.items():
        print(f"per-repeat {name} ms: {[round(x * 1e3, 1) for x in ts]}")


if __name__ == "__main__":
    main()
