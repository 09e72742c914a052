"""The peers' training loop, one process per peer (transformers' BERT and ELECTRA, SAS's
objective on transformers' ELECTRA encoder): the batches, optimizer, schedule, clipping and
held-out evaluation our driver uses, and its metrics records.

    python -m benchmarks.learning.peer_loop MODEL SETTING_JSON METRICS_FILE

(started by benchmarks/learning/runs.py; SETTING_JSON is a ``Setting`` as JSON).
"""

from __future__ import annotations

import json
import os
import sys
import time

from benchmarks.learning.setting import PARITY, PEERS, Setting


def _peer_data(model: str, s: Setting, tokenizer):
    """(train stream, valid dataset, collator, store or None), as our driver builds them
    (the train stream: a sample dataset, or SAS's instances with their ``train`` view)."""
    from megatron_taco.data.bert_dataset import build_train_valid_test_datasets
    from megatron_taco.data.config import DataConfig

    data = DataConfig(data_path=(s.prefix,), tokenizer_model=s.tokenizer, split=s.split,
                      seq_length=s.seq_length, data_cache_path=s.cache, seed=s.seed,
                      num_workers=0)  # fmt: skip
    eval_samples = s.eval_iters * s.batch
    if model in PARITY:
        return _parity_data(data, s, tokenizer, eval_samples)
    if model != "sas_ref":
        from megatron_taco.data.taco_collator import TacoMaskingCollator

        train, valid, _ = build_train_valid_test_datasets(
            data, tokenizer, (s.iters * s.batch, eval_samples, eval_samples)
        )
        # TACO's collator with TACO-small's position table: its MLM rows are what TACO,
        # BERT and ELECTRA read (the MPM rows are TACO's alone).
        collator = TacoMaskingCollator.from_tokenizer(
            tokenizer, seq_length=s.seq_length, seed=s.seed, num_positions=512
        )
        return train, valid, collator, None
    from benchmarks.learning.peers import SampledStore
    from megatron_taco.data.sas_collator import (
        ReplacementConfig,
        SasCollator,
        cold_start_probs,
        make_cold_start,
    )
    from megatron_taco.recipes.sas import make_instances

    instances = make_instances(data, tokenizer, s.batch, eval_samples,
                               train_samples=s.iters * s.batch)  # fmt: skip
    replacement = ReplacementConfig(cold_start=s.cold_start)
    probs = cold_start_probs(replacement, [s.prefix], [1.0], tokenizer.is_special_mask())
    cold = make_cold_start(replacement, probs, s.seed, mask_id=tokenizer.mask_id)
    store = SampledStore(cold, s.seq_length, seed=s.seed)
    collator = SasCollator(pad_id=tokenizer.pad_id, seq_length=s.seq_length, seed=s.seed,
                           config=replacement, source=store)  # fmt: skip
    return instances, instances.valid, collator, store


def _parity_data(data, s: Setting, tokenizer, eval_samples: int):
    """SAS's instances under BERT's masking at S in every epoch: the reference release's mlm
    cold start (80% [MASK], 10% a uniform random token, 10% kept) as the only source, so S
    is fixed per instance (as SAS needs) and the 80/10/10 draw is redrawn per epoch, seeded
    by (seed, instance, epoch): every parity model reads identical batches and masks."""
    from megatron_taco.data.sas_collator import (
        ReplacementConfig,
        SasCollator,
        cold_start_probs,
        make_cold_start,
    )
    from megatron_taco.recipes.sas import make_instances

    instances = make_instances(
        data, tokenizer, s.batch, eval_samples, train_samples=s.iters * s.batch
    )
    replacement = ReplacementConfig(cold_start="mlm")
    probs = cold_start_probs(replacement, [s.prefix], [1.0], tokenizer.is_special_mask())
    source = make_cold_start(replacement, probs, s.seed, mask_id=tokenizer.mask_id)
    collator = SasCollator(
        pad_id=tokenizer.pad_id,
        seq_length=s.seq_length,
        seed=s.seed,
        config=replacement,
        source=source,
    )
    return instances, instances.valid, collator, None


def evaluate(model, valid, collator, s: Setting) -> dict:
    from megatron_taco.parallel.state import single_process_state
    from megatron_taco.training.loop import evaluate_batches

    batches = (collator([valid[i] for i in range(k, k + s.batch)])
               for k in range(0, s.eval_iters * s.batch, s.batch))  # fmt: skip
    model.eval()
    metrics = evaluate_batches(model, batches, single_process_state(), s.eval_iters)
    model.train()
    return metrics


def run_peer(model: str, s: Setting, metrics_file: str) -> None:
    import torch

    from benchmarks.learning.peers import (
        BertMlm,
        Electra,
        SasMlm,
        SasObjective,
        rtd_weight,
        whole_epochs,
    )
    from megatron_taco.data.tokenizer import Tokenizer
    from megatron_taco.training.optim import build_optimizer, build_scheduler

    torch.manual_seed(s.seed)
    tokenizer = Tokenizer(s.tokenizer)
    stream, valid, collator, store = _peer_data(model, s, tokenizer)
    vocab, size = tokenizer.vocab_size, s.size()
    if model == "electra":  # ELECTRA-small's factorised embedding: half the hidden width
        net = Electra(vocab, size, embedding=size.hidden // 2)
    elif model in ("sas_mlm", "sas_mlm_init02"):
        net = SasMlm(vocab, size, "megatron" if model == "sas_mlm" else "electra")
    elif model in ("bert_mlm", "bert_mlm_scaled"):
        net = BertMlm(vocab, size, all_rows=True, scaled_output_init=model == "bert_mlm_scaled")
    else:
        net = {"bert": BertMlm, "sas_ref": SasObjective}[model](vocab, size)
    training = s.training_config()
    optimizer, _ = build_optimizer(net, training)
    scheduler = build_scheduler(optimizer, training)
    train = stream.train if hasattr(stream, "train") else stream
    epochs = whole_epochs(s.iters * s.batch, stream.count) if store is not None else 1
    started = time.perf_counter()
    with open(metrics_file, "w") as out:
        for it in range(s.iters):
            samples = [train[g] for g in range(it * s.batch, (it + 1) * s.batch)]
            batch = collator(samples)
            if store is not None:
                epoch = int(batch["epoch"][0])
                # The release's mlm cold start: MLM alone in the first epoch.
                first_mlm = epoch == 0 and s.cold_start == "mlm"
                net.rtd_weight = 0.0 if first_mlm else rtd_weight(epoch, epochs)
            result = net(batch)
            result["loss"].backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), training.clip_grad)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if store is not None:
                store.add(batch, result["sas_logits"])
            if (it + 1) % s.eval_interval == 0 or it + 1 == s.iters:
                # Training time only (the evaluations excluded), as our driver's elapsed_ms.
                train_s = time.perf_counter() - started
                record = {
                    "split": "valid",
                    "iteration": it + 1,
                    "train_seconds": train_s,
                    **evaluate(net, valid, collator, s),
                }
                out.write(json.dumps(record) + "\n")
                out.flush()
                # Kept for downstream evaluations at equal FLOPs or wall time.
                torch.save(
                    net.state_dict(),
                    os.path.join(os.path.dirname(metrics_file), f"peer_iter_{it + 1:07d}.pt"),
                )
                started = time.perf_counter() - train_s


def main(argv: list[str] | None = None) -> int:
    model, setting, metrics_file = argv if argv is not None else sys.argv[1:]
    if model not in PEERS:
        raise SystemExit(f"peer_loop: {model} is not a peer ({', '.join(PEERS)})")
    run_peer(model, Setting(**json.loads(setting)), metrics_file)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
