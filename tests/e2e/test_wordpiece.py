"""A BERT WordPiece vocabulary end to end. TACO and SAS are pretrained (2 iterations, the real
driver and DeepSpeed engine, one process) with --tokenizer-type BertWordPieceLowerCase on
a dataset preprocessed with a vocab.txt in BERT's layout ([PAD]=0, [UNK]=100, [CLS]=101,
[SEP]=102, [MASK]=103). The vocab.txt the runs were given is deleted afterwards: the copy in
--save serves export and fine-tuning. The exported folders' AutoTokenizer is a
BertTokenizerFast that gives our ids, and pipeline("fill-mask") serves both models."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megatron_taco.cli.export_hf import main as export_main
from megatron_taco.data.tokenizer import WordPieceTokenizer, file_sha256
from megatron_taco.errors import ConfigError
from megatron_taco.training.configure import build_parser, configs_from_args
from tests.helpers import launch, write_marker_task

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.e2e

TYPE = "BertWordPieceLowerCase"
TEXTS = [
    "I had not been long in the school when the principal sent for me.",
    "He said [MASK] twice,  and left «the Café» at noon; Yamaarashi's answer was 42!",
]


def vocab_size(vocab_file: str) -> int:
    return len(Path(vocab_file).read_text(encoding="utf-8").splitlines())


@pytest.fixture(scope="module")
def runs(wordpiece_dataset, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("wordpiece_runs")
    given = root / "given" / "vocab.txt"
    given.parent.mkdir()
    shutil.copy(wordpiece_dataset["vocab_file"], given)
    saves = {}
    for model in ("taco", "sas"):
        saves[model] = root / model
        argv = [
            "--model-size", "tiny", "--seq-length", "64",
            "--data-path", wordpiece_dataset["prefix"],
            "--tokenizer-type", TYPE, "--vocab-file", str(given),
            "--data-cache-path", str(wordpiece_dataset["dir"] / "cache"), "--split", "80,10,10",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2",
            "--lr", "1e-3", "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters", "0",
            "--num-workers", "0", "--save", str(saves[model]), "--save-interval", "2",
        ]  # fmt: skip
        launch(f"pretrain_{model}.py", *argv, timeout=600)
    shutil.rmtree(given.parent)  # moved or deleted: the checkpoints do not need it
    return saves


def test_save_holds_the_vocabulary(runs, wordpiece_vocab):
    for save in runs.values():
        meta = json.loads((save / "iter_0000002" / "metadata.json").read_text())
        record = meta["tokenizer"]
        assert record["type"] == TYPE and record["vocab_size"] == vocab_size(wordpiece_vocab)
        assert record["sha256"] == file_sha256(wordpiece_vocab)
        assert file_sha256(save / record["file"]) == record["sha256"]
        assert meta["configs"]["data"]["tokenizer_type"] == TYPE


@pytest.mark.parametrize("model", ["taco", "sas"])
def test_export_gives_our_ids_and_serves_fill_mask(runs, wordpiece_vocab, tmp_path, model):
    out = tmp_path / "hf"
    assert export_main(["--load", str(runs[model]), "--output", str(out)]) == 0
    assert (out / "vocab.txt").read_bytes() == Path(wordpiece_vocab).read_bytes()
    remote = {"trust_remote_code": True} if model == "taco" else {}
    tok = transformers.AutoTokenizer.from_pretrained(str(out), **remote)
    assert isinstance(tok, transformers.BertTokenizerFast)
    ours = WordPieceTokenizer(wordpiece_vocab, lower_case=True)
    ref = transformers.BertTokenizerFast(wordpiece_vocab, do_lower_case=True)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ours.unk_id not in ids[:3] and len(set(ids)) > 5  # real pieces, not all [UNK]
        assert tok(text)["input_ids"] == [101, *ids, 102]
        assert ref(text)["input_ids"] == [101, *ids, 102]
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == vocab_size(wordpiece_vocab) and config["pad_token_id"] == 0
    fill = transformers.pipeline("fill-mask", model=str(out), **remote)
    best = fill("the principal sent for [MASK].", top_k=3)
    assert len(best) == 3
    for guess in best:
        assert 0 <= guess["token"] < config["vocab_size"] and guess["token_str"] == tok.decode(
            [guess["token"]]
        )


def finetune_configs(load: Path, data: Path, output: Path, *extra: str):
    from megatron_taco.recipes.finetune import SPEC

    argv = ["--load", str(load), "--task", "custom", "--data-dir", str(data),
            "--output", str(output), "--seq-length", "64", "--micro-batch-size", "4",
            "--global-batch-size", "4", "--num-workers", "0", *extra]  # fmt: skip
    args = build_parser(SPEC).parse_args(argv)
    return configs_from_args(SPEC, args, world_size=1, device_type="cpu")


def test_finetuning_tokenizes_with_the_copy(runs, wordpiece_vocab, tmp_path):
    from megatron_taco.recipes.finetune import load_task_data

    write_marker_task(tmp_path / "marker")
    cfg = finetune_configs(runs["taco"], tmp_path / "marker", tmp_path / "ft")
    assert cfg.data.tokenizer_type == TYPE and cfg.data.tokenizer_model is None
    assert cfg.data.vocab_file.startswith(str(runs["taco"] / "tokenizer"))
    data = load_task_data(cfg.data)
    ours = WordPieceTokenizer(wordpiece_vocab, lower_case=True)
    with open(tmp_path / "marker" / "dev.tsv", encoding="utf-8") as f:
        first = f.read().splitlines()[1].split("\t")[0]
    row = data.dev["dev"][0]
    n = int(row["attention_mask"].sum())
    assert row["input_ids"][:n].tolist() == [101, *ours.encode(first), 102]
    # another vocabulary than the checkpoint's: one line, before any process group
    other = tmp_path / "other.txt"
    other.write_text(Path(wordpiece_vocab).read_text(encoding="utf-8") + "extra\n", "utf-8")
    with pytest.raises(ConfigError, match=r"^--vocab-file: .* is not the tokenizer .* sha256"):
        finetune_configs(runs["taco"], tmp_path / "marker", tmp_path / "ft2", "--vocab-file",
                         str(other))  # fmt: skip


def test_exported_wordpiece_tokenizer_encodes_like_ours(wordpiece_vocab, tmp_path):
    """The export's tokenizer files alone (no checkpoint), on 300 real sentences."""
    from megatron_taco.cli.export_hf import save_tokenizer
    from tests.helpers import botchan_sentences

    save_tokenizer(wordpiece_vocab, str(tmp_path), 64, TYPE)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = WordPieceTokenizer(wordpiece_vocab, lower_case=True)
    texts = [*botchan_sentences()[:300], *TEXTS]
    assert [tok(t)["input_ids"] for t in texts] == [[101, *ours.encode(t), 102] for t in texts]
    assert tok.model_max_length == 64 and tok.decode(tok(TEXTS[0])["input_ids"][1:-1]) == (
        ours.decode(ours.encode(TEXTS[0]))
    )
