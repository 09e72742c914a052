"""The step benchmarks' synthetic pretraining batches (bench_sas_step, bench_taco_step and
bench_finetune's fine-tuning-vs-pretraining rows time steps on them)."""

from __future__ import annotations

import torch

from megatron_taco.models.common.host import HOST_KEY
from megatron_taco.models.taco.model import TacoForPretraining

VOCAB = 30522  # BERT's vocabulary, the step benchmarks' size


def sas_batch(b: int, s: int, g: torch.Generator, vocab: int = VOCAB) -> dict:
    """A SAS batch: 15% of the tokens replaced by random ones, RTD labels where they differ."""
    ids = torch.randint(5, vocab, (b, s), generator=g)
    pick = torch.rand(b, s, generator=g) < 0.15
    mlm = torch.where(pick, ids, torch.full_like(ids, -100))
    replaced = ids.clone()
    replaced[pick] = torch.randint(5, vocab, (int(pick.sum()),), generator=g)
    rtd = (replaced != ids).long()
    mask = torch.ones(b, s, dtype=torch.bool)
    return dict(input_ids=replaced, attention_mask=mask, mlm_labels=mlm, rtd_labels=rtd)


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
    host = TacoForPretraining.host_layout(batch)  # what the recipe's collate wrapper adds
    return {**{k: v.to(device) for k, v in batch.items()}, HOST_KEY: host}
