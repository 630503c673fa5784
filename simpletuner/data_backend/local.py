"""A dataset stored as a folder on local disk."""

from __future__ import annotations

import logging
import os
from pathlib import Path, PurePosixPath
from typing import Iterable

from simpletuner.data_backend.base import normalize_extensions

logger = logging.getLogger(__name__)


class LocalDataBackend:
    """Files under ``root`` on the local file system, addressed by relative POSIX path.

    Paths that would leave the root (absolute paths, ``..`` components) are refused with a
    ValueError, so a caption or cache entry can never point the trainer outside its dataset.
    """

    def __init__(self, root: str | Path, id: str):
        self.root = Path(root).expanduser()
        self.id = id
        if not self.root.is_dir():
            raise ValueError(
                f"dataset {id!r}: {self.root} is not a folder; "
                "set `instance_data_dir` to the folder that holds the images"
            )

    def __repr__(self) -> str:
        return f"LocalDataBackend(id={self.id!r}, root={str(self.root)!r})"

    def _resolve(self, path: str) -> Path:
        rel = PurePosixPath(str(path).replace(os.sep, "/"))
        if rel.is_absolute() or ".." in rel.parts or not rel.parts:
            raise ValueError(
                f"dataset {self.id!r}: path {path!r} is not a relative path inside {self.root}; "
                "use a path as returned by list_files()"
            )
        return self.root.joinpath(*rel.parts)

    def list_files(self, extensions: Iterable[str] | None = None) -> list[str]:
        """Relative POSIX paths of all files under the root (recursive, sorted, hidden skipped)."""
        wanted = normalize_extensions(extensions)
        found: list[str] = []
        for dirpath, dirnames, filenames in os.walk(self.root, followlinks=True):
            # Prune hidden folders in place so os.walk never descends into them.
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            base = Path(dirpath)
            for name in filenames:
                if name.startswith("."):
                    continue
                if wanted is not None and os.path.splitext(name)[1].lower() not in wanted:
                    continue
                full = base / name
                if not full.is_file():
                    continue  # broken symlinks, sockets, ...
                found.append(full.relative_to(self.root).as_posix())
        found.sort()
        return found

    def read(self, path: str) -> bytes:
        """The bytes of ``path``; FileNotFoundError naming the full path when it is missing."""
        full = self._resolve(path)
        try:
            return full.read_bytes()
        except FileNotFoundError:
            raise FileNotFoundError(f"dataset {self.id!r}: no file {path!r} (looked at {full})") from None

    def read_head(self, path: str, num_bytes: int) -> bytes:
        """Up to ``num_bytes`` bytes from the start of ``path`` (for header parsing)."""
        full = self._resolve(path)
        try:
            with full.open("rb") as handle:
                return handle.read(num_bytes)
        except FileNotFoundError:
            raise FileNotFoundError(f"dataset {self.id!r}: no file {path!r} (looked at {full})") from None

    def exists(self, path: str) -> bool:
        """Whether ``path`` is an existing file under the root."""
        return self._resolve(path).is_file()

    def size(self, path: str) -> int:
        """Size of ``path`` in bytes."""
        return self._stat(path).st_size

    def identity(self, path: str) -> str:
        """``"{size}:{mtime_ns}"``: changes when the file is rewritten."""
        st = self._stat(path)
        return f"{st.st_size}:{st.st_mtime_ns}"

    def _stat(self, path: str) -> os.stat_result:
        full = self._resolve(path)
        try:
            return full.stat()
        except FileNotFoundError:
            raise FileNotFoundError(f"dataset {self.id!r}: no file {path!r} (looked at {full})") from None
