"""Nothing appears under a final name before the whole run succeeded: all files are built in
a hidden temporary directory next to the outputs and ``os.replace``-d at the end (per
dataset: the old .idx removed, .bin, unigram counts, then the new .idx). SIGINT and SIGTERM
stop the workers and delete the temporary directory; after a SIGKILL it stays behind, is
ignored by readers (it is hidden and has other names) and is deleted by the next run with
the same output prefix."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import threading
from typing import Any

from megatron_taco.data.indexed_dataset import data_file_path, index_file_path, unigram_path


class PreprocessInterrupted(KeyboardInterrupt):
    """SIGINT/SIGTERM stopped the run; temporary files were removed, nothing was written."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def temp_dir(out_dir: str, base: str) -> str:
    return os.path.join(out_dir, f".{base}.tmp-{os.getpid()}")


def remove_stale_temps(out_dir: str, base: str) -> list[str]:
    """Temporary directories of earlier runs with this prefix whose process is gone."""
    pattern = re.compile(re.escape(f".{base}.tmp-") + r"(\d+)")
    removed = []
    for name in os.listdir(out_dir):
        m = pattern.fullmatch(name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
            removed.append(name)
    return removed


class SignalGuard:
    """While active, SIGINT, SIGTERM and SIGHUP raise PreprocessInterrupted, so one cleanup
    path serves Ctrl-C, `kill` and a closed terminal. Inside ``deferred()`` (the final
    renames, a few milliseconds) a signal is only recorded: stopping halfway would leave
    some datasets of this run and some of the previous one."""

    SIGNALS = tuple(s for s in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, s))

    def __init__(self) -> None:
        self.pending: int | None = None
        self._defer = False
        self._previous: dict[int, Any] = {}

    def _handler(self, signum, _frame) -> None:
        if self._defer:
            self.pending = signum
            return
        raise PreprocessInterrupted(signum)

    def __enter__(self) -> SignalGuard:
        # signal.signal only works in the main thread; elsewhere the caller's handlers stay.
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                sig = getattr(signal, name)
                self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for sig, h in self._previous.items():
            signal.signal(sig, h)

    @contextlib.contextmanager
    def deferred(self):
        self._defer = True
        try:
            yield
        finally:
            self._defer = False


def replace_dataset(tmp: str, prefix: str, *, unigram: bool = True) -> None:
    """Rename dataset ``tmp`` (and its unigram counts) to ``prefix``: the old index goes
    first and the new one comes last, so a reader never pairs an index with a data file of
    another run, even if this process dies between two renames."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(index_file_path(prefix))
    os.replace(data_file_path(tmp), data_file_path(prefix))
    if unigram:
        os.replace(unigram_path(tmp), unigram_path(prefix))
    else:  # a stale count file would describe other data
        with contextlib.suppress(FileNotFoundError):
            os.remove(unigram_path(prefix))
    os.replace(index_file_path(tmp), index_file_path(prefix))


def commit(tmp_dir: str, prefixes: list[str], summary_file: str) -> None:
    """Move the finished files from ``tmp_dir`` to their final names, the summary last."""
    for prefix in prefixes:
        replace_dataset(os.path.join(tmp_dir, os.path.basename(prefix)), prefix)
    os.replace(os.path.join(tmp_dir, os.path.basename(summary_file)), summary_file)
