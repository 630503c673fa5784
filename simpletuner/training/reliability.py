"""Stopping a run without losing it: signals in every phase, non-finite steps, out-of-memory.

A run stops for one of these reasons by raising a :class:`RunStopped` subclass; ``train.main`` turns it
into its exit code (SIGTERM 143, SIGINT 130, non-finite 3, out of memory 4). :class:`RunSignals` handles
SIGTERM / SIGINT for the whole run, and what a signal does depends on the phase (:func:`run_phase`):
outside the step loop it interrupts at once (:class:`Interrupted`), inside it the trainer saves at the
next step boundary (:class:`Preempted`), during the final save it waits for the save. The phases, the
second Ctrl-C and the launchers: documentation/RELIABILITY.md, "Signals". The fault points the tests use
(``SIMPLETUNER_FAULT``) live in :mod:`simpletuner.faults` and are re-exported here.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Iterable, Iterator

from simpletuner.faults import FAULT_ENV, fault_point  # noqa: F401  (re-exported: checkpoint.py and the tests use them)

logger = logging.getLogger(__name__)

Kept = str | Callable[[], str]  # what the run keeps when it stops in a phase (a callable is asked at report time)

NOTHING_YET = "nothing trained yet, nothing to save"
CACHES_COMPLETE = "nothing trained yet, nothing to save; the caches are complete and the next run reuses them"

#: phase name -> (words for the message, what a signal does there, what is kept)
PHASES: dict[str, tuple[str, str, Kept]] = {
    "startup": ("start-up", "interrupt", NOTHING_YET),
    "datasets": ("the dataset scan", "interrupt", NOTHING_YET + "; the next run scans again"),
    "staging": (
        "the in-memory staging and dataset scan",
        "interrupt",
        NOTHING_YET + "; the next run stages and scans again",
    ),
    # Sizing the VAE, text encoders and denoiser from their configs (seconds on a busy host; on a GPU the estimate)
    "memory_check": ("the memory check before the cache fill", "interrupt", NOTHING_YET),
    "cache_fill": ("the cache fill", "interrupt", NOTHING_YET),
    "model_load": ("the model load", "interrupt", CACHES_COMPLETE),
    "first_validation": ("the first validation", "interrupt", CACHES_COMPLETE),
    "training": ("training", "flag", ""),
    "final_save": ("the final save", "defer", ""),
    "final_validation": ("the final validation", "interrupt", "the final weights are saved"),
    "upload": ("the Hub upload", "interrupt", "the final weights are saved; upload them with `simpletuner push`"),
    "done": ("the end of the run", "ignore", ""),  # trackers flushing: a signal now changes nothing
}


class RunStopped(RuntimeError):
    """The run stopped early on purpose; ``exit_code`` is what the process should return."""

    exit_code = 1


class Preempted(RunStopped):
    """A signal stopped the step loop: a checkpoint was saved; ``resume_command`` (when the entry point
    knows one, e.g. the demo's) is named instead of the config key."""

    def __init__(self, signum: int, checkpoint, resume_command: str | None = None):
        self.signum = signum
        self.exit_code = 128 + signum
        name = signal.Signals(signum).name
        how = f"`{resume_command}`" if resume_command else 'resume_from_checkpoint: "latest"'
        super().__init__(f"stopped by {name}: saved {checkpoint}; resume with {how}")


class Interrupted(RunStopped):
    """A signal stopped the run outside the step loop (or right after the final save).

    The message is composed when first read, after the exception has unwound: by then the
    ``finally`` blocks have run (a cache fill has written its pending entries), so "what is kept"
    counts them.
    """

    def __init__(self, signum: int, phase_words: str, kept: Kept):
        self.signum = signum
        self.exit_code = 128 + signum
        self.phase_words = phase_words
        self._kept = kept
        self._message: str | None = None
        super().__init__(signal.Signals(signum).name, phase_words)

    def __str__(self) -> str:
        if self._message is None:
            kept = self._kept() if callable(self._kept) else self._kept
            self._message = f"stopped by {signal.Signals(self.signum).name} during {self.phase_words}: {kept}"
        return self._message


class NonFiniteLoss(RunStopped):
    exit_code = 3


class OutOfMemory(RunStopped):
    exit_code = 4


def _say(line: str) -> None:
    """One line on stderr from a signal handler: os.write, because the handler may run while the
    main thread is inside a buffered write to sys.stderr (re-entering it raises)."""
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass


class RunSignals:
    """SIGTERM / SIGINT handlers for a whole run; what a signal does follows the current phase.

    Installed only from the main thread (elsewhere it records phases and handles nothing), and
    the previous handlers come back on exit. Entering one while another is installed returns the
    installed one, so ``train.main`` and ``Trainer.train`` share a single set of handlers.

    ``signum`` is the signal received (None before one); the trainer folds it into the per-step
    all-reduce inside the loop.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum: int | None = None
        self.phase = "startup"
        self.words, self.mode, self.kept = PHASES["startup"]
        self.received_in: str | None = None  # the phase words when the signal came
        self.is_stopping = False  # an exception is on its way out: a (first) signal changes nothing
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}  # signal.signal's
        self._depth = 0
        self._owner: RunSignals = self

    # --- installing -----------------------------------------------------------------------
    @staticmethod
    def installed() -> "RunSignals | None":
        """The instance whose handlers are in force, if any."""
        owner = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
        return owner if isinstance(owner, RunSignals) else None

    def __enter__(self) -> "RunSignals":
        current = self.installed()
        self._owner = current if current is not None else self
        self._owner._depth += 1
        if self._owner is self and self._depth == 1 and threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self._owner

    def __exit__(self, exc_type, exc, tb) -> None:
        owner = self._owner
        if exc is not None:
            owner.is_stopping = True
        owner._depth -= 1
        if owner._depth == 0:
            for sig, handler in owner._previous.items():
                signal.signal(sig, handler)
            owner._previous.clear()

    # --- the handler ----------------------------------------------------------------------
    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            if signum == signal.SIGINT:  # the user insists: no save, no cleanup, no waiting for threads
                _say(f"second {name}: stopping now without saving")
                os._exit(128 + signum)
            # A repeated SIGTERM is not insistence: a scheduler and a launcher often both deliver one
            # (slurm signals every task, torchrun forwards its own); their SIGKILL comes after a grace period.
            logger.warning("%s received again: still stopping (Ctrl-C to stop at once without saving)", name)
            return
        if self.is_stopping or self.mode == "ignore":  # already on the way out, or done: nothing left to stop
            self.signum = signum  # a Ctrl-C after this one ends the process at once
            logger.warning(
                "%s received while the run is %s (Ctrl-C again to stop at once)",
                name,
                "already stopping" if self.is_stopping else "ending: it finishes normally",
            )
            return
        self.signum = signum
        self.received_in = self.words
        if self.mode == "interrupt":
            self.is_stopping = True
            raise Interrupted(signum, self.words, self.kept)
        if self.mode == "flag":
            logger.warning(
                "%s received: saving a checkpoint at the end of this step, then stopping "
                "(Ctrl-C again to stop at once without saving)",
                name,
            )
        else:
            logger.warning(
                "%s received during %s: finishing it, then stopping (Ctrl-C again to stop at once without saving)",
                name,
                self.words,
            )

    # --- phases ---------------------------------------------------------------------------
    def enter(self, phase: str, kept: Kept | None = None) -> None:
        """Make ``phase`` (a key of :data:`PHASES`) current; ``kept`` replaces its default words
        for what a stop there keeps. Reaching a phase is also the fault point ``phase:<name>``."""
        self.phase = phase
        self.words, self.mode, default = PHASES[phase]
        self.kept = default if kept is None else kept
        fault_point(f"phase:{phase}")

    @contextmanager
    def flagged(self) -> Iterator["RunSignals"]:
        """The step loop: a signal sets :attr:`signum`, read at the next step boundary."""
        self.enter("training")
        try:
            yield self
        except BaseException:
            self.is_stopping = True
            raise

    @contextmanager
    def deferred(self, phase: str, kept: Callable[[], str]) -> Iterator["RunSignals"]:
        """Run the block to its end whatever arrives; then stop if a signal came during it (or
        came late in the step loop and is still pending). ``kept()`` words what the block saved."""
        self.enter(phase)
        try:
            yield self
        except BaseException:
            self.is_stopping = True
            raise
        if self.signum is not None:
            self.is_stopping = True
            raise Interrupted(
                self.signum, self.received_in or self.words, lambda: f"{kept()}; the final validation is skipped"
            )


def exit_on_signal(code: int) -> None:
    """From now to the process's end, SIGTERM / SIGINT exit at once with ``code``.

    For the script's last moments, after ``train.main`` returned: interpreter shutdown joins
    threads, and a signal then (e.g. a launcher stopping the siblings of a rank that stopped)
    would otherwise end as a KeyboardInterrupt traceback or exit -15 instead of the run's code.
    """
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if threading.current_thread() is threading.main_thread():
        for sig in RunSignals.SIGNALS:
            signal.signal(sig, lambda signum, frame: os._exit(code))


def run_phase(phase: str, kept: Kept | None = None) -> None:
    """Mark the run as being in ``phase`` (see :data:`PHASES`) for the installed handlers; with
    none installed (a Trainer driven step by step from a test) it only passes the fault point."""
    signals = RunSignals.installed()
    if signals is not None:
        signals.enter(phase, kept)
    else:
        fault_point(f"phase:{phase}")


@contextmanager
def run_step(name: str, words: str) -> Iterator[None]:
    """A named step inside the current phase (loading the VAE in the cache fill): a stop during it
    says ``during <phase>, while <words>``; the phase's words come back after it. Reaching it is the
    fault point ``step:<name>``."""
    signals = RunSignals.installed()
    before = signals.words if signals is not None else None
    if signals is not None:
        signals.words = f"{before}, while {words}"
    try:
        fault_point(f"step:{name}")
        yield
    finally:
        if signals is not None and signals.words == f"{before}, while {words}":  # no phase change inside
            signals.words = before


def cache_entries_kept(folders: Callable[[], Iterable[Path]]) -> Callable[[], str]:
    """What a stop during the cache fill keeps, worded when the stop is reported: the entries
    written into ``folders()`` from now on (counted from the shard headers; the cache's own
    writes are atomic, so every shard there is whole)."""
    since_ns = time.time_ns()

    def words() -> str:
        count = _entries_written_since(folders(), since_ns)
        if count is None:
            return f"{NOTHING_YET}; the cache entries written so far are kept and the next run reuses them"
        if count == 0:
            return f"{NOTHING_YET}; no cache entry was written yet"
        return (
            f"{NOTHING_YET}; the {count} cache entr{'y' if count == 1 else 'ies'} written so far "
            "are kept and the next run reuses them"
        )

    return words


def _entries_written_since(folders: Iterable[Path], since_ns: int) -> int | None:
    """Entries in the shards of ``folders`` whose header says they were written at or after
    ``since_ns``; None when a header cannot be read (the count would be a guess)."""
    from safetensors import safe_open

    total = 0
    for folder in folders:
        for shard in Path(folder).glob("shard-*.safetensors"):
            try:
                with safe_open(str(shard), framework="pt") as handle:
                    metadata = handle.metadata() or {}
            except Exception:  # noqa: BLE001 - a damaged shard only makes the count unknown
                return None
            written = metadata.get("written_ns", "")
            if written.isdigit() and int(written) >= since_ns:
                total += int(metadata.get("num_entries", "0") or 0)
    return total
