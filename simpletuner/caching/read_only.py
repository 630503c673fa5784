"""Cache folders this process cannot write: a complete cache is read without locks.

A cache folder shared read-only (exported read-only, a squashfs image, a read-only bind mount in a
container, another user's folder) cannot hold the lock file and the record every run leaves in a
cache it uses (:class:`~simpletuner.locks.CacheLocks`). A run that only reads needs neither: no
one can fill or clear a folder nobody can write. So a run uses such a folder without a lock when
it holds every entry the run needs, and stops before encoding anything, naming the folder and
how many entries it lacks, when it does not.

"Cannot write" is asked with ``os.access``, which also answers from the mount: a read-only mount is
not writable even for root (who may write a ``chmod 0555`` folder, and then takes the locks).
"""

from __future__ import annotations

import errno
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

logger = logging.getLogger(__name__)

#: What a write into a folder this process may not change fails with.
_REFUSED = {errno.EROFS, errno.EACCES, errno.EPERM}

_FIX = (
    "Fill it where it is writable first (a run of this config with the folder writable), make it writable, "
    "or point cache_config.cache_dir at a writable folder"
)


def is_writable(folder: str | os.PathLike[str]) -> bool:
    """Whether this process may create files in ``folder`` (when it does not exist yet: in its
    nearest existing parent). False on a read-only mount, also for root."""
    folder = Path(folder).absolute()
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    return os.access(folder, os.W_OK | os.X_OK)


class ReadOnlyCaches:
    """The cache folders (lock bases, ``<cache_dir>/<family>`` or a folder a config key names) of a
    run that this process cannot write; the run reads them without locks and writes nothing there."""

    def __init__(self, bases: Iterable[Path]):
        self.bases = [Path(base) for base in bases if not is_writable(base)]

    def __contains__(self, base: object) -> bool:
        return base in self.bases

    def present_items(
        self,
        base: Path,
        has: Callable[[str], bool],
        items: Sequence[tuple[str, Any]],
        what: str,
        decodes: Callable[[Any], bool] | None = None,
    ) -> list[tuple[str, Any]]:
        """``items`` (key, payload) of a fill into the read-only ``base``: those ``has`` finds stored.
        Raises ValueError naming the folder and the count when an item is missing that the run would
        encode; with ``decodes`` (payload -> whether its source decodes) a missing one whose image
        does not decode is not needed (the run drops it, as a fill would), and is left out. Checking
        stops at the first missing item that decodes."""
        missing = [(key, payload) for key, payload in items if not has(key)]
        if missing and (decodes is None or any(decodes(payload) for _, payload in missing)):
            raise ValueError(
                f"the cache folder {base} is read-only and lacks {len(missing)} of the {len(items)} {what} this "
                f"run needs (a read-only cache is read without a lock only when it holds everything). {_FIX}"
            )
        if not missing:
            return list(items)
        absent = {key for key, _ in missing}
        return [(key, payload) for key, payload in items if key not in absent]

    @contextmanager
    def refusing_writes(self, base: Path) -> Iterator[None]:
        """Inside, a write the read-only ``base`` refuses (an entry to encode again: a damaged one, or
        one whose source changed under ``verify_content``) ends as ValueError naming the folder."""
        if base not in self:
            yield
            return
        try:
            yield
        except OSError as exc:
            if exc.errno not in _REFUSED:
                raise
            raise ValueError(
                f"the cache folder {base} is read-only and this run must write there ({exc.strerror or exc}: "
                f"{exc.filename or base}): an entry it needs is damaged or missing, or its source changed. {_FIX}"
            ) from None

    def log_used(self) -> None:
        """Say once per folder that it was read without a lock (at the end of the fill: it held everything)."""
        for base in self.bases:
            logger.info(
                "the cache folder %s is read-only and holds every entry this run needs: read without a lock "
                "(this run writes nothing there)",
                base,
            )
