"""The two errors a user sees as one line (no traceback): the tools print ``<prog>: error:
<message>`` and exit 2 for a ConfigError, 1 for a RunError. Everything else is a bug and
keeps its traceback. This module imports nothing of ours."""


class ConfigError(ValueError):
    """A configuration value, or a file it names, is invalid; the message names the flag
    (or the file) and what is wrong. Raised before any process group where it can be."""


class RunError(RuntimeError):
    """A run stopped for a reason the user can act on (a full disk, a diverged loss): the
    driver prints the one-line message and exits 1."""
