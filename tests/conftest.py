from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"
BOTCHAN = FIXTURES / "text" / "botchan_excerpt.txt"
TOKENIZER_VOCAB_SIZE = 800


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
        quiet=True,
    )
    return train_tokenizer(config)


@pytest.fixture(scope="session")
def tokenizer(tokenizer_model):
    from megatron_taco.data.tokenizer import Tokenizer

    return Tokenizer(tokenizer_model)
