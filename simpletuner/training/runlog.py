"""A run you can follow: console logging, ``output_dir/training.log`` and ``output_dir/metrics.jsonl``.

:func:`configure_logging`: our ``simpletuner.*`` loggers at the level asked for, third-party ones no lower
than INFO. :class:`RunLog`: one run's files, rank 0 only, appended to across resumes (``training.log`` as
the console formats it; ``metrics.jsonl`` one object per logging window, flushed per line). Lines logged
before the folder and rank are known are held until :meth:`RunLog.open`; its handlers are removed when the
run ends, or by the next run's :meth:`RunLog.open`. See documentation/QUICKSTART.md, "Follow the run".
"""

from __future__ import annotations

import logging
import sys
import time
import weakref
from pathlib import Path
from typing import IO, Mapping

import orjson

#: The console's line format; ``training.log`` uses the same.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: The logger every module of ours hangs under (``logging.getLogger(__name__)``).
OUR_LOGGER = "simpletuner"
LOG_FILE = "training.log"
METRICS_FILE = "metrics.jsonl"
_MAX_HELD_RECORDS = 10_000  # start-up lines held until the output folder is known


#: Third-party loggers kept at WARNING: the HTTP transports of huggingface_hub (which one depends on its version).
QUIET_LOGGERS = ("httpx", "httpx2", "urllib3")


def configure_logging(level: str | int = "INFO", stream: IO[str] | None = None) -> logging.Handler:
    """Console logging for a run: our loggers at ``level``, third-party ones at max(level, INFO).

    Installs one stream handler (stderr by default) on the root logger, replacing the one an
    earlier call installed, so calling it again (several runs in one process) never doubles lines.
    Returns the handler.
    """
    numeric = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}: use DEBUG, INFO, WARNING or ERROR")
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, _ConsoleHandler)]:
        root.removeHandler(handler)
    handler = _ConsoleHandler(stream)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root.addHandler(handler)
    root.setLevel(max(numeric, logging.INFO))  # third-party DEBUG (PIL's chunk dumps) stays out
    logging.getLogger(OUR_LOGGER).setLevel(numeric)
    for name in QUIET_LOGGERS:  # one INFO line per HTTP request of the Hub client: hundreds for one upload
        logging.getLogger(name).setLevel(max(numeric, logging.WARNING))
    return handler


class _ConsoleHandler(logging.StreamHandler):
    """The console handler :func:`configure_logging` installed (found again by its type).

    Without a stream of its own it writes to whatever ``sys.stderr`` is when a line is logged, not
    the one it was created with: a caller that swapped stderr for a while (a test's capture, a
    tool's redirect) and closed it must not leave every later line failing with "I/O operation on
    closed file"."""

    def __init__(self, stream: IO[str] | None = None):
        self._own_stream = stream
        super().__init__(stream)

    @property
    def stream(self) -> IO[str]:
        return self._own_stream if self._own_stream is not None else sys.stderr

    @stream.setter
    def stream(self, value: IO[str] | None) -> None:  # StreamHandler.__init__ / setStream assign it
        self._own_stream = value if value is not sys.stderr else None


class _HeldRecords(logging.Handler):
    """Holds the records logged before the run's output folder is known."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.records) < _MAX_HELD_RECORDS:
            self.records.append(record)


class _RunFileHandler(logging.FileHandler):
    """``training.log`` of one run (found again by its type when a run left it behind)."""


def _detach(handlers: list[logging.Handler]) -> None:
    root = logging.getLogger()
    for handler in handlers:
        root.removeHandler(handler)
        handler.close()
    handlers.clear()


class RunLog:
    """``training.log`` and ``metrics.jsonl`` of one run, on rank 0; does nothing on other ranks.

    ``with RunLog() as log:`` holds the records logged from then on; :meth:`open` writes them to
    ``output_dir/training.log`` (appending) and keeps the file attached; :meth:`write_metrics`
    appends a metrics line; leaving the block (or :meth:`close`) detaches everything. A run that
    stops with an exception gets a last ``training.log`` line saying why.
    """

    def __init__(self) -> None:
        self._handlers: list[logging.Handler] = []  # on the root logger while the run lasts
        self._held: _HeldRecords | None = None
        self._file: _RunFileHandler | None = None
        self._metrics: IO[bytes] | None = None
        weakref.finalize(self, _detach, self._handlers)  # a RunLog dropped without close() detaches too

    @property
    def log_path(self) -> Path | None:
        """The ``training.log`` being written, None before :meth:`open` or off rank 0."""
        return Path(self._file.baseFilename) if self._file is not None else None

    def __enter__(self) -> RunLog:
        self._held = _HeldRecords()
        self._attach(self._held)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None and self._file is not None:
            record = logging.LogRecord(
                __name__, logging.ERROR, __file__, 0, "run stopped: %s: %s", (exc_type.__name__, exc), None
            )
            self._file.handle(record)
        self.close()

    def _attach(self, handler: logging.Handler) -> None:
        logging.getLogger().addHandler(handler)
        self._handlers.append(handler)

    def open(self, output_dir: Path, is_main_process: bool) -> None:
        """Start writing ``training.log`` and ``metrics.jsonl`` in ``output_dir`` (rank 0 only).

        The records held since the run began go first. Off rank 0 the held records are dropped.
        """
        root = logging.getLogger()
        for stale in [h for h in root.handlers if isinstance(h, _RunFileHandler) and h not in self._handlers]:
            root.removeHandler(stale)  # a trainer that was set up but never trained left it behind
            stale.close()
        held = self._held.records if self._held is not None else []
        if self._held is not None:
            root.removeHandler(self._held)
            self._handlers.remove(self._held)
            self._held = None
        if not is_main_process or self._file is not None:
            return
        self._file = _RunFileHandler(Path(output_dir) / LOG_FILE, mode="a", encoding="utf-8")
        self._file.setFormatter(logging.Formatter(LOG_FORMAT))
        for record in held:
            self._file.handle(record)
        self._attach(self._file)
        self._metrics = open(Path(output_dir) / METRICS_FILE, "ab")

    def write_metrics(self, step: int, figures: Mapping[str, float], extra: Mapping[str, object] | None = None) -> None:
        """Append one logging window to ``metrics.jsonl``: step, the figures, ``extra`` (e.g. the start-up
        timeline, in a launch's first window), a Unix timestamp.

        Non-finite numbers are written as null, so every line stays valid JSON.
        """
        if self._metrics is None:
            return
        line = {"step": step, **figures, **(extra or {}), "time": round(time.time(), 3)}
        self._metrics.write(orjson.dumps(line) + b"\n")
        self._metrics.flush()

    def close(self) -> None:
        """Detach the handlers and close both files (safe to call twice)."""
        _detach(self._handlers)
        self._held = self._file = None
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
