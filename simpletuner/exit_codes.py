"""Exit codes every ``simpletuner`` command shares, and the one way an unexpected error ends.

Each code has one meaning across commands, so scripts can branch on it (130 / 143: stopped by SIGINT /
SIGTERM after saving). The table with each command's use: documentation/RELIABILITY.md, "Exit codes".
"""

from __future__ import annotations

import sys
import traceback

OK = 0
DOES_NOT_FIT = 1  # `estimate`: the config does not fit the GPU; `train`: stopped early on purpose
BAD_INPUT = 2  # config, flags, files (the message says what to fix)
NON_FINITE = 3  # `train`: non-finite loss or gradient (the last good state is saved)
OUT_OF_MEMORY = 4  # `train`: out of memory (the message says what would fit)
NO_SPACE = 5  # not enough disk space for a write (how much, where, what is free)
NETWORK = 6  # `push`: the Hub upload failed after its retries (the message says what failed and how to retry)
INTERNAL_ERROR = 70  # a bug in simpletuner, not in the input (EX_SOFTWARE of sysexits.h)
BROKEN_PIPE = 141  # what a shell reports for a writer killed by SIGPIPE

REPORT_HINT = (
    "Please report it with the traceback above, the command line, the config (paths may be redacted) and the "
    "output of `simpletuner diagnose`."
)


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its class name when the message is empty), for one-line reports."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def report_internal_error(exc: BaseException, command: str, stream=None) -> int:
    """Print the traceback of an unexpected exception and what to report; returns INTERNAL_ERROR.

    An unexpected error must never exit with a code that means something documented (1 would
    read as "does not fit" for ``estimate``), so every command funnels its last-resort handler here.
    """
    if isinstance(exc, BrokenPipeError):  # the reader went away (`... | head`): not a bug, nothing to say
        _silence_stdout()
        return BROKEN_PIPE
    stream = stream if stream is not None else sys.stderr
    traceback.print_exception(type(exc), exc, exc.__traceback__, file=stream)
    print(
        f"internal error in `simpletuner {command}` ({type(exc).__name__}: {exc}): this is a bug in simpletuner, "
        f"not a problem with your input. {REPORT_HINT} Exit code {INTERNAL_ERROR}.",
        file=stream,
    )
    return INTERNAL_ERROR


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not fail again."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
