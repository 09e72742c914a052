"""tools/export_hf.py on checkpoints written at tensor-parallel size 2 by the real training
driver (real DeepSpeed engines on gloo ranks): SAS (ZeRO-2 fp32) exports to ELECTRA and
SAS^DA (ZeRO-1 bf16, fp32 master weights) to DeBERTa-v2. transformers loads each export
(model, MLM head, RTD head, AutoTokenizer) and, on the same input, its encoder states, RTD
logits and MLM logits equal those of our model built at tp=1 from the consolidated
checkpoint (float32; tolerance relative to the largest value). The exported tokenizer
encodes like ours. TACO (trained at tp=2, ZeRO-1 bf16) exports
with its own modeling code: loaded by the Auto classes with trust_remote_code=True while
megatron_taco cannot be imported, its hidden states and MLM/MPM logits equal ours on a
padded batch in float64, and the task models miss only their new head.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron_taco.checkpoint.reshard import ModelLayout
from megatron_taco.cli.export_hf import main as export_main
from megatron_taco.cli.export_hf import save_tokenizer
from megatron_taco.data.tokenizer import Tokenizer
from megatron_taco.models.sas.model import SasForPretraining
from megatron_taco.parallel.state import single_process_state
from megatron_taco.recipes.registry import read_checkpoint
from tests.helpers import launch

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.e2e

RTOL = 2e-6
TEXTS = [
    "I had not been long in the school when the principal sent for me.",
    "He said [MASK] twice,  and left «the café» at noon",
]


def train_tp2(dataset, save: Path, *extra: str, script: str = "pretrain_sas.py") -> Path:
    """2 iterations at tensor parallel 2 on 2 ranks, a checkpoint at the last."""
    argv = [
        "--model-size", "tiny", "--seq-length", "64", "--tensor-model-parallel-size", "2",
        "--data-path", dataset["prefix"], "--tokenizer-model", dataset["tokenizer"],
        "--data-cache-path", str(dataset["dir"] / "cache"), "--split", "80,10,10",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
        "--lr", "1e-3", "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters", "0",
        "--num-workers", "0", "--save", str(save), "--save-interval", "2", *extra,
    ]  # fmt: skip
    launch(script, *argv, world=2)
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


def inputs(out: Path, tokenizer_model: str, **kwargs):
    tok = transformers.AutoTokenizer.from_pretrained(str(out), **kwargs)
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


def loaded(cls, out: Path, **kwargs):
    model, info = cls.from_pretrained(str(out), output_loading_info=True, **kwargs)
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


# ---------------------------------------------------------------------------------------
# TACO: its own modeling code (trust_remote_code=True)

TACO_RTOL = 1e-10  # float64 on both sides
TACO_HEADS = {
    "AutoModelForSequenceClassification": "classifier",
    "AutoModelForQuestionAnswering": "qa_outputs",
    "AutoModelForMultipleChoice": "classifier",
}


@pytest.fixture(scope="module")
def taco_tp2(botchan_dataset, tmp_path_factory) -> Path:
    """TACO trained 2 steps at tp=2 by the real driver on 2 ranks (ZeRO-1, bf16 with fp32
    master weights)."""
    save = tmp_path_factory.mktemp("taco") / "run"
    return train_tp2(botchan_dataset, save, "--deepspeed-config", "ds_configs/zero1_bf16.json",
                     script="pretrain_taco.py")  # fmt: skip


@contextmanager
def without_megatron_taco():
    """Any import of megatron_taco inside fails, as on a machine without our package. (Only
    our entries are put back afterwards: modules imported meanwhile stay loaded.)"""
    saved = {n: m for n, m in sys.modules.items() if n.split(".")[0] == "megatron_taco"}
    sys.modules.update(dict.fromkeys(saved))
    try:
        yield
    finally:
        sys.modules.update(saved)


def our_taco_outputs(load: Path, ids, mask):
    """Our TACO at tp=1 from the checkpoint, float64: ([b, s, H], MLM, MPM logits)."""
    from megatron_taco.models.taco.model import TacoForPretraining

    # optimizer=True: under ZeRO 1-2 the fp32 master weights live in the optimizer's
    # shards; the model files hold only their bf16 copies.
    states, config, build = read_checkpoint(str(load))
    (state_dict,) = ModelLayout(build, 1, config.vocab_size).split(states.full_state_dict())
    config = dataclasses.replace(config, hidden_dropout=0.0, attention_dropout=0.0)
    model = TacoForPretraining(config, single_process_state()).double()
    model.load_state_dict(state_dict, strict=True)
    model.eval()
    heads, emb = model.heads, model.taco.embeddings
    vocab, positions = config.vocab_size, config.max_position_embeddings
    # As the collator lays positions out: 0, 1, ... over the real tokens, 0 on padding.
    pos = torch.arange(ids.shape[1]).expand_as(ids) * mask
    with torch.no_grad():
        h = torch.cat(model.taco(ids, pos, mask.bool()), dim=-1)
        mlm = F.linear(
            heads.mlm_transform(h), emb.word_embeddings.weight[:vocab], heads.mlm_bias[:vocab]
        )
        mpm = F.linear(heads.mpm_transform(h), emb.position_embeddings[:positions], heads.mpm_bias)
    return h, mlm, mpm


def assert_close64(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype == torch.float64, what
    scale = b.abs().max().item()
    assert scale > 1e-3, f"{what}: reference too small to test ({scale})"
    err = (a - b).abs().max().item()
    assert err <= TACO_RTOL * scale, f"{what}: max error {err:.3e} vs scale {scale:.3e}"


def test_taco_exports_with_its_own_modeling_code(taco_tp2, botchan_dataset, tmp_path):
    out = tmp_path / "taco"
    export(taco_tp2, out)
    files = {p.name for p in out.iterdir()}
    assert {"configuration_taco.py", "modeling_taco.py", "model.safetensors"} <= files
    assert {"tokenizer.json", "tokenizer_config.json", "spm.model"} <= files
    meta = json.loads((out / "config.json").read_text())
    assert meta["model_type"] == "taco" and meta["architectures"] == ["TacoForMaskedLM"]
    assert set(meta["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForMaskedLM", *TACO_HEADS}

    # AutoTokenizer reads config.json too, whose AutoConfig is remote code: without
    # trust_remote_code=True it would ask on the terminal.
    ids, mask = inputs(out, botchan_dataset["tokenizer"], trust_remote_code=True)
    tok = transformers.AutoTokenizer.from_pretrained(str(out), trust_remote_code=True)
    assert "token_type_ids" not in tok(TEXTS[0])  # TACO has no segment embeddings
    assert not mask.all()  # a padded batch
    h, mlm, mpm = our_taco_outputs(taco_tp2, ids, mask)
    real = mask.bool()

    auto = transformers
    with without_megatron_taco():
        config = auto.AutoConfig.from_pretrained(str(out), trust_remote_code=True)
        assert config.hidden_size == h.shape[-1]
        base = loaded(auto.AutoModel, out, trust_remote_code=True).double()
        masked_lm = loaded(auto.AutoModelForMaskedLM, out, trust_remote_code=True).double()
        with torch.no_grad():
            ref = base(input_ids=ids, attention_mask=mask).last_hidden_state
            ref_lm = masked_lm(input_ids=ids, attention_mask=mask)
        for name, head in TACO_HEADS.items():
            cls = getattr(auto, name)
            model, info = cls.from_pretrained(
                str(out), trust_remote_code=True, output_loading_info=True
            )
            # Only the new head is missing; the pre-training heads are dropped silently.
            assert sorted(info["missing_keys"]) == [f"{head}.bias", f"{head}.weight"], name
            assert not info["unexpected_keys"] and not info["mismatched_keys"], (name, info)
        model = model.double().eval()  # multiple choice: one question, the batch's options
        with torch.no_grad():
            choice = model(input_ids=ids[None], attention_mask=mask[None]).logits
    assert_close64(ref[real], h[real], "hidden states")
    assert_close64(ref_lm.logits[real], mlm[real], "MLM logits")
    assert_close64(ref_lm.position_logits[real], mpm[real], "MPM logits")
    assert_close64(choice[0], model.classifier(h[:, 0]).squeeze(-1).detach(), "choice logits")


# Accents (composed and decomposed), emoji (with a skin tone and a ZWJ family), CJK, Hangul,
# full-width forms, repeated and odd spaces, specials glued to words.
HARD_TEXTS = [
    "naïve café, Ünïcödé ÀÉÎÕÜ ñ ç ß ø å æ œ and decomposed: cafe\u0301",
    "emoji 😀😀 and 👍🏽 family 👨\u200d👩\u200d👧 here",
    "日本語のテキスト、中文文本。한국어 텍스트",
    "repeated     spaces,\ttabs,\u00a0nbsp and\u3000ideographic space   ",
    "ＦＵＬＬＷＩＤＴＨ ｶﾀｶﾅ ﬁ Ⅻ 1234567890 3.14 $100 50%",
    "x[MASK]y [CLS] a [SEP] b",
]


@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
@pytest.mark.parametrize("byte_fallback", [True, False])
def test_autotokenizer_gives_our_ids(tmp_path, botchan_path, model_type, byte_fallback):
    from megatron_taco.cli.train_tokenizer import TrainTokenizerConfig, train_tokenizer

    model = train_tokenizer(
        TrainTokenizerConfig(
            input=(str(botchan_path),),
            model_prefix=str(tmp_path / "spm"),
            vocab_size=800,
            model_type=model_type,
            byte_fallback=byte_fallback,
            num_threads=1,
        )
    )
    (tmp_path / "hf").mkdir()
    save_tokenizer(model, str(tmp_path / "hf"), 128)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ref = Tokenizer(model)
    lines = botchan_path.read_text(encoding="utf-8").splitlines()[:100]
    for text in [*HARD_TEXTS, *lines]:
        ids = ref.encode(text)
        assert tok(text, add_special_tokens=False)["input_ids"] == ids, text
        if byte_fallback:  # every character survives: both decode to the same text
            assert (ref.unk_id in ids) is False, text
            assert tok.decode(ids) == ref.decode(ids), text
    assert tok("a b")["input_ids"] == [2, *ref.encode("a b"), 3]


def test_checkpoint_whose_tokenizer_is_gone_is_one_line(tmp_path, capsys):
    iter_dir = tmp_path / "ckpt" / "iter_0000002"
    iter_dir.mkdir(parents=True)
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("2\n")
    from megatron_taco.checkpoint.layout import FORMAT
    from megatron_taco.checkpoint.manifest import write_metadata as _write_metadata

    meta = {"format": FORMAT, "iteration": 2, "consumed_samples": 8, "world_size": 1,
            "tensor_model_parallel_size": 1, "data_parallel_size": 1, "model": "TACO",
            "configs": {}}  # fmt: skip
    _write_metadata(str(iter_dir), meta, {})
    with pytest.raises(SystemExit) as info:  # a config error: usage line + one error line
        export_main(["--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "o")])
    assert info.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(err) == 1 and "--tokenizer-model" in err[0] and "metadata.json" in err[0], err
    assert not (tmp_path / "o").exists()
