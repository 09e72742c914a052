"""Step time of SAS-small against transformers' ELECTRA-small, side by side in one run, and
the peak activation memory of the base-size encoders against ELECTRA-base / DeBERTa-base.

One SAS step: encoder + MLM head at the replaced positions + RTD head, the loss, backward,
AdamW, and the self-augmentation draw from the MLM logits (inverse CDF). One ELECTRA step
(the peer SAS replaces): generator MLM forward (hidden / 4, embeddings tied, generator head
on the masked positions only, as ELECTRA's own code does), sampling the replacements from
its softmax, discriminator forward with its RTD head, loss = MLM + 50 RTD, backward, AdamW.
Same batch and sequence length. The models are timed alternately (A B C A B C ...), the
median of the per-repeat ratios is reported with its range. --compile adds SAS-small and
SAS^DA-small with torch.compile'd layers to the rotation.

Memory: one forward + backward of the encoder alone (a fixed random probe of its output as
the loss) at base size, seq 512: SAS-base against transformers' ELECTRA-base discriminator
(its default attention, SDPA) and SAS^DA-base against DeBERTa-v2-base, each configured by
our exporter (models/sas/hf.py) so the architectures are the same.

On a GPU every model runs in bf16 (--dtype), ELECTRA with transformers' SDPA attention;
tokens/s and MFU (the model FLOPs that run, models/flops.py, over the detected GPU's dense
bf16 peak, megatron_taco/training/observability/peaks.py) are printed per model. SAS's batch carries
the host numbers its collator counts (models/common/host.py): nothing is read back from the
GPU inside its step.

    python -m benchmarks.bench_sas_step                 # batch 16 x seq 128, goal <= 0.75
    python -m benchmarks.bench_sas_step --threads 1 --clock cpu --repeats 5
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from benchmarks.harness.batches import VOCAB, sas_batch
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
from megatron_taco.models.common.host import HOST_KEY
from megatron_taco.models.flops import (
    EncoderShape,
    generator_shape,
    sas_encoder_shape,
    sas_forward_flops,
    sas_train_flops_executed,
)
from megatron_taco.models.sas.config import SasConfig
from megatron_taco.models.sas.model import SasForPretraining
from megatron_taco.parallel.sampling import vocab_parallel_sample
from megatron_taco.parallel.state import single_process_state

GOAL = 0.75  # SAS-small / ELECTRA-small step time


def build_sas(disentangled: bool, size: str = "small", compile: bool = False):
    torch.manual_seed(0)
    config = SasConfig.preset(
        size, vocab_size=VOCAB, disentangled_attention=disentangled, compile=compile
    )
    return SasForPretraining(config, single_process_state())


def sas_step(model, optimizer, batch) -> None:
    out = model(batch)
    out["loss"].backward()
    # The self-augmentation draw SAS adds to a step (one token per replaced position).
    vocab_parallel_sample(
        out["mlm_logits"],
        None,
        vocab_size=VOCAB,
        row_keys=torch.arange(out["mlm_logits"].shape[0], device=out["mlm_logits"].device),
        seed=1,
    )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def build_electra():
    from transformers import ElectraConfig, ElectraForMaskedLM, ElectraForPreTraining

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, embedding_size=128, max_position_embeddings=512,
                  attn_implementation="sdpa")  # fmt: skip
    disc = ElectraForPreTraining(
        ElectraConfig(
            hidden_size=256,
            num_hidden_layers=12,
            num_attention_heads=4,
            intermediate_size=1024,
            **common,
        )  # fmt: skip
    )
    gen = ElectraForMaskedLM(
        ElectraConfig(
            hidden_size=64,
            num_hidden_layers=12,
            num_attention_heads=1,
            intermediate_size=256,
            **common,
        )  # fmt: skip
    )
    gen.electra.embeddings = disc.electra.embeddings  # ELECTRA ties the embeddings
    return gen, disc


def electra_step(gen, disc, optimizer, batch) -> None:
    ids, mask, labels = batch["original"], batch["attention_mask"], batch["mlm_labels"]
    picked = labels != -100
    masked = ids.masked_fill(picked, 4)  # [MASK]
    hidden = gen.electra(input_ids=masked, attention_mask=mask).last_hidden_state
    logits = gen.generator_lm_head(gen.generator_predictions(hidden[picked]))  # [N, V]
    mlm = torch.nn.functional.cross_entropy(logits, labels[picked])
    with torch.no_grad():
        sampled = torch.multinomial(torch.softmax(logits.float(), -1), 1).squeeze(1)
    corrupted = ids.clone()
    corrupted[picked] = sampled
    rtd_labels = (corrupted != ids).float()
    rtd = disc(input_ids=corrupted, attention_mask=mask, labels=rtd_labels).loss
    (mlm + 50.0 * rtd).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def encoder_memory(batch: int, seq: int, device) -> dict[str, float]:
    """Peak activation bytes per token of one encoder forward + backward at base size:
    SAS, SAS^DA and the transformers encoders of the same architecture."""
    import transformers

    from megatron_taco.models.sas.hf import deberta_v2_config_and_state, electra_config_and_state

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, VOCAB, (batch, seq), generator=g).to(device)
    mask = torch.ones(batch, seq, dtype=torch.bool, device=device)
    probe = torch.randn(batch, seq, 768, generator=g).to(device)
    out = {}
    for da in (False, True):
        sas = build_sas(da, "base").to(device).train()
        config = sas.config
        if da:
            kwargs, _, _ = deberta_v2_config_and_state(config, sas.state_dict())
            peer = transformers.DebertaV2Model(transformers.DebertaV2Config(**kwargs))
        else:
            kwargs, _ = electra_config_and_state(config, sas.state_dict())
            peer = transformers.ElectraModel(transformers.ElectraConfig(**kwargs))
        peer = peer.to(device).train()
        names = ("SAS^DA-base", "DeBERTa-base") if da else ("SAS-base", "ELECTRA-base")
        out[names[0]] = _per_token(lambda e=sas.sas: e(ids, mask), sas.sas, probe)
        out[names[1]] = _per_token(
            lambda p=peer: p(input_ids=ids, attention_mask=mask.long()).last_hidden_state,
            peer,
            probe,
        )
        del sas, peer
    return out


def _per_token(forward, model, probe) -> float:
    def forward_backward():
        (forward() * probe).sum().backward()

    return peak_activation_bytes(forward_backward, model.parameters()) / probe[..., 0].numel()


def step_flops(rows: int, seq: int, labelled: int, sas_models: dict) -> dict[str, float]:
    """Model FLOPs of one training step of each model: the matmuls that run, backward twice
    the forward (models/flops.py, the count the training log uses). ``labelled``: the batch's
    MLM tokens; ``sas_models``: name -> the SAS model timed (its padded vocabulary, relative
    rows)."""
    flops = {}
    for name, model in sas_models.items():
        shape = dataclasses.replace(
            sas_encoder_shape(model.config, seq),
            vocab_size=model.sas.embeddings.word_embeddings.weight.shape[0],
        )
        flops[name] = sas_train_flops_executed(
            shape, rows, labelled, relative_rows=model.sas.relative_rows_used(seq)
        )
    # ELECTRA-small (build_electra): the discriminator with its RTD head on every token, the
    # generator (hidden 64, the tied 128-wide embeddings) with its MLM head on the labelled.
    disc = EncoderShape(layers=12, hidden=256, ffn=1024, heads=4, head_size=64,
                        embedding_size=128, vocab_size=VOCAB, seq_length=seq)  # fmt: skip
    gen = dataclasses.replace(generator_shape(disc, divisor=4), embedding_size=128)
    flops["ELECTRA-small"] = 3.0 * (
        sas_forward_flops(disc, rows, 0) + sas_forward_flops(gen, rows, labelled, rtd=False)
    )
    return flops


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_sas_step",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="Also time SAS-small and SAS^DA-small with torch.compile'd layers (--compile).",
    )
    parser.add_argument("--memory-batch", type=int, default=2)
    parser.add_argument("--memory-seq-length", type=int, default=512)
    add_common_args(parser, repeats=3, steps=3, warmup=1)
    args = parser.parse_args(argv)
    device = setup(args)
    g = torch.Generator().manual_seed(0)
    batch = sas_batch(args.batch, args.seq_length, g)
    batch["original"] = torch.where(
        batch["mlm_labels"] >= 0, batch["mlm_labels"], batch["input_ids"]
    )
    host = SasForPretraining.host_layout(batch)  # what the recipe's collate wrapper adds
    batch = {**{k: v.to(device) for k, v in batch.items()}, HOST_KEY: host}
    dtype = model_dtype(args, device)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32, the training default (--tf32)

    gen, disc = build_electra()
    gen, disc = gen.to(device, dtype), disc.to(device, dtype)
    electra_params = {id(p): p for m in (gen, disc) for p in m.parameters()}
    opt_e = torch.optim.AdamW(list(electra_params.values()), lr=1e-4)
    steps = {"ELECTRA-small": lambda: electra_step(gen, disc, opt_e, batch)}
    sas_models = {}
    variants = [("SAS-small", False, False), ("SAS^DA-small", True, False)]
    if args.compile:
        variants += [("SAS-small+compile", False, True), ("SAS^DA-small+compile", True, True)]
    for name, da, compiled in variants:
        model = build_sas(da, compile=compiled).to(device, dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        steps[name] = lambda m=model, o=opt: sas_step(m, o, batch)
        sas_models[name] = model

    for _ in range(args.warmup):  # the first warm-up compiles
        for step in steps.values():
            step()
    times = interleaved_times(steps, args.repeats, args.steps, device, args.clock)
    tokens = args.batch * args.seq_length
    print(
        f"batch {args.batch} x seq {args.seq_length} on {device}, {torch.get_num_threads()} "
        f"threads, clock={args.clock}, {args.repeats} repeats x {args.steps} steps"
    )
    electra = times["ELECTRA-small"]
    peak, peak_note = compute_peak(device, dtype)
    print(f"dtype {dtype}; MFU against: {peak_note}")
    labelled = int((batch["mlm_labels"] >= 0).sum())
    flops = step_flops(args.batch, args.seq_length, labelled, sas_models)
    for name, ts in times.items():
        t = sorted(ts)[len(ts) // 2]
        f = flops[name]
        print(f"  {name:22s} {1000 * t:8.1f} ms/step  {tokens / t:9.0f} tokens/s  "
              f"MFU {f / t / peak:6.1%}  per-repeat ms {[round(1000 * x) for x in ts]}")  # fmt: skip

    rows = [
        ratio_row(
            "sas_small_vs_electra_small_step_time",
            times["SAS-small"],
            electra,
            GOAL,
            "<=",
            "SAS-small / ELECTRA-small step time",
        ),  # fmt: skip
        ratio_row(
            "sas_da_small_vs_electra_small_step_time",
            times["SAS^DA-small"],
            electra,
            None,
            "<=",
            "SAS^DA-small / ELECTRA-small step time",
        ),  # fmt: skip
    ]
    if args.compile:
        for name in ("SAS-small", "SAS^DA-small"):
            metric = name.lower().replace("^", "_").replace("-", "_")
            rows.append(
                ratio_row(
                    f"{metric}_compiled_vs_eager_step_time",
                    times[f"{name}+compile"],
                    times[name],
                    None,
                    "<=",
                    f"{name} --compile / eager step time",
                )  # fmt: skip
            )
        rows.append(
            ratio_row(
                "sas_small_compiled_vs_electra_small_step_time",
                times["SAS-small+compile"],
                electra,
                GOAL,
                "<=",
                "SAS-small --compile / ELECTRA-small step time",
            )  # fmt: skip
        )
    if args.memory:
        mem = encoder_memory(args.memory_batch, args.memory_seq_length, device)
        for name, m in mem.items():
            print(f"peak activation memory {name} encoder: {m / 1024:.0f} KiB/token")
        for ours, peer in (("SAS-base", "ELECTRA-base"), ("SAS^DA-base", "DeBERTa-base")):
            metric = f"{ours}_vs_{peer}_peak_memory_per_token".lower()
            metric = metric.replace("^", "_").replace("-", "_")
            rows.append(
                dict(
                    metric=metric,
                    value=mem[ours] / mem[peer],
                    goal=None,
                    op="<=",
                    unit="x",
                    note=f"encoder forward + backward, peak activation bytes per token "
                    f"(weight grads excluded) at batch {args.memory_batch} x seq "
                    f"{args.memory_seq_length}: {mem[ours] / 1024:.0f} vs "
                    f"{mem[peer] / 1024:.0f} KiB",
                )  # fmt: skip
            )
    report(args, "bench_sas_step.py", rows, f"small batch {args.batch} x seq {args.seq_length}")
    if args.profile:
        profiled = {k: steps[k] for k in ("SAS-small", "ELECTRA-small")}
        profile_table(args.profile, profiled, f"batch {args.batch} x seq {args.seq_length}")


if __name__ == "__main__":
    main()
