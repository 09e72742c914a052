"""SAS's first training steps equal an independent implementation of its objective.

The reference (benchmarks/learning/peers.py: transformers' ELECTRA encoder and heads, the
losses and RTD labels written from the paper, sharing no code with models/sas) starts from
our SAS's weights (exported by models/sas/hf.py) and both take the same optimizer steps on
the same batches of our collator, built from the bundled corpus: epoch 1, cold-start
replacements at S. In float64, without dropout, every loss and every weight after the steps
must agree to rounding. The reference's optimizer is not ours either: torch's AdamW with
BERT's weight-decay groups by name and transformers' linear schedule. What this catches that
the equivalence tests of a forward pass do not: a gradient path that differs (a detach, a
wrong tie, a loss term's weight or mean), an optimizer group that differs (weight decay on
a LayerNorm or a bias: optim.py's split_weight_decay deciding it for both sides passed),
an RTD label taken from the wrong place (a hit counted as replaced, padding in the mean).
"""

from __future__ import annotations

import torch

STEPS, BATCH, SEQ = 4, 8, 64


def _batches(demo_dataset, tokenizer):
    from megatron_taco.data.config import DataConfig
    from megatron_taco.data.sas_collator import (
        ColdStart,
        ReplacementConfig,
        SasCollator,
        cold_start_probs,
    )
    from megatron_taco.recipes.sas import make_instances

    data = DataConfig(data_path=(demo_dataset["prefix"],), tokenizer_model=demo_dataset["tokenizer"],
                      split="90,5,5", seq_length=SEQ, seed=7,
                      data_cache_path=str(demo_dataset["dir"] / "cache"))  # fmt: skip
    instances = make_instances(data, tokenizer, BATCH, 0, train_samples=STEPS * BATCH)
    replacement = ReplacementConfig()
    probs = cold_start_probs(replacement, data.prefixes, data.weights, tokenizer.is_special_mask())
    collator = SasCollator(pad_id=tokenizer.pad_id, seq_length=SEQ, seed=7, config=replacement,
                           source=ColdStart(probs, 7))  # fmt: skip
    train = instances.train
    return [collator([train[g] for g in range(k * BATCH, (k + 1) * BATCH)]) for k in range(STEPS)]


def _pair(vocab: int):
    from benchmarks.learning.peers import SasObjective, Size
    from megatron_taco.models.sas.config import SasConfig
    from megatron_taco.models.sas.hf import electra_config_and_state
    from megatron_taco.models.sas.model import SasForPretraining
    from megatron_taco.parallel.state import single_process_state

    torch.manual_seed(0)
    # SAS-tiny's shape with embedding 32 != hidden 48 (the projection is exercised).
    config = SasConfig.preset("tiny", vocab_size=vocab, hidden_dropout=0.0, attention_dropout=0.0,
                              max_position_embeddings=SEQ)  # fmt: skip
    ours = SasForPretraining(config, single_process_state()).double()
    ref = SasObjective(vocab, Size(layers=config.num_layers, hidden=config.hidden_size,
                                   heads=config.num_attention_heads, ffn=config.ffn_hidden_size,
                                   max_positions=SEQ), embedding=config.embedding_size)  # fmt: skip
    ref.electra.config.hidden_dropout_prob = 0.0
    for m in ref.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    ref = ref.double()
    _, state = electra_config_and_state(config, ours.state_dict())
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and missing == [], (missing, unexpected)
    return ours, ref, config


LR, WARMUP, WEIGHT_DECAY, CLIP = 2e-3, 1, 0.01, 1.0


def _our_optimizer(model):
    from megatron_taco.training.config import TrainingConfig
    from megatron_taco.training.optim import build_optimizer, build_scheduler

    training = TrainingConfig(train_iters=STEPS, micro_batch_size=BATCH, global_batch_size=BATCH,
                              lr=LR, lr_warmup_iters=WARMUP, weight_decay=WEIGHT_DECAY,
                              clip_grad=CLIP)  # fmt: skip
    optimizer, _ = build_optimizer(model, training)
    return optimizer, build_scheduler(optimizer, training)


