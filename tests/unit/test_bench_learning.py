"""benchmarks.bench_learning's arguments: what would only fail at the report, after the
runs' half hour, is one line before any run."""

from __future__ import annotations

import pytest

from benchmarks import bench_learning


@pytest.mark.parametrize(
    ("given", "says"),
    [("taco={missing}", "--with taco={missing}: {missing} is not a file"),
     ("taco", "--with taco: expected MODEL=METRICS"),
     ("GPT-2={file}", "--with GPT-2={file}: GPT-2 is not a name (lower-case letters, digits, _)"),
     ("taco=", "--with taco=: expected MODEL=METRICS")],
)  # fmt: skip
def test_bad_with_is_one_line_before_any_run(tmp_path, capsys, given, says):
    file = tmp_path / "metrics.jsonl"
    file.write_text("")
    missing = tmp_path / "missing.jsonl"
    fill = {"missing": missing, "file": file}
    # --data-path: nothing is built or downloaded; --models taco given --with: nothing to run.
    argv = ["--data-path", str(tmp_path / "x"), "--tokenizer-model", str(tmp_path / "t.model"),
            "--models", "taco", "--out", str(tmp_path / "out"), "--with", given.format(**fill)]  # fmt: skip
    with pytest.raises(SystemExit) as stop:
        bench_learning.main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert says.format(**fill) in err[-1], err
    assert not (tmp_path / "out").exists()


def test_data_path_needs_its_tokenizer(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_learning.main(["--data-path", str(tmp_path / "x"), "--out", str(tmp_path / "o")])
    assert "--data-path needs --tokenizer-model" in capsys.readouterr().err
