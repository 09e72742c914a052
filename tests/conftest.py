from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"
BOTCHAN = FIXTURES / "text" / "botchan_excerpt.txt"
TOKENIZER_VOCAB_SIZE = 800

# `make test` runs the files on two workers (pytest-xdist, --dist loadfile
# --no-loadscope-reorder), each taking the next file when it is free: the tiers whose files
# take longest go first, so that the short unit files fill in beside them and the run does
# not end on one worker's two-minute learning test (docs/benchmarks.md, "Tests").
TIER_ORDER = ("learning", "e2e", "distributed", "gpu", "unit")


def pytest_collection_modifyitems(items):
    def tier(item) -> int:
        parts = Path(item.path).relative_to(FIXTURES.parent).parts
        return TIER_ORDER.index(parts[0]) if parts[0] in TIER_ORDER else len(TIER_ORDER)

    items.sort(key=tier)  # stable: each file's tests keep their order


@pytest.fixture(scope="session")
def botchan_path() -> Path:
    return BOTCHAN


@pytest.fixture(scope="session")
def tokenizer_model(tmp_path_factory) -> str:
    """A real unigram sentencepiece model (800 pieces) trained on the Botchan excerpt."""
    # Imported here so that a broken tool fails the tests that need a tokenizer, not the
    # collection of the whole suite.
    from megatron_taco.cli.train_tokenizer import TrainTokenizerConfig, train_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    config = TrainTokenizerConfig(
        input=(str(BOTCHAN),),
        model_prefix=str(out / "spm"),
        vocab_size=TOKENIZER_VOCAB_SIZE,
        model_type="unigram",
        num_threads=1,
    )
    return train_tokenizer(config)


@pytest.fixture(scope="session")
def wordpiece_vocab(tmp_path_factory) -> str:
    """A real WordPiece vocab.txt (BertWordPieceLowerCase) trained on the Botchan excerpt by
    taco-train-tokenizer, laid out as BERT's: [PAD]=0, [unused0..98], [UNK] [CLS] [SEP]
    [MASK] at 100..103, then 795 pieces."""
    from megatron_taco.cli.train_tokenizer import TrainTokenizerConfig, train_tokenizer
    from tests.helpers import bert_layout

    out = tmp_path_factory.mktemp("wordpiece")
    trained = train_tokenizer(
        TrainTokenizerConfig(
            input=(str(BOTCHAN),),
            model_prefix=str(out / "wp"),
            tokenizer_type="BertWordPieceLowerCase",
            vocab_size=TOKENIZER_VOCAB_SIZE,
        )
    )
    pieces = Path(trained).read_text(encoding="utf-8").splitlines()
    (out / "vocab.txt").write_text("".join(p + "\n" for p in bert_layout(pieces)), "utf-8")
    return str(out / "vocab.txt")


@pytest.fixture(scope="session")
def tokenizer(tokenizer_model):
    from megatron_taco.data.tokenizer import Tokenizer

    return Tokenizer(tokenizer_model)


@pytest.fixture(scope="session")
def botchan_dataset(tmp_path_factory, tokenizer_model) -> dict:
    """The Botchan excerpt preprocessed by the real tool: ~46 documents of 20 lines."""
    tmp = tmp_path_factory.mktemp("data")
    return {
        **preprocess_botchan(tmp, tokenizer_model=tokenizer_model),
        "tokenizer": tokenizer_model,
    }


@pytest.fixture(scope="session")
def wordpiece_dataset(tmp_path_factory, wordpiece_vocab) -> dict:
    """botchan_dataset's documents tokenized with the WordPiece vocab.txt."""
    tmp = tmp_path_factory.mktemp("wordpiece_data")
    flags = {"tokenizer_type": "BertWordPieceLowerCase", "vocab_file": wordpiece_vocab}
    return {**preprocess_botchan(tmp, **flags), "vocab_file": wordpiece_vocab}


def preprocess_botchan(tmp: Path, **tokenizer_flags) -> dict:
    import json

    from megatron_taco.preprocessing.config import PreprocessConfig
    from megatron_taco.preprocessing.preprocess import preprocess

    lines = BOTCHAN.read_text(encoding="utf-8").splitlines()
    with open(tmp / "botchan.jsonl", "w", encoding="utf-8") as f:
        for i in range(0, len(lines), 20):
            f.write(json.dumps({"text": " ".join(lines[i : i + 20])}) + "\n")
    summary = preprocess(
        PreprocessConfig(
            input=(str(tmp / "botchan.jsonl"),),
            output_prefix=str(tmp / "botchan"),
            split_sentences=True,
            **tokenizer_flags,
        ),
        progress=False,
    )
    return {"prefix": summary["datasets"]["text"]["prefix"], "dir": tmp}


@pytest.fixture(scope="session")
def taco_checkpoint(botchan_dataset, tmp_path_factory) -> Path:
    """A --save directory of tiny TACO trained by the real driver on 2 ranks (tp 1 x dp 2,
    ZeRO-1 fp32; tiny_pretrain_args): checkpoints at iterations 2 and 4. Trained once per
    session for every test that loads, damages or converts a TACO checkpoint: read it, or
    copy it (shutil.copytree) before changing anything in it."""
    from tests.helpers import ZERO1_FP32, launch, tiny_pretrain_args

    save = tmp_path_factory.mktemp("taco_checkpoint") / "ckpt"
    argv = tiny_pretrain_args(botchan_dataset, save, "--deepspeed-config", ZERO1_FP32)
    launch("pretrain_taco.py", *argv, world=2)
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    return save


@pytest.fixture(scope="session")
def sas_da_checkpoint(botchan_dataset, tmp_path_factory) -> Path:
    """The same for SAS^DA on one rank (ZeRO-0 bf16): checkpoints at 2 and 4, its
    replacement store beside them."""
    from tests.helpers import ZERO0_BF16, launch, tiny_pretrain_args

    save = tmp_path_factory.mktemp("sas_da_checkpoint") / "ckpt"
    argv = tiny_pretrain_args(
        botchan_dataset, save, "--disentangled-attention", "--deepspeed-config", ZERO0_BF16
    )
    launch("pretrain_sas.py", *argv, world=1)
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    return save