def _reference_optimizer(model):
    """BERT's AdamW recipe as transformers' examples write it, not our optim.py: no weight
    decay on biases and LayerNorm weights (by name), linear warm-up then linear decay to 0
    (transformers' scheduler)."""
    from transformers import get_linear_schedule_with_warmup

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    exempt = [p for n, p in named if n.endswith("bias") or "LayerNorm" in n]
    decayed = [p for n, p in named if not (n.endswith("bias") or "LayerNorm" in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decayed, "weight_decay": WEIGHT_DECAY}, {"params": exempt, "weight_decay": 0.0}],
        lr=LR, betas=(0.9, 0.999), eps=1e-6, foreach=False,
    )  # fmt: skip
    return optimizer, get_linear_schedule_with_warmup(optimizer, WARMUP, STEPS)


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    # Relative to the tensor's magnitude, with a floor for tensors that stay at ~0 (a key
    # bias has no gradient through the softmax: only rounding moves it, to ~1e-20).
    a, b = a.detach(), b.detach()
    scale = max(float(a.abs().max()), 1e-8)
    err = float((a - b).abs().max())
    assert err <= 1e-10 * scale, f"{what}: max |difference| {err:.3g} at magnitude {scale:.3g}"


def test_sas_first_steps_equal_the_independent_objective_in_float64(demo_dataset):
    from megatron_taco.data.tokenizer import Tokenizer
    from megatron_taco.models.sas.hf import electra_config_and_state

    tokenizer = Tokenizer(demo_dataset["tokenizer"])
    batches = _batches(demo_dataset, tokenizer)
    ours, ref, config = _pair(tokenizer.vocab_size)
    # lambda of epoch 2 of 5 by each side's own schedule (not the model's default 50).
    from benchmarks.learning.peers import rtd_weight
    from megatron_taco.recipes.sas import RtdScheduleConfig

    ours.set_rtd_weight(RtdScheduleConfig().weight(1, 5))
    ref.rtd_weight = rtd_weight(1, 5)
    assert ours.rtd_weight == ref.rtd_weight == 87.5
    steppers = [_our_optimizer(ours), _reference_optimizer(ref)]
    replaced = hits = padding = 0
    for k, batch in enumerate(batches):
        outs = []
        for model, (optimizer, scheduler) in zip((ours, ref), steppers):
            out = model(batch)
            out["loss"].backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            outs.append(out)
        for key in ("loss", "mlm_loss", "rtd_loss"):
            _close(outs[0][key].detach(), outs[1][key], f"step {k + 1} {key}")
        in_s = batch["mlm_labels"] != -100
        replaced += int((batch["rtd_labels"] == 1).sum())
        hits += int((in_s & (batch["input_ids"] == batch["mlm_labels"])).sum())
        padding += int((~batch["attention_mask"].bool()).sum())
        assert not (batch["input_ids"] == tokenizer.mask_id).any()  # SAS never reads [MASK]
    # The batches hold what the comparison must see: real replacements, a replacement equal
    # to the original (RTD label 0 by eq. 5; counting it as replaced fails here) and padding
    # (outside the RTD mean; counting it fails here).
    assert replaced > 100 and hits >= 1 and padding > 0, (replaced, hits, padding)
    _, after = electra_config_and_state(config, ours.state_dict())
    theirs = ref.state_dict()
    for name, tensor in after.items():
        _close(tensor, theirs[name], f"after {STEPS} steps: {name}")
    # The steps moved the weights: equal after is not equal because nothing changed.
    _, before = electra_config_and_state(config, _pair(tokenizer.vocab_size)[0].state_dict())
    moved = [n for n in before if not torch.equal(before[n], after[n])]
    assert len(moved) > 0.9 * len(before)
