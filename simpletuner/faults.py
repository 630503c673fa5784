"""Fault points: named places where the fault-injection tests make a run die or get a signal.

``SIMPLETUNER_FAULT`` names points, comma-separated, each ``<point>[@N][:SIGNAL]``: the N-th time (default
1st) the process reaches ``<point>`` it sends itself ``SIGNAL`` (``SIGTERM``, ``SIGINT``; default ``SIGKILL``),
which reaches the run's handlers as a user's or a scheduler's would, at a chosen moment (e.g.
``checkpoint:renamed@2``, ``validation:prompt@1:SIGINT,validation:prompt@2:SIGINT``). Unset,
:func:`fault_point` costs one dictionary lookup. A leaf (standard library only), callable from every layer.
See documentation/RELIABILITY.md, "Fault injection".
"""

from __future__ import annotations

import logging
import os
import signal

logger = logging.getLogger(__name__)

FAULT_ENV = "SIMPLETUNER_FAULT"
_SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT}
_reached: dict[str, int] = {}  # times each point was reached in this process (the faults are per process)


def parse_faults(text: str) -> list[tuple[str, int, signal.Signals]]:
    """``[(point, nth, signal), ...]`` from a ``SIMPLETUNER_FAULT`` value.

    Raises:
        ValueError: a count that is not a positive integer (a typo must not silently disarm a test).
    """
    faults = []
    for spec in filter(None, (part.strip() for part in text.split(","))):
        head, _, tail = spec.rpartition(":")  # point names contain ':' themselves
        if head and tail in _SIGNALS:
            spec, sig = head, _SIGNALS[tail]
        else:
            sig = signal.SIGKILL
        point, _, nth = spec.partition("@")
        if nth and not (nth.isdigit() and int(nth) >= 1):
            raise ValueError(f"{FAULT_ENV}: {spec!r}: the count after '@' must be a positive integer")
        faults.append((point, int(nth or 1), sig))
    return faults


def fault_point(name: str) -> None:
    """Send the signal the environment asks for when this is the chosen time at ``name``.

    Safe from any thread: the signal goes to the process, whose handlers run on the main thread.
    """
    wanted = os.environ.get(FAULT_ENV)
    if not wanted:
        return
    faults = [(nth, sig) for point, nth, sig in parse_faults(wanted) if point == name]
    if not faults:
        return
    _reached[name] = _reached.get(name, 0) + 1
    for nth, sig in faults:
        if _reached[name] == nth:
            logger.warning("fault injection: %s at %s (time %d)", sig.name, name, nth)
            if sig == signal.SIGKILL:
                logging.shutdown()
            os.kill(os.getpid(), sig)


def reset_fault_counts() -> None:
    """Forget how often each point was reached (tests that inject faults in-process, one run after another)."""
    _reached.clear()
