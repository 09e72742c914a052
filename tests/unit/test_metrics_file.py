"""metrics.jsonl can never fail a run (issue 27 item 6): a full disk at the append is one
warning and training goes on; a record cut short (a full disk, a killed run) is skipped by
the reader with a warning, also when a resumed run appended after it."""

from __future__ import annotations

import json
import logging

from megatron_taco.training.observability import log as log_module
from megatron_taco.training.observability.log import TrainingLogger, read_metrics


def _core(records: list[dict]) -> list[dict]:
    # The logger adds timings (elapsed_s, eta_s, host_rss_gib) that no test can know.
    return [{k: r[k] for k in ("split", "iteration", "loss") if k in r} for r in records]


def test_a_full_disk_at_the_metrics_append_is_one_warning(caplog):
    # /dev/full: every write fails with ENOSPC, as on a full file system.
    log = TrainingLogger(rank=0, train_iters=3, metrics_file="/dev/full", progress_bar=False)
    with caplog.at_level(logging.WARNING, logger="megatron_taco.training.observability.log"):
        for iteration in (1, 2, 3):
            log.log("train", iteration, {"loss": 1.0})
    log.close()
    assert [r.getMessage() for r in caplog.records if r.name == log_module.__name__] == [
        "--metrics-file: writing /dev/full failed (No space left on device); training goes "
        "on, the records it misses are lost"
    ]


def test_a_torn_record_is_skipped_and_the_next_runs_records_kept(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    whole = {"split": "train", "iteration": 1, "loss": 2.0}
    path.write_text(json.dumps(whole) + "\n" + '{"split": "train", "iteration": 2, "lo')
    log = TrainingLogger(rank=0, train_iters=3, metrics_file=str(path), progress_bar=False)
    log.log("train", 2, {"loss": 1.5})  # the resumed run's
    log.close()
    with caplog.at_level(logging.WARNING, logger="megatron_taco.training.observability.log"):
        records = read_metrics(str(path))
    assert _core(records) == [whole, {"split": "train", "iteration": 2, "loss": 1.5}]
    assert [r.getMessage() for r in caplog.records if r.name == log_module.__name__] == [
        f'{path}:2: not a whole metrics record, skipped: {{"split": "train", "iteration": 2, "lo'
    ]


def test_an_empty_file_and_a_file_of_one_torn_line(tmp_path, caplog):
    empty, torn = tmp_path / "empty.jsonl", tmp_path / "torn.jsonl"
    empty.write_text("")
    torn.write_text('{"split": "train", "itera')
    with caplog.at_level(logging.WARNING, logger="megatron_taco.training.observability.log"):
        assert read_metrics(str(empty)) == []
        assert read_metrics(str(torn)) == []
    assert [r.getMessage() for r in caplog.records if r.name == log_module.__name__] == [
        f'{torn}:1: not a whole metrics record, skipped: {{"split": "train", "itera'
    ]
    # A run appending to either (an empty file left by a run killed before its first log).
    for path in (empty, torn):
        log = TrainingLogger(rank=0, train_iters=3, metrics_file=str(path), progress_bar=False)
        log.log("train", 1, {"loss": 2.5})
        log.close()
        assert _core(read_metrics(str(path))) == [{"split": "train", "iteration": 1, "loss": 2.5}]
