"""Stopping a run without losing it: preemption signals, non-finite steps, out-of-memory, and the
fault points the tests use to kill a run at chosen places.

A run stops for one of these reasons by raising a :class:`RunStopped` subclass; ``train.main``
turns it into its exit code (SIGTERM 143, SIGINT 130, non-finite 3, out of memory 4).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType

logger = logging.getLogger(__name__)

#: ``SIMPLETUNER_FAULT=<point>[@N]`` makes the process SIGKILL itself the N-th time (default 1st)
#: it reaches that point. For the fault-injection tests; unset in normal runs.
FAULT_ENV = "SIMPLETUNER_FAULT"
_reached: dict[str, int] = {}


def fault_point(name: str) -> None:
    """Die here, as a crash or ``kill -9`` would, when the environment names this point."""
    wanted = os.environ.get(FAULT_ENV)
    if not wanted:
        return
    point, _, nth = wanted.partition("@")
    if point != name:
        return
    _reached[name] = _reached.get(name, 0) + 1
    if _reached[name] == int(nth or 1):
        logger.warning("fault injection: SIGKILL at %s (time %d)", name, _reached[name])
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)


class RunStopped(RuntimeError):
    """The run stopped early on purpose; ``exit_code`` is what the process should return."""

    exit_code = 1


class Preempted(RunStopped):
    def __init__(self, signum: int, checkpoint):
        self.signum = signum
        self.exit_code = 128 + signum
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name}: saved {checkpoint}; resume with resume_from_checkpoint: \"latest\"")


class NonFiniteLoss(RunStopped):
    exit_code = 3


class OutOfMemory(RunStopped):
    exit_code = 4


class PreemptionFlag:
    """SIGTERM / SIGINT set a flag the trainer reads at the next step boundary.

    A second SIGINT while the flag is set restores the default handler and interrupts at once
    (the user insists). Handlers are installed only from the main thread, and restored on exit.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.signum = signum
        logger.warning("%s received: saving a checkpoint at the end of this step, then stopping "
                       "(Ctrl-C again to stop at once without saving)", signal.Signals(signum).name)

    def __enter__(self) -> "PreemptionFlag":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @property
    def raised(self) -> bool:
        return self.signum is not None
