"""A dataset stored as a folder on local disk."""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path
from typing import Iterable

from simpletuner.data_backend.base import normalize_extensions

logger = logging.getLogger(__name__)

#: What ``Path.is_file`` takes as "no such file" rather than an error.
_MISSING_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ELOOP})
#: ``read_head`` reads this much first, and the rest of what it was asked for only when the file is longer.
_FIRST_READ = 64 * 1024


class LocalDataBackend:
    """Files under ``root`` on the local file system, addressed by relative POSIX path.

    Paths that would leave the root (absolute paths, ``..`` components) are refused with a
    ValueError, so a caption or cache entry can never point the trainer outside its dataset.
    """

    def __init__(self, root: str | Path, id: str):
        self.root = Path(root).expanduser()
        self._root = str(self.root)
        self._prefix = self._root if self._root.endswith("/") else self._root + "/"
        self.id = id
        if not self.root.is_dir():
            raise ValueError(
                f"dataset {id!r}: {self.root} is not a folder; "
                "set `instance_data_dir` to the folder that holds the images"
            )

    def __repr__(self) -> str:
        return f"LocalDataBackend(id={self.id!r}, root={str(self.root)!r})"

    def _resolve(self, path: str) -> Path:
        return Path(self._full(path))

    def _full(self, path: str) -> str:
        """The absolute path of ``path`` as a string (refused when it would leave the root)."""
        text = str(path).replace(os.sep, "/")
        if text and not (text.startswith((".", "/")) or text.endswith("/") or "//" in text or "/." in text):
            return self._prefix + text  # a plain relative path: what the join below gives
        parts = [part for part in text.split("/") if part and part != "."]
        if text.startswith("/") or ".." in parts or not parts:
            raise ValueError(
                f"dataset {self.id!r}: path {path!r} is not a relative path inside {self.root}; "
                "use a path as returned by list_files()"
            )
        return os.path.join(self._root, *parts)

    def list_files(self, extensions: Iterable[str] | None = None) -> list[str]:
        """Relative POSIX paths of all files under the root (recursive, sorted, hidden skipped).

        Symlinked folders are followed, except one that leads back to a folder it is inside (a loop);
        broken symlinks and anything that is not a regular file (or a link to one) are left out, and so
        are folders that cannot be listed.
        """
        wanted = normalize_extensions(extensions)
        found: list[str] = []
        splitext = os.path.splitext
        # (folder, its path relative to the root with a trailing "/", the (device, inode) of it and of
        # every folder above it: a symlink back to one of those would list the same files forever)
        stack = [(self._root, "", frozenset({_identity(self._root)}))]
        while stack:
            folder, prefix, above = stack.pop()
            files: list[str] = []
            folders: list[tuple[str, str, frozenset]] = []
            try:
                with os.scandir(folder) as entries:
                    for entry in entries:
                        name = entry.name
                        if name.startswith("."):
                            continue
                        try:
                            is_dir = entry.is_dir()
                        except OSError:
                            is_dir = False
                        if is_dir:
                            identity = _identity(entry.path)
                            if identity not in above:
                                folders.append((entry.path, f"{prefix}{name}/", above | {identity}))
                            continue
                        if wanted is not None and splitext(name)[1].lower() not in wanted:
                            continue
                        try:
                            if not entry.is_file():
                                continue  # broken symlinks, sockets, ...
                        except OSError:
                            continue
                        files.append(prefix + name)
            except OSError:
                continue  # as os.walk: a folder that cannot be listed (to the end) is skipped
            found += files
            stack += folders
        found.sort()
        return found

    def _not_found(self, path: str, full: str) -> FileNotFoundError:
        return FileNotFoundError(f"dataset {self.id!r}: no file {path!r} (looked at {full})")

    def read(self, path: str) -> bytes:
        """The bytes of ``path``; FileNotFoundError naming the full path when it is missing."""
        full = self._full(path)
        try:
            with open(full, "rb") as handle:
                return handle.read()
        except FileNotFoundError:
            raise self._not_found(path, full) from None

    def read_head(self, path: str, num_bytes: int) -> bytes:
        """Up to ``num_bytes`` bytes from the start of ``path`` (for header parsing)."""
        full = self._full(path)
        try:
            with open(full, "rb") as handle:
                # A first small read: most headers (and tiny files) end there, and one large read
                # costs a large buffer for every file.
                head = handle.read(min(num_bytes, _FIRST_READ))
                if len(head) < _FIRST_READ or num_bytes <= _FIRST_READ:
                    return head
                return head + handle.read(num_bytes - len(head))
        except FileNotFoundError:
            raise self._not_found(path, full) from None

    def read_tail(self, path: str, num_bytes: int) -> bytes:
        """Up to ``num_bytes`` bytes from the end of ``path`` (to tell a cut-off file)."""
        full = self._full(path)
        try:
            descriptor = os.open(full, os.O_RDONLY)
        except FileNotFoundError:
            raise self._not_found(path, full) from None
        try:
            size = os.fstat(descriptor).st_size
            return os.pread(descriptor, min(num_bytes, size), max(size - num_bytes, 0))
        finally:
            os.close(descriptor)

    def exists(self, path: str) -> bool:
        """Whether ``path`` is an existing file under the root."""
        full = self._full(path)
        try:
            return stat.S_ISREG(os.stat(full).st_mode)
        except OSError as exc:
            if exc.errno not in _MISSING_ERRNOS:
                raise
            return False
        except ValueError:
            return False

    def size(self, path: str) -> int:
        """Size of ``path`` in bytes."""
        return self._stat(path).st_size

    def identity(self, path: str) -> str:
        """``"{size}:{mtime_ns}"``: changes when the file is rewritten."""
        st = self._stat(path)
        return f"{st.st_size}:{st.st_mtime_ns}"

    def _stat(self, path: str) -> os.stat_result:
        full = self._full(path)
        try:
            return os.stat(full)
        except FileNotFoundError:
            raise self._not_found(path, full) from None


def _identity(folder: str) -> tuple[int, int]:
    """``(device, inode)`` of ``folder`` (symlinks followed); a folder that cannot be read gets a
    value no other folder has."""
    try:
        st = os.stat(folder)
    except OSError:
        return (-1, hash(folder))
    return (st.st_dev, st.st_ino)
