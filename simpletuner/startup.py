"""Where the seconds before a run's first step go: the start-up timeline.

A :class:`StartupTimeline` measures named phases one after another, from the moment the process
started (read from the kernel on Linux, so Python's own start-up and the entry imports are counted)
or, for an ``accelerate launch`` / ``torchrun`` rank, from the moment the launcher process started.
``simpletuner train`` marks ``config`` and ``imports``; the trainer marks its own phases and the first
step, then logs the timeline and writes it to ``metrics.jsonl`` (documentation/PERFORMANCE.md, "Start-up").

:func:`quiet_gc_while_importing` is the other start-up lever kept here: the library imports create
about a million objects that live as long as the process, and the cyclic garbage collector would
traverse them again and again while they are made, and on every full collection afterwards.

Standard library only: imported before torch.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

#: The name of the phase from the process's start to the timeline's creation.
INTERPRETER = "interpreter"
#: The name of the phase from the launcher process's start to this process's start.
LAUNCHER = "launcher"


def _ticks_per_second() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (AttributeError, ValueError, OSError):
        return 100


def process_started_seconds_ago(pid: int | str = "self") -> float | None:
    """Seconds since process ``pid`` started, from ``/proc`` (None where there is no ``/proc``).

    The kernel records a process's start in clock ticks since boot (10 ms on Linux), on the boot clock.
    """
    started = _start_ticks(pid)
    if started is None:
        return None
    try:
        now = time.clock_gettime(time.CLOCK_BOOTTIME)
    except (AttributeError, OSError):
        return None
    return max(0.0, now - started / _ticks_per_second())


def _start_ticks(pid: int | str) -> int | None:
    """Field 22 of ``/proc/PID/stat`` (start time in clock ticks since boot), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
        # the command name (field 2) may hold spaces and parentheses: the fields after it follow the last ")"
        return int(stat[stat.rindex(")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def seconds_between_starts(earlier_pid: int, later_pid: int | str = "self") -> float | None:
    """Seconds from process ``earlier_pid``'s start to ``later_pid``'s (10 ms resolution), or None."""
    first, second = _start_ticks(earlier_pid), _start_ticks(later_pid)
    if first is None or second is None:
        return None
    return max(0.0, (second - first) / _ticks_per_second())


class StartupTimeline:
    """Seconds of each start-up phase, in order, and the time from the command to the last mark.

    ``since_process_start``: the first phase, ``interpreter``, covers the time from this process's start
    to the timeline's creation (where the kernel says when that was); :meth:`launched_by` adds the
    launcher's time before that.
    """

    def __init__(self, since_process_start: bool = False) -> None:
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()
        if since_process_start and (ago := process_started_seconds_ago()) is not None:
            self.phases[INTERPRETER] = ago

    def launched_by(self, launcher_pid: int) -> None:
        """Count from the start of process ``launcher_pid`` (the ``accelerate launch`` that started this one):
        its time before this process started becomes the first phase, ``launcher``."""
        launched = seconds_between_starts(launcher_pid)
        if launched is not None:
            self.phases = {LAUNCHER: launched, **{k: v for k, v in self.phases.items() if k != LAUNCHER}}

    def mark(self, name: str) -> float:
        """End phase ``name`` now (it began at the previous mark); returns its seconds. Marking a name
        twice adds the second span to the first."""
        now = time.perf_counter()
        seconds = now - self._last
        self.phases[name] = self.phases.get(name, 0.0) + seconds
        self._last = now
        return seconds

    @property
    def total(self) -> float:
        """Seconds from the command (or from the timeline's creation) to the last mark."""
        return sum(self.phases.values())

    def line(self) -> str:
        """``launcher 2.91s, interpreter 0.05s, config 0.21s, …`` (phase names with underscores as spaces)."""
        return ", ".join(f"{name.replace('_', ' ')} {seconds:.2f}s" for name, seconds in self.phases.items())

    def record(self) -> dict[str, float]:
        """The phases rounded to milliseconds (for metrics.jsonl)."""
        return {name: round(seconds, 3) for name, seconds in self.phases.items()}


@contextmanager
def quiet_gc_while_importing() -> Iterator[None]:
    """Import inside this block with the cyclic garbage collector paused; at its end the objects made so
    far (modules, classes, functions: they live as long as the process) are moved out of its reach
    (``gc.freeze``), so later full collections do not traverse them again. Reference counting still frees
    everything that is not in a cycle meanwhile."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()
