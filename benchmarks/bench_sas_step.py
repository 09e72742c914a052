"""Step time of SAS-small against transformers' ELECTRA-small, side by side in one run.

One SAS step: encoder + MLM head at the replaced positions + RTD head, the loss, backward,
AdamW, and the self-augmentation draw from the MLM logits (inverse CDF). One ELECTRA step
(the peer SAS replaces): generator MLM forward (hidden / 4, embeddings tied, generator head
on the masked positions only, as ELECTRA's own code does), sampling the replacements from
its softmax, discriminator forward with its RTD head, loss = MLM + 50 RTD, backward, AdamW.
Same batch and sequence length. The models are timed alternately, several repeats each,
so machine load drifts hit all alike; medians are reported.

    python benchmarks/bench_sas_step.py                 # batch 16 x seq 128, target <= 0.7
    python benchmarks/bench_sas_step.py --batch 32 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics

import torch
from timing import sync, time_steps

from megatron_taco.models.sas.config import SasConfig
from megatron_taco.models.sas.model import SasForPretraining
from megatron_taco.parallel.sampling import vocab_parallel_sample
from megatron_taco.parallel.state import single_process_state

VOCAB = 30522
TARGET = 0.7


def sas_batch(b: int, s: int, g: torch.Generator) -> dict:
    ids = torch.randint(5, VOCAB, (b, s), generator=g)
    pick = torch.rand(b, s, generator=g) < 0.15
    mlm = torch.where(pick, ids, torch.full_like(ids, -100))
    replaced = ids.clone()
    replaced[pick] = torch.randint(5, VOCAB, (int(pick.sum()),), generator=g)
    rtd = (replaced != ids).long()
    mask = torch.ones(b, s, dtype=torch.bool)
    return dict(input_ids=replaced, attention_mask=mask, mlm_labels=mlm, rtd_labels=rtd)


def build_sas(disentangled: bool):
    torch.manual_seed(0)
    config = SasConfig.preset("small", vocab_size=VOCAB, disentangled_attention=disentangled)
    return SasForPretraining(config, single_process_state())


def sas_step(model, optimizer, batch) -> None:
    out = model(batch)
    out["loss"].backward()
    # The self-augmentation draw SAS adds to a step (one token per replaced position).
    vocab_parallel_sample(
        out["mlm_logits"],
        None,
        vocab_size=VOCAB,
        row_keys=torch.arange(out["mlm_logits"].shape[0]),
        seed=1,
    )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def build_electra():
    from transformers import ElectraConfig, ElectraForMaskedLM, ElectraForPreTraining

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, embedding_size=128, max_position_embeddings=512)
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="Timed steps per repeat.")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    batch = sas_batch(args.batch, args.seq_length, g)
    batch["original"] = torch.where(
        batch["mlm_labels"] >= 0, batch["mlm_labels"], batch["input_ids"]
    )
    batch = {k: v.to(device) for k, v in batch.items()}

    sas, sas_da = build_sas(False).to(device), build_sas(True).to(device)
    gen, disc = build_electra()
    gen, disc = gen.to(device), disc.to(device)
    electra_params = {id(p): p for m in (gen, disc) for p in m.parameters()}
    steps = {
        "SAS-small": (sas_step, sas, torch.optim.AdamW(sas.parameters(), lr=1e-4)),
        "SAS^DA-small": (sas_step, sas_da, torch.optim.AdamW(sas_da.parameters(), lr=1e-4)),
        "ELECTRA-small": (
            lambda _m, opt, b: electra_step(gen, disc, opt, b),
            None,
            torch.optim.AdamW(list(electra_params.values()), lr=1e-4),
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in steps}
    for fn, model, opt in steps.values():  # warm-up
        fn(model, opt, batch)
    sync(device)
    for _ in range(args.repeats):
        for name, (fn, model, opt) in steps.items():
            times[name].append(
                time_steps(lambda f=fn, m=model, o=opt: f(m, o, batch), args.steps, device)
            )
    tokens = args.batch * args.seq_length
    print(f"batch {args.batch} x seq {args.seq_length} on {device}, {args.repeats} repeats")
    electra = statistics.median(times["ELECTRA-small"])
    for name in steps:
        t = statistics.median(times[name])
        print(f"  {name:14s} {1000 * t:8.1f} ms/step  {tokens / t:9.0f} tokens/s  "
              f"step time vs ELECTRA-small: {t / electra:.2f}x")  # fmt: skip
    ratio = statistics.median(times["SAS-small"]) / electra
    print(f"SAS-small / ELECTRA-small step time: {ratio:.2f} (target <= {TARGET})")


if __name__ == "__main__":
    main()
