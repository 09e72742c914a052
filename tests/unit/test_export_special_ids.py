"""Every export takes its token ids from the run's tokenizer (cli/export_hf.special_token_ids),
not from BERT's layout: on a WordPiece vocabulary whose [PAD] is not id 0, the exported
config's pad_token_id (the embedding's padding_idx in transformers) and bos / eos ([CLS] /
[SEP]) are the tokenizer's, for TACO, SAS and SAS^DA, pretrained and fine-tuned; and the
exported model, fed a batch that the exported tokenizer padded with that [PAD], gives our
outputs in float64 on every real token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_taco.cli.export_finetuned import save_task_model
from megatron_taco.cli.export_hf import save_model, special_token_ids, write_tokenizer
from megatron_taco.cli.export_taco_hf import save_taco_model
from megatron_taco.data.tokenizer import WordPieceTokenizer
from megatron_taco.recipes.registry import FinetunedTask
from tests.helpers import FINETUNE_ENCODERS, assert_close64, botchan_sentences, finetune_model

transformers = pytest.importorskip("transformers")

TYPE = "BertWordPieceLowerCase"
PAD = 7  # where this vocabulary keeps [PAD]: not 0, not next to the other specials
ENCODERS = tuple(FINETUNE_ENCODERS)  # TACO, SAS, SAS^DA


@pytest.fixture(scope="module")
def vocab(wordpiece_vocab, tmp_path_factory) -> str:
    """BERT's layout with [PAD] and [unused6] exchanged: [PAD] = 7, id 0 is [unused6]."""
    pieces = Path(wordpiece_vocab).read_text(encoding="utf-8").splitlines()
    assert pieces[0] == "[PAD]" and pieces[PAD] == "[unused6]"
    pieces[0], pieces[PAD] = pieces[PAD], pieces[0]
    path = tmp_path_factory.mktemp("pad7") / "vocab.txt"
    path.write_text("".join(p + "\n" for p in pieces), encoding="utf-8")
    return str(path)


def randomised(model: torch.nn.Module) -> torch.nn.Module:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every parameter far from its init
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model.eval()


def pretraining_model(encoder: str, vocab_size: int):
    """(our pretraining model in float64, its config, a function giving its encoder's last
    hidden states [b, s, H] from input_ids and attention_mask)."""
    from megatron_taco.parallel.state import single_process_state

    kind, make = FINETUNE_ENCODERS[encoder]
    config = make().with_vocab_size(vocab_size)
    torch.manual_seed(0)
    if kind == "TACO":
        from megatron_taco.models.taco.model import TacoForPretraining

        model = randomised(TacoForPretraining(config, single_process_state()).double())

        def hidden(ids, mask):
            positions = torch.arange(ids.shape[1]).expand_as(ids)
            return torch.cat(model.taco(ids, positions, mask), dim=-1)
    else:
        from megatron_taco.models.sas.model import SasForPretraining

        model = randomised(SasForPretraining(config, single_process_state()).double())

        def hidden(ids, mask):
            return model.sas(ids, mask)

    return model, config, hidden


def exported_batch(out: Path, remote: dict) -> dict[str, torch.Tensor]:
    """Sentences of different lengths, padded by the exported tokenizer."""
    tok = transformers.AutoTokenizer.from_pretrained(str(out), **remote)
    texts = [s for s in botchan_sentences() if len(s.split()) < 25][:6]
    batch = tok(texts, padding=True, truncation=True, max_length=64, return_tensors="pt")
    mask = batch["attention_mask"].bool()
    assert not mask.all() and (batch["input_ids"][~mask] == PAD).all(), "padded with [PAD]"
    assert (batch["input_ids"][mask] != PAD).all()
    return {"input_ids": batch["input_ids"], "attention_mask": mask}


