"""tools/export_hf.py on checkpoints written at tensor-parallel size 2 by the real training
driver (real DeepSpeed engines on gloo ranks): SAS (ZeRO-2 fp32) exports to ELECTRA and
SAS^DA (ZeRO-1 bf16, fp32 master weights) to DeBERTa-v2. transformers loads each export
(model, MLM head, RTD head, AutoTokenizer) and, on the same input, its encoder states, RTD
logits and MLM logits equal those of our model built at tp=1 from the consolidated
checkpoint (float32; tolerance relative to the largest value). The exported tokenizer
encodes like ours; TACO checkpoints are refused.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from megatron_taco.cli.export_hf import main as export_main
from megatron_taco.cli.export_hf import save_tokenizer
from megatron_taco.data.tokenizer import Tokenizer
from megatron_taco.models.sas.model import SasForPretraining
from megatron_taco.parallel.state import single_process_state
from megatron_taco.recipes.registry import read_checkpoint
from megatron_taco.training.consolidate import ModelLayout
from tests.helpers import run_distributed

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.e2e

RTOL = 2e-6
TEXTS = [
    "I had not been long in the school when the principal sent for me.",
    "He said [MASK] twice,  and left «the café» at noon",
]


def pretrain(rank: int, world: int, argv: list[str]) -> int:
    from megatron_taco.cli.pretrain_sas import main

    return main(argv)


def train_tp2(dataset, save: Path, *extra: str) -> Path:
    argv = [
        "--model-size", "tiny", "--seq-length", "64", "--tensor-model-parallel-size", "2",
        "--data-path", dataset["prefix"], "--tokenizer-model", dataset["tokenizer"],
        "--data-cache-path", str(dataset["dir"] / "cache"), "--split", "80,10,10",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
        "--lr", "1e-3", "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters", "0",
        "--num-workers", "0", "--save", str(save), "--save-interval", "2", *extra,
    ]  # fmt: skip
    assert run_distributed(pretrain, 2, argv, timeout=240) == [0, 0]
    return save


@pytest.fixture(scope="module")
def sas_tp2(botchan_dataset, tmp_path_factory) -> Path:
    save = tmp_path_factory.mktemp("sas") / "run"
    return train_tp2(botchan_dataset, save, "--deepspeed-config", "ds_configs/zero2_fp32.json")


@pytest.fixture(scope="module")
def sas_da_tp2(botchan_dataset, tmp_path_factory) -> Path:
    save = tmp_path_factory.mktemp("sas_da") / "run"
    return train_tp2(botchan_dataset, save, "--disentangled-attention",
                     "--deepspeed-config", "ds_configs/zero1_bf16.json")  # fmt: skip


def export(load: Path, out: Path) -> None:
    assert export_main(["--load", str(load), "--output", str(out)]) == 0
    meta = json.loads((out / "config.json").read_text())
    assert meta["vocab_size"] == 800 and meta["pad_token_id"] == 0


def ours(load: Path):
    """Our model at tp=1 from the consolidated checkpoint, in eval mode."""
    states, config, build = read_checkpoint(str(load))
    (state_dict,) = ModelLayout(build, 1, config.vocab_size).split(states.full_state_dict())
    config = dataclasses.replace(config, hidden_dropout=0.0, attention_dropout=0.0)
    model = SasForPretraining(config, single_process_state())
    model.load_state_dict(state_dict, strict=True)
    return model.eval(), config


def inputs(out: Path, tokenizer_model: str):
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    ref = Tokenizer(tokenizer_model)
    for text, ids, mask in zip(TEXTS, enc["input_ids"], enc["attention_mask"]):
        assert ids[mask.bool()].tolist() == [2, *ref.encode(text), 3]
    return enc["input_ids"], enc["attention_mask"]


def our_outputs(model, ids, mask):
    with torch.no_grad():
        hidden = model.sas(ids, mask.bool())
        rtd = model.heads.rtd_logits(hidden)
        word = model.sas.embeddings.word_embeddings.weight
        mlm = model.heads.mlm_logits(hidden.flatten(0, 1), word)[:, : model.config.vocab_size]
    return hidden, rtd, mlm


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    scale = b.abs().max().item()
    assert (a - b).abs().max().item() <= RTOL * scale + 1e-7, what


def loaded(cls, out: Path):
    model, info = cls.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    return model.eval()


def test_sas_exports_to_electra(sas_tp2, botchan_dataset, tmp_path):
    out = tmp_path / "electra"
    export(sas_tp2, out)
    ids, mask = inputs(out, botchan_dataset["tokenizer"])
    model, _ = ours(sas_tp2)
    hidden, rtd, mlm = our_outputs(model, ids, mask)
    real = mask.bool()
    disc = loaded(transformers.ElectraForPreTraining, out)
    gen = loaded(transformers.ElectraForMaskedLM, out)
    with torch.no_grad():
        ref = disc(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        ref_mlm = gen(input_ids=ids, attention_mask=mask).logits
    assert_close(hidden[real], ref.hidden_states[-1][real], "hidden states")
    assert_close(rtd[real], ref.logits[real], "RTD logits")  # positive = replaced, as ours
    assert_close(mlm.view(*ids.shape, -1)[real], ref_mlm[real], "MLM logits")


def test_sas_da_exports_to_deberta_v2(sas_da_tp2, botchan_dataset, tmp_path):
    from safetensors.torch import load_file
    from transformers.models.electra.modeling_electra import ElectraDiscriminatorPredictions

    out = tmp_path / "deberta"
    export(sas_da_tp2, out)
    assert (out / "rtd_head.safetensors").is_file()
    ids, mask = inputs(out, botchan_dataset["tokenizer"])
    model, config = ours(sas_da_tp2)
    hidden, rtd, mlm = our_outputs(model, ids, mask)
    real = mask.bool()
    base = loaded(transformers.DebertaV2Model, out)
    masked_lm = loaded(transformers.DebertaV2ForMaskedLM, out)
    head = ElectraDiscriminatorPredictions(
        transformers.ElectraConfig(hidden_size=config.hidden_size, hidden_act="gelu")
    )
    head.load_state_dict(load_file(str(out / "rtd_head.safetensors")), strict=True)
    with torch.no_grad():
        ref = base(input_ids=ids, attention_mask=mask).last_hidden_state
        ref_rtd = head.eval()(ref)
        ref_mlm = masked_lm(input_ids=ids, attention_mask=mask).logits
    assert_close(hidden[real], ref[real], "hidden states")
    assert_close(rtd[real], ref_rtd[real], "RTD logits")
    assert_close(mlm.view(*ids.shape, -1)[real], ref_mlm[real], "MLM logits")


def test_exported_tokenizer_encodes_like_ours(tokenizer_model, botchan_path, tmp_path):
    save_tokenizer(tokenizer_model, str(tmp_path), 128)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ids = [tok.pad_token_id, tok.unk_token_id, tok.cls_token_id, tok.sep_token_id]
    assert [*ids, tok.mask_token_id] == [0, 1, 2, 3, 4] and len(tok) == 800
    ref = Tokenizer(tokenizer_model)
    lines = botchan_path.read_text(encoding="utf-8").splitlines()[:200]
    samples = [*lines, " Leading and trailing  \t", "glued[MASK]word [SEP][SEP]", "ｆｕｌｌ ﬁ Ⅻ"]
    for text in samples:
        assert tok(text, add_special_tokens=False)["input_ids"] == ref.encode(text), text
    assert tok.decode(tok("It was a fine day.")["input_ids"], skip_special_tokens=True) == (
        ref.decode(ref.encode("It was a fine day."))
    )


def test_taco_checkpoint_is_refused(tmp_path, capsys):
    iter_dir = tmp_path / "ckpt" / "iter_0000002"
    iter_dir.mkdir(parents=True)
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("2\n")
    from megatron_taco.training.checkpointing import FORMAT, _write_metadata

    meta = {"format": FORMAT, "iteration": 2, "consumed_samples": 8, "world_size": 1,
            "tensor_model_parallel_size": 1, "data_parallel_size": 1, "model": "TACO",
            "configs": {}}  # fmt: skip
    _write_metadata(str(iter_dir), meta, {})
    with pytest.raises(SystemExit) as info:  # a config error: usage line + one error line
        export_main(["--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "o")])
    assert info.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(err) == 1 and "TACO checkpoint" in err[0] and "--consolidate" in err[0]
    assert not (tmp_path / "o").exists()
