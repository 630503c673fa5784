"""Disk space: check before a large write, and turn a full disk during one into one clear message.

Every writer of large files (cache shards, checkpoints, the final weights) knows how many bytes
it is about to write. It calls :func:`require_space` first, and wraps the write in
:func:`disk_full_guard`, so a disk that fills anyway (another process wrote to it) ends the same
way: its temp files removed, what was there before untouched, and :class:`NoSpace` saying
"<what> needs ~X in DIR, Y free" (exit code 5, no traceback).

A leaf module: it imports nothing from the package but the exit-code table, so caching, models
and training can all use it. :func:`human_bytes` (decimal units) and :func:`format_gib` print sizes.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from simpletuner.exit_codes import NO_SPACE

logger = logging.getLogger(__name__)

#: The most kept free on top of what a write needs (file-system metadata, a log line, the temp copy's
#: slack): the reserve of a write of 128 MiB or more. Smaller writes keep :func:`reserve_bytes` free.
MARGIN_BYTES = 16 * 2**20
#: The least kept free beyond a write: its block rounding, its directory entry and a log line.
RESERVE_FLOOR_BYTES = 256 * 2**10
#: The reserve is this fraction of the write, between the floor and :data:`MARGIN_BYTES`.
RESERVE_FRACTION = 1 / 8

#: ``SIMPLETUNER_FAULT_ENOSPC=<site>[@N]`` makes the N-th write at ``site`` (default the 1st) fail
#: with ENOSPC, as a disk filled by another process would. For the tests; unset in normal runs.
#: Sites: ``cache_shard``, ``checkpoint``, ``final_save``, ``validation_image``, ``cache_user_record``.
FAULT_ENV = "SIMPLETUNER_FAULT_ENOSPC"
_reached: dict[str, int] = {}

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
# How the Rust (safetensors) and C++ (torch.save) writers word ENOSPC / EDQUOT when they do not
# raise an OSError: "No space left on device (os error 28)", "StorageFull", "QuotaExceeded".
_FULL_WORDS = (
    "no space left on device",
    "os error 28",
    "storagefull",
    "disk quota exceeded",
    "os error 122",
    "quotaexceeded",
)


#: Bytes in a GiB: the unit memory figures (RAM, GPU memory) are printed in.
GIB = 1024**3


def format_gib(num_bytes: float | None) -> str:
    """``1.5 * GIB`` -> ``"1.5 GiB"``; None (not known) -> ``"unknown"``."""
    return "unknown" if num_bytes is None else f"{num_bytes / GIB:.1f} GiB"


def human_bytes(num_bytes: float) -> str:
    """``1536`` -> ``"1.5 KB"``; decimal units, as ``df -H`` prints them."""
    value = float(num_bytes)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(value) < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


class NoSpace(RuntimeError):
    """Not enough free space for a write; the message names how much, where, and what is free."""

    exit_code = NO_SPACE

    def __init__(
        self, what: str, folder: Path, needed: int | None, free: int, during_write: bool = False, agreed: bool = False
    ):
        """``agreed``: raised on this process because another one (rank 0) ran out of space, so that
        every process of a launch stops the same way; ``simpletuner train`` prints it once."""
        self.what, self.folder, self.needed, self.free = what, Path(folder), needed, free
        self.during_write, self.agreed = during_write, agreed
        need = f"needs ~{human_bytes(needed)}" if needed else "needs more space"
        when = "the disk filled while writing it" if during_write else "nothing was written"
        if not during_write and needed and free >= needed:  # refused for the reserve alone: say why
            when += f"; {human_bytes(reserve_bytes(needed))} is kept free beyond what this write needs"
        super().__init__(
            f"not enough disk space for {what}: {need} in {folder}, {human_bytes(free)} free ({when}; what was "
            f"there before is intact). Free space on that disk, or point the setting that names {folder} at "
            "another disk, then run the same command again"
        )


def _existing_ancestor(folder: Path) -> Path:
    folder = Path(folder).absolute()
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    return folder


def free_bytes(folder: str | os.PathLike[str]) -> int:
    """Free bytes (for this user) on the file system that holds ``folder`` or would hold it."""
    return shutil.disk_usage(_existing_ancestor(Path(folder))).free


def reserve_bytes(needed: int) -> int:
    """What is kept free beyond a write of ``needed`` bytes: an eighth of it, at least
    :data:`RESERVE_FLOOR_BYTES` (256 KiB) and at most :data:`MARGIN_BYTES` (16 MiB). Scaled so that a
    small write fits a small disk (a 31 KB cache fill on 4 MB free) while a large one keeps room."""
    return int(min(MARGIN_BYTES, max(RESERVE_FLOOR_BYTES, needed * RESERVE_FRACTION)))


def require_space(folder: str | os.PathLike[str], needed: int, what: str) -> None:
    """Raise :class:`NoSpace` before writing when ``folder``'s disk has less than ``needed`` bytes
    plus :func:`reserve_bytes` free."""
    free = free_bytes(folder)
    if free < needed + reserve_bytes(needed):
        raise NoSpace(what, Path(folder), needed, free)


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a full disk or an exceeded quota, however the writer
    worded it (an OSError from Python, a SafetensorError from Rust, a RuntimeError from torch.save)."""
    seen = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _FULL_ERRNOS:
            return True
        text = str(current).lower()
        if any(word in text for word in _FULL_WORDS):
            return True
        current = current.__cause__ or current.__context__
    return False


def inject_fault(site: str) -> None:
    """Fail like a full disk here when :data:`FAULT_ENV` names ``site`` (tests only)."""
    wanted = os.environ.get(FAULT_ENV)
    if not wanted:
        return
    point, _, nth = wanted.partition("@")
    if point != site:
        return
    _reached[site] = _reached.get(site, 0) + 1
    if _reached[site] == int(nth or 1):
        raise OSError(errno.ENOSPC, f"No space left on device (injected by {FAULT_ENV}={wanted})")


def remove_path(path: Path) -> None:
    """Remove a file or a folder tree, logging (not raising) when that fails."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    except OSError as exc:  # a cleanup that fails must not hide why we are cleaning up
        logger.warning("could not remove %s after a failed write: %s", path, exc)


@contextmanager
def disk_full_guard(
    folder: str | os.PathLike[str], needed: int | None, what: str, cleanup: Iterable[str | os.PathLike[str]] = ()
) -> Iterator[None]:
    """Run a write; if the disk fills, remove ``cleanup`` (the write's temp files or folders) and
    raise :class:`NoSpace` instead of the writer's own error. Other errors pass through unchanged
    (``cleanup`` is still removed: a half-written temp file is never useful)."""
    try:
        yield
    except BaseException as exc:
        is_full = isinstance(exc, Exception) and (is_disk_full(exc) or _is_short_write_on_full_disk(exc, folder))
        for path in cleanup:
            remove_path(Path(path))
        if is_full:
            raise NoSpace(what, Path(folder), needed, free_bytes(folder), during_write=True) from None
        raise


def _is_short_write_on_full_disk(exc: BaseException, folder: str | os.PathLike[str]) -> bool:
    """torch.save to a path on a full disk loses the errno: it raises "[enforce fail at
    inline_container.cc:...] . unexpected pos N vs M" (a short write; its context only says
    "basic_ios::clear: iostream error"). Such a write failed for want of space when the disk is
    (still, before the temp files are removed) within the margin of full."""
    return "unexpected pos" in str(exc) and free_bytes(folder) < MARGIN_BYTES
