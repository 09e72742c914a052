"""TACO's transformers code (models/taco/hf_remote) against our TacoForPretraining at tp=1, in
float64, with every weight moved away from its init (biases, LayerNorms and PReLU slopes
included, so that a dropped or misplaced one shows) on the collator's batch layout: padded
rows, masked positions (-1) and shuffled positions. The exported checkpoint itself is tested
end to end in tests/e2e/test_export_hf.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron_taco.models.taco.hf import hf_config_kwargs, hf_state_dict
from tests.helpers import build, make_batch, tiny_config

pytest.importorskip("transformers")
from megatron_taco.models.taco.hf_remote import modeling_taco as hf
from megatron_taco.models.taco.hf_remote.configuration_taco import TacoConfig

REMOTE = Path(hf.__file__).parent
RTOL = 1e-10  # float64 on both sides


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    scale = b.abs().max().item()
    assert scale > 1e-3, f"{what}: reference too small to test ({scale})"
    err = (a - b).abs().max().item()
    assert err <= RTOL * scale, f"{what}: max error {err:.3e} vs scale {scale:.3e}"


@pytest.fixture(scope="module")
def pair():
    """(ours, hf TacoForMaskedLM) with the same weights, float64, eval mode."""
    config = tiny_config(hidden_dropout=0.0, attention_dropout=0.0)
    ours = build(config, seed=3).double().eval()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    # float64 before loading, so that the weights are not rounded to float32 on the way.
    theirs = hf.TacoForMaskedLM(TacoConfig(**hf_config_kwargs(config))).double()
    theirs.load_state_dict(hf_state_dict(config, ours.state_dict()), strict=True)
    return ours, theirs.eval()


def our_logits(ours, batch):
    """Our encoder, then our heads' pieces on every token: ([b, s, H], MLM [b, s, V], MPM
    [b, s, P])."""
    config, heads, emb = ours.config, ours.heads, ours.taco.embeddings
    we, pe = ours.taco(batch["input_ids"], batch["position_ids"], batch["attention_mask"])
    h = torch.cat([we, pe], dim=-1)
    vocab, positions = config.vocab_size, config.max_position_embeddings
    mlm = F.linear(
        heads.mlm_transform(h), emb.word_embeddings.weight[:vocab], heads.mlm_bias[:vocab]
    )
    mpm = F.linear(heads.mpm_transform(h), emb.position_embeddings[:positions], heads.mpm_bias)
    return h, mlm, mpm


def test_remote_code_imports_only_torch_and_transformers():
    allowed = {"__future__", "math", "dataclasses", "torch", "transformers"}
    for name in ("configuration_taco.py", "modeling_taco.py"):
        tree = ast.parse((REMOTE / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: only the configuration, copied alongside
                    assert node.module == "configuration_taco", (name, node.module)
                    continue
                roots = {node.module.split(".")[0]}
            else:
                continue
            assert roots <= allowed, f"{name} imports {roots - allowed}"


def test_hidden_states_and_mlm_mpm_logits_equal_ours(pair):
    ours, theirs = pair
    batch = make_batch(b=2, s=24, seed=5)
    real = batch["attention_mask"]
    assert not real.all() and (batch["position_ids"] < 0).any()
    with torch.no_grad():
        h, mlm, mpm = our_logits(ours, batch)
        out = theirs(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            output_hidden_states=True,
        )
    assert_close(out.hidden_states[-1][real], h[real], "hidden states")
    assert_close(out.logits[real], mlm[real], "MLM logits")
    assert_close(out.position_logits[real], mpm[real], "MPM logits")
    assert len(out.hidden_states) == ours.config.num_layers + 1


def test_pretraining_loss_equals_ours(pair):
    # The batch's MLM labels sit in rows [0, b), its MPM labels in rows [b, 2b): the sum of
    # the two means is our pre-training loss.
    ours, theirs = pair
    batch = make_batch(b=2, s=24, seed=6)
    with torch.no_grad():
        ref = ours(batch)["loss"]
        out = theirs(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            labels=batch["mlm_labels"],
            position_labels=batch["mpm_labels"],
        )
    assert torch.isclose(out.loss.double(), ref, rtol=1e-6), (out.loss, ref)
    none = torch.full_like(batch["mlm_labels"], -100)
    with torch.no_grad():
        empty = theirs(input_ids=batch["input_ids"], labels=none, position_labels=none).loss
    assert empty.item() == 0.0  # no labelled token: 0, not NaN


def test_default_position_ids_count_real_tokens_on_either_padding_side(pair):
    _, theirs = pair
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(5, 97, (1, 10), generator=g)
    pad = torch.zeros(1, 4, dtype=torch.long)
    right = torch.cat([ids, pad], dim=1)
    left = torch.cat([pad, ids], dim=1)
    mask_r, mask_l = (right != 0).long(), (left != 0).long()
    assert hf.default_position_ids(mask_r).tolist() == [[*range(10), 0, 0, 0, 0]]
    assert hf.default_position_ids(mask_l).tolist() == [[0, 0, 0, 0, *range(10)]]
    with torch.no_grad():
        a = theirs.taco(right, attention_mask=mask_r).last_hidden_state[0, :10]
        b = theirs.taco(left, attention_mask=mask_l).last_hidden_state[0, 4:]
        c = theirs.taco(ids).last_hidden_state[0]
    assert_close(b, a, "left vs right padding")
    assert_close(c, a, "unpadded vs padded")


def test_task_heads_read_the_complete_representation(pair):
    ours, theirs = pair
    config = theirs.config
    encoder = {k: v for k, v in theirs.state_dict().items() if k.startswith("taco.")}
    batch = make_batch(b=2, s=24, seed=8)
    ids, mask, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    with torch.no_grad():
        h, _, _ = our_logits(ours, batch)  # [2b, s, H]
    for cls, head in (
        (hf.TacoForSequenceClassification, "classifier"),
        (hf.TacoForQuestionAnswering, "qa_outputs"),
        (hf.TacoForMultipleChoice, "classifier"),
    ):
        model = cls(config).double().eval()
        missing, unexpected = model.load_state_dict(encoder, strict=False)
        assert sorted(missing) == [f"{head}.bias", f"{head}.weight"] and not unexpected
        linear = getattr(model, head)
        with torch.no_grad():
            if cls is hf.TacoForMultipleChoice:
                # 2 questions x 2 options: rows (0, 1) and (2, 3) of the batch.
                out = model(ids.view(2, 2, -1), mask.view(2, 2, -1), pos.view(2, 2, -1))
                assert_close(out.logits, linear(h[:, 0]).view(2, 2), "multiple choice")
            elif cls is hf.TacoForQuestionAnswering:
                out = model(ids, mask, pos)
                span = linear(h)
                real = mask.bool()
                assert_close(out.start_logits[real], span[..., 0][real], "QA start")
                assert_close(out.end_logits[real], span[..., 1][real], "QA end")
            else:
                out = model(ids, mask, pos)
                assert_close(out.logits, linear(h[:, 0]), "sequence classification")


def test_a_parameter_without_an_export_rule_fails_the_export(pair):
    ours, _ = pair
    state = dict(ours.state_dict())
    state["taco.layers.0.attention.new_gate"] = torch.zeros(3)
    with pytest.raises(KeyError, match="new_gate"):
        hf_state_dict(ours.config, state)
