"""Rank 0 decides, every rank acts: values shared between the processes of a launch.

How every process comes to the same decision about something only rank 0 checked (a lock, a full
disk, a shared folder): each then acts on it the same way, and none is left waiting in a collective
for a rank that gave up. Each helper takes the run's ``accelerate.Accelerator`` and is a plain return
with one process. A leaf module: Accelerate is imported only when there are several processes.
"""

from __future__ import annotations

import socket
import uuid
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

#: The probe :func:`probe_shared_folder` writes and removes (a dead run may leave one: harmless).
SHARED_PROBE_PREFIX = ".simpletuner-shared-check-"


def from_main_process(accelerator: Any, value: T) -> T:
    """``value`` as rank 0 has it, on every rank (one object collective when there are several)."""
    if accelerator.num_processes <= 1:
        return value
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([value], from_process=0)[0]


def from_every_process(accelerator: Any, value: T) -> list[T]:
    """Every rank's ``value``, in rank order, on every rank."""
    if accelerator.num_processes <= 1:
        return [value]
    from accelerate.utils import gather_object

    return gather_object([value])


def probe_shared_folder(accelerator: Any, folder: Path) -> tuple[str | None, list[tuple[bool, str]]]:
    """Whether every rank sees ``folder`` as rank 0 does (one folder on a shared filesystem, not a
    node-local one at the same path): ``(why rank 0 could not write there, or None; [(sees it, host)
    per rank])``. Collective: every rank calls it. Rank 0 writes a probe file holding a token, every
    rank reads it back, rank 0 removes it; ``folder`` must exist on rank 0."""
    token = from_main_process(accelerator, uuid.uuid4().hex)
    probe = folder / f"{SHARED_PROBE_PREFIX}{token}"
    failed = None
    if accelerator.is_main_process:
        try:
            probe.write_text(token)
        except OSError as exc:
            failed = f"{type(exc).__name__}: {exc}"
    failed = from_main_process(accelerator, failed)  # also the barrier: the probe is written before anyone reads
    try:
        seen = failed is None and probe.read_text() == token
    except OSError:
        seen = False
    results = from_every_process(accelerator, (seen, socket.gethostname()))
    if accelerator.is_main_process:
        probe.unlink(missing_ok=True)
    return failed, results