def assert_special_ids(
    out: Path, model, remote: dict, ours: WordPieceTokenizer, state_dict: dict
) -> None:
    config = transformers.AutoConfig.from_pretrained(str(out), **remote)
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (
        ours.pad_id, ours.cls_id, ours.sep_id) == (PAD, 101, 102)  # fmt: skip
    # transformers' embedding keeps the [PAD] row out of a further fine-tuning's updates ...
    embedding = model.get_input_embeddings()
    assert embedding.padding_idx == PAD
    # ... and that row is ours, not zeroed (transformers' init rule for padding_idx): the
    # outputs below are compared on real tokens only, which a zeroed [PAD] row leaves alike.
    (word,) = [v for k, v in state_dict.items() if k.endswith("embeddings.word_embeddings.weight")]
    assert word[PAD].abs().max() > 0.1
    assert torch.equal(embedding.weight[PAD].detach(), word[PAD].to(torch.float64))
    tok = transformers.AutoTokenizer.from_pretrained(str(out), **remote)
    theirs = (tok.pad_token_id, tok.cls_token_id, tok.sep_token_id, tok.mask_token_id)
    assert theirs == (ours.pad_id, ours.cls_id, ours.sep_id, ours.mask_id)


def load(cls_name: str, out: Path, remote: dict):
    cls = getattr(transformers, cls_name)
    model, info = cls.from_pretrained(str(out), dtype=torch.float64, output_loading_info=True,
                                      **remote)  # fmt: skip
    assert not any(info[k] for k in ("missing_keys", "mismatched_keys")), info
    return model.eval()


@pytest.mark.parametrize("encoder", ENCODERS)
def test_pretrained_export_takes_the_tokenizers_ids(encoder, vocab, tmp_path):
    ours_tok = WordPieceTokenizer(vocab, lower_case=True)
    assert ours_tok.pad_id == PAD
    model, config, hidden = pretraining_model(encoder, ours_tok.vocab_size)
    out, remote = tmp_path / "hf", ({"trust_remote_code": True} if encoder == "TACO" else {})
    out.mkdir()
    kind = FINETUNE_ENCODERS[encoder][0]
    write_tokenizer(vocab, str(out), config.max_position_embeddings, kind, TYPE)
    ids = special_token_ids(ours_tok)
    if kind == "TACO":
        save_taco_model(config, model.state_dict(), str(out), ids)
    else:
        save_model(config, model.state_dict(), str(out), ids)
    theirs = load("AutoModel", out, remote)
    assert_special_ids(out, theirs, remote, ours_tok, model.state_dict())
    batch = exported_batch(out, remote)
    real = batch["attention_mask"]
    with torch.no_grad():
        want = hidden(batch["input_ids"], real)
        got = theirs(input_ids=batch["input_ids"], attention_mask=real.long()).last_hidden_state
    assert_close64(got[real], want[real], f"{encoder} hidden states on real tokens")


@pytest.mark.parametrize("encoder", ENCODERS)
def test_finetuned_export_takes_the_tokenizers_ids(encoder, vocab, tmp_path):
    ours_tok = WordPieceTokenizer(vocab, lower_case=True)
    kind = FINETUNE_ENCODERS[encoder][0]
    model = finetune_model(encoder, "classification", vocab_size=ours_tok.vocab_size,
                           num_labels=2)  # fmt: skip
    config = FINETUNE_ENCODERS[encoder][1]().with_vocab_size(ours_tok.vocab_size)
    task = FinetunedTask(kind, "custom", "classification", 2, ("neg", "pos"))
    out, remote = tmp_path / "hf", ({"trust_remote_code": True} if encoder == "TACO" else {})
    out.mkdir()
    write_tokenizer(vocab, str(out), config.max_position_embeddings, kind, TYPE)
    save_task_model(config, task, model.state_dict(), str(out), special_token_ids(ours_tok))
    theirs = load("AutoModelForSequenceClassification", out, remote)
    assert_special_ids(out, theirs, remote, ours_tok, model.state_dict())
    batch = exported_batch(out, remote)
    with torch.no_grad():
        want = model(batch)["logits"]
        got = theirs(input_ids=batch["input_ids"],
                     attention_mask=batch["attention_mask"].long()).logits  # fmt: skip
    assert_close64(got, want, f"{encoder} classification logits on a padded batch")
