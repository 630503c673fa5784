"""Markers: small JSON files a disk store keeps beside its shards, e.g. "every latent of epoch 3 is
written" (:class:`~simpletuner.caching.reencode.EpochLatents`)."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping

import orjson

logger = logging.getLogger("simpletuner.caching.store")  # one logger for the whole store

MARKER_SUFFIX = ".marker.json"
_MARKER_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")


def check_marker_name(name: str) -> str:
    """``name`` when it is a plain file name part (letters, digits, ``._-``); else ValueError."""
    if not isinstance(name, str) or not _MARKER_NAME.match(name):
        raise ValueError(
            f"marker name {name!r} must be letters, digits, '.', '_' or '-' (not starting with '.' or '-')"
        )
    return name


class FolderMarkers:
    """The markers in ``root``; ``sync`` persists the folder's entries after a rename."""

    def __init__(self, root: Path, sync: Callable[[], None]):
        self.root, self._sync = root, sync

    def _path(self, name: str) -> Path:
        return self.root / f"{check_marker_name(name)}{MARKER_SUFFIX}"

    def write(self, name: str, content: Mapping[str, Any]) -> None:
        """Record ``content`` (JSON-able) under ``name``, atomically (temp file, fsync, rename)."""
        path = self._path(name)
        temp = path.with_name(f".tmp-{path.name}")
        with open(temp, "wb") as file:
            file.write(orjson.dumps(dict(content), option=orjson.OPT_SORT_KEYS))
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
        self._sync()

    def read(self, name: str) -> dict[str, Any] | None:
        """The content of marker ``name``, or None when there is none (or it cannot be parsed)."""
        try:
            content = orjson.loads(self._path(name).read_bytes())
        except FileNotFoundError:
            return None
        except orjson.JSONDecodeError as error:
            logger.warning("ignoring unreadable marker %s: %s", self._path(name), error)
            return None
        return content if isinstance(content, dict) else None

    def names(self) -> list[str]:
        """Names of the markers in the folder, sorted."""
        return sorted(p.name[: -len(MARKER_SUFFIX)] for p in self.root.glob(f"*{MARKER_SUFFIX}"))

    def remove(self, name: str) -> None:
        """Delete marker ``name`` (nothing happens when there is none)."""
        self._path(name).unlink(missing_ok=True)
