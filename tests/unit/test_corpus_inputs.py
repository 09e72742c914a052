"""A corpus folder holds more than corpus files: examples/corpus/ ships ATTRIBUTION.md and
the script that made it. The README's tokenizer command on that folder works: such files
are left out of directory walks, with a count, and are still read when named."""

from __future__ import annotations

import logging
from pathlib import Path

from megatron_taco.cli.train_tokenizer import main as train_tokenizer_main
from megatron_taco.preprocessing.inputs import detect_format, expand_inputs

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "examples" / "corpus"


def test_documentation_and_code_beside_a_corpus_are_skipped_with_a_count(caplog):
    caplog.set_level(logging.INFO)
    assert expand_inputs([str(CORPUS)]) == [str(CORPUS / "demo.jsonl.gz")]
    assert f"{CORPUS}: skipped 2 file(s) that are not corpus files (ATTRIBUTION.md, " in caplog.text
    assert detect_format(str(CORPUS)) == "jsonl"
    named = expand_inputs([str(CORPUS / "ATTRIBUTION.md")])  # named: read as given
    assert named == [str(CORPUS / "ATTRIBUTION.md")]


def test_the_readme_tokenizer_command_on_the_example_folder(tmp_path):
    prefix = tmp_path / "tok"
    argv = ["--input", str(CORPUS), "--model-prefix", str(prefix), "--vocab-size", "1000",
            "--input-sentence-size", "20000"]  # fmt: skip
    assert train_tokenizer_main(argv) == 0
    assert (tmp_path / "tok.model").is_file()
