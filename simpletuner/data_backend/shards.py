"""Datasets stored in shard files, read in place: webdataset tar shards here, Parquet files in
:mod:`.parquet_shards` (on the shared base :class:`_ShardBackend`).

Each shard is indexed once (tar member headers; a Parquet footer and name columns) and every read goes to
the bytes inside it. A file has a *virtual path* ``"<shard>/<name>"`` and its caption appears as
``<stem>.txt`` beside it. ``list_files`` is shard-major (shards sorted, then each shard's own order), so a
pass reads each shard front to back (``shard_of``). A shard rewritten or deleted after indexing is never
read stale: the read raises, naming it. See documentation/DATA_SOURCES.md, "Shard datasets".
"""

from __future__ import annotations

import logging
import os
import tarfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Iterable, NamedTuple, Sequence

from simpletuner.data_backend.base import IMAGE_EXTENSIONS, normalize_extensions
from simpletuner.data_backend.captions import caption_file

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig
    from simpletuner.configuration.dataset_sections import WebDatasetConfig

logger = logging.getLogger(__name__)

#: Fields of a webdataset sample read as its caption, best first (``0001.txt``, ``0001.caption``, ...).
CAPTION_FIELDS: tuple[str, ...] = ("txt", "caption", "text")
#: Decoded Parquet row groups kept in memory per backend (reading in order needs one).
ROW_GROUP_CACHE_SIZE = 4
#: Magic bytes of compressed archives that are not plain tar (a ``.tar`` that needs decompressing first).
#: Zero bytes a tar may carry after its end-of-archive marker (GNU tar pads to 10 KiB records; some writers more).
_MAX_TAR_PADDING = 1 << 20
_COMPRESSED = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ": "xz", b"\x28\xb5\x2f\xfd": "zstd"}


class _Entry(NamedTuple):
    """Where a virtual file's bytes live: its shard (index), position (tar: data offset; Parquet: row)
    and size (tar; -1 for Parquet, known once the row is read)."""

    shard: int
    position: int
    size: int
    is_caption: bool


@dataclass(frozen=True)
class _Shard:
    path: str  # relative to the dataset root (POSIX)
    full: Path
    size: int  # when indexed
    mtime_ns: int


def find_shard_files(root: Path, suffix: str) -> list[str]:
    """Relative POSIX paths of the files under ``root`` ending in ``suffix`` (any case), recursive and
    sorted; hidden files and folders (names starting with ``.``) are skipped."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            full = Path(dirpath) / name
            if not name.startswith(".") and name.lower().endswith(suffix) and full.is_file():
                found.append(full.relative_to(root).as_posix())
    return sorted(found)


class _ShardBackend:
    """What both shard backends share: the shard list, the virtual file table, and the protocol's
    lookups (``list_files``, ``exists``, ``identity``, ``shard_of``)."""

    suffix = ""
    kind = ""

    def __init__(self, root: str | Path, id: str, paths: Sequence[str] | None = None):
        """``paths``: the shards, relative POSIX paths under ``root`` (read in sorted order); None: every file
        under ``root`` with the backend's suffix."""
        self.root = Path(root).expanduser()
        self.id = id
        if not self.root.is_dir():
            raise ValueError(
                f"dataset {id!r}: {self.root} is not a folder; set `instance_data_dir` to the folder that holds the "
                f"{self.suffix} files"
            )
        paths = find_shard_files(self.root, self.suffix) if paths is None else sorted(paths)
        if not paths:
            raise ValueError(self._no_shards_message())
        self.shards: list[_Shard] = []
        for rel in paths:
            full = self.root / rel
            st = full.stat()
            self.shards.append(_Shard(rel, full, st.st_size, st.st_mtime_ns))
        self._entries: dict[str, _Entry] = {}
        self._order: list[str] = []

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, root={str(self.root)!r}, shards={len(self.shards)})"

    def _no_shards_message(self) -> str:
        return (
            f"dataset {self.id!r}: no {self.suffix} files under {self.root} (searched recursively, hidden ones "
            f"skipped); set `instance_data_dir` to the folder of the {self.kind} shards"
        )

    def _where(self, index: int) -> str:
        return f"dataset {self.id!r}: {self.shards[index].full}"

    def _add(self, path: str, entry: _Entry) -> None:
        if path not in self._entries:
            self._order.append(path)
        self._entries[path] = entry

    # --- DataBackend ---------------------------------------------------------------------------------------------
    def list_files(self, extensions: Iterable[str] | None = None) -> list[str]:
        """Virtual paths ``"<shard>/<name>"``: shards in sorted order, each shard's files in its own order."""
        wanted = normalize_extensions(extensions)
        if wanted is None:
            return list(self._order)
        return [p for p in self._order if PurePosixPath(p).suffix.lower() in wanted]

    def exists(self, path: str) -> bool:
        """Whether ``path`` is a file of this dataset (an image or caption found when indexing)."""
        return path in self._entries

    def identity(self, path: str) -> str:
        """``"{shard size}:{shard mtime_ns}:{position in the shard}"``: changes when the shard is rewritten. A
        shard gone since it was indexed keeps its indexed identity: what the key describes is what was indexed,
        and a read of it fails naming the shard (:meth:`_stat`)."""
        entry = self._entry(path)
        shard = self.shards[entry.shard]
        try:
            st = shard.full.stat()
        except FileNotFoundError:
            return f"{shard.size}:{shard.mtime_ns}:{entry.position}"
        return f"{st.st_size}:{st.st_mtime_ns}:{entry.position}"

    def shard_of(self, path: str) -> str:
        """The shard holding ``path``: its path relative to the dataset root (``"shard-000.tar"``)."""
        return self.shards[self._entry(path).shard].path

    def _entry(self, path: str) -> _Entry:
        try:
            return self._entries[path]
        except KeyError:
            raise FileNotFoundError(
                f"dataset {self.id!r}: no file {path!r} in the shards under {self.root}; use a path as returned by "
                "list_files() (`<shard>/<name>`)"
            ) from None

    def _gone(self, index: int) -> FileNotFoundError:
        return FileNotFoundError(
            f"{self._where(index)} is gone: the shard was deleted or moved after the run found it at its start, so "
            "none of its files can be read; put it back and run again to train on them"
        )

    def _stat(self, index: int) -> os.stat_result:
        """The shard's ``stat`` now; FileNotFoundError naming the shard and the dataset when it is gone."""
        try:
            return self.shards[index].full.stat()
        except FileNotFoundError:
            raise self._gone(index) from None

    def _check_unchanged(self, index: int, st: os.stat_result) -> None:
        shard = self.shards[index]
        if (st.st_size, st.st_mtime_ns) != (shard.size, shard.mtime_ns):
            raise OSError(
                f"{self._where(index)} changed after it was indexed (size {shard.size} -> {st.st_size} bytes or a "
                "new mtime); its files cannot be read at their old places: start the run again so it is indexed anew"
            )


# --- webdataset ----------------------------------------------------------------------------------------------------
def _tar_members(full: Path, where: str) -> list[tuple[str, int, int]]:
    """``(name, data offset, size)`` of every regular file in the tar ``full``, in stored order; only
    headers are read. Raises ValueError (naming ``where``) for a file that is not an uncompressed tar or
    is cut off."""
    with open(full, "rb") as handle:
        magic = handle.read(6)
        for prefix, codec in _COMPRESSED.items():
            if magic.startswith(prefix):
                raise ValueError(
                    f"{where} is {codec}-compressed; shards are read in place, which needs plain tar: decompress it "
                    f"(the file inside is the .tar) or write the shards uncompressed"
                )
        handle.seek(0)
        file_size = os.fstat(handle.fileno()).st_size
        members = []
        try:
            with tarfile.open(fileobj=handle, mode="r:") as archive:
                for info in archive:
                    if info.isreg():
                        members.append((info.name, info.offset_data, info.size))
                end = archive.offset  # the end-of-archive marker, when there is one
        except (tarfile.TarError, EOFError) as exc:
            what = "is cut off" if "unexpected end" in str(exc) else "is not a readable tar file"
            raise ValueError(
                f"{where} {what} ({exc}); replace it with a complete tar shard or move it out of `instance_data_dir`"
            ) from None
        for name, offset, size in members:
            if offset + size > file_size:
                raise ValueError(
                    f"{where} is cut off: member {name!r} needs bytes up to {offset + size} but the file has "
                    f"{file_size}; copy the shard again"
                )
        handle.seek(end)
        marker = handle.read(512)
        if len(marker) < 512 or marker.strip(b"\0"):
            raise ValueError(
                f"{where} is cut off after {len(members)} member(s): no tar end-of-archive marker at byte {end} "
                "(an incomplete copy or download); copy the shard again"
            )
        # After the marker only zero padding (to a 10 KiB record) may follow: more is a second archive
        # appended to the first (`cat a.tar b.tar`), whose members tar readers never see.
        tail = file_size - end
        if tail > _MAX_TAR_PADDING or handle.read(tail).strip(b"\0"):
            raise ValueError(
                f"{where} holds data after its end-of-archive marker at byte {end} ({tail} more bytes: tar files "
                "joined with `cat`?); tar readers stop at the marker, so those members would be lost. Re-create the "
                "shard as one archive"
            )
    return members


def _member_name(name: str) -> str | None:
    """A member's name as a relative POSIX path (``./`` and leading ``/`` dropped), or None when any part
    is hidden (``.``-prefixed: ``._0001.jpg`` from macOS) or ``..``."""
    parts = [p for p in name.replace("\\", "/").split("/") if p not in ("", ".")]
    if not parts or any(p.startswith(".") for p in parts):
        return None
    return "/".join(parts)


class WebDatasetBackend(_ShardBackend):
    """webdataset tar shards under ``root``, read in place.

    A sample is the members sharing a *key*: the member path up to the first dot of its file name
    (``a/0001.jpg`` and ``a/0001.txt`` are sample ``a/0001``, fields ``jpg`` and ``txt``). Members whose
    field is an image extension (``jpg``, ``jpeg``, ``png``, ``webp``) are the training images; the
    sample's ``txt`` (else ``caption``, else ``text``) member is exposed as ``<key>.txt``. Other members
    (``json``, ``cls``, images of compound fields such as ``seg.png``) are not listed; how many is logged.
    """

    suffix = ".tar"
    kind = "webdataset"

    def __init__(self, root: str | Path, id: str):
        super().__init__(root, id)
        ignored: Counter[str] = Counter()
        for index in range(len(self.shards)):
            self._index_tar(index, ignored)
        if ignored:
            logger.info(
                "dataset %r: members not used for training (fields other than images and %s): %s",
                id,
                "/".join(CAPTION_FIELDS),
                dict(ignored.most_common(10)),
            )

    def _no_shards_message(self) -> str:
        message = super()._no_shards_message()
        compressed = [
            p
            for suffix in (".tar.gz", ".tgz", ".tar.zst", ".tar.bz2", ".tar.xz")
            for p in find_shard_files(self.root, suffix)
        ]
        if compressed:
            message += (
                f" ({len(compressed)} compressed shard(s) there, e.g. {compressed[0]}: decompress them to .tar, "
                "which can be read in place)"
            )
        return message

    def _index_tar(self, index: int, ignored: Counter[str]) -> None:
        shard = self.shards[index]
        images: list[tuple[str, str, int, int]] = []  # (key, name, offset, size)
        captions: dict[str, tuple[int, int, int]] = {}  # key -> (rank of the field, offset, size)
        for raw_name, offset, size in _tar_members(shard.full, self._where(index)):
            name = _member_name(raw_name)
            if name is None:
                ignored["hidden"] += 1
                continue
            folder, _, base = name.rpartition("/")
            stem, dot, field = base.partition(".")
            field = field.lower()
            key = f"{folder}/{stem}" if folder else stem
            if not stem or not dot:
                ignored["(no extension)"] += 1
            elif f".{field}" in IMAGE_EXTENSIONS:
                images.append((key, name, offset, size))
            elif field in CAPTION_FIELDS:
                rank = CAPTION_FIELDS.index(field)
                if key not in captions or rank <= captions[key][0]:
                    captions[key] = (rank, offset, size)
            else:
                ignored[field] += 1
        for key, name, offset, size in images:
            path = f"{shard.path}/{name}"
            self._add(path, _Entry(index, offset, size, False))
            if key in captions:
                _, text_offset, text_size = captions[key]
                self._add(caption_file(path), _Entry(index, text_offset, text_size, True))

    def read(self, path: str) -> bytes:
        """The bytes of the member behind ``path``, read from its shard."""
        entry = self._entry(path)
        return self._pread(entry.shard, entry.position, entry.size)

    def read_head(self, path: str, num_bytes: int) -> bytes:
        """Up to ``num_bytes`` bytes from the start of ``path`` (for header parsing)."""
        entry = self._entry(path)
        return self._pread(entry.shard, entry.position, min(num_bytes, entry.size))

    def read_tail(self, path: str, num_bytes: int) -> bytes:
        """Up to ``num_bytes`` bytes from the end of ``path`` (to tell a cut-off member)."""
        entry = self._entry(path)
        length = min(num_bytes, entry.size)
        return self._pread(entry.shard, entry.position + entry.size - length, length)

    def size(self, path: str) -> int:
        """The member's size in bytes."""
        return self._entry(path).size

    def _pread(self, index: int, offset: int, length: int) -> bytes:
        # A file opened per read and a positional read: safe from the decoding threads, and no
        # descriptor limit to hit with thousands of shards.
        try:
            handle = open(self.shards[index].full, "rb")
        except FileNotFoundError:
            raise self._gone(index) from None
        with handle:
            self._check_unchanged(index, os.fstat(handle.fileno()))
            data = os.pread(handle.fileno(), length, offset)
        if len(data) != length:
            raise OSError(f"{self._where(index)}: read {len(data)} of {length} bytes at offset {offset}")
        return data


# --- Parquet -------------------------------------------------------------------------------------------------------
# --- builders (simpletuner.data_backend.factory.BUILDERS) -----------------------------------------------------------
def build_webdataset_backend(dataset_cfg: WebDatasetConfig, config: TrainingConfig) -> WebDatasetBackend:
    """A :class:`WebDatasetBackend` over the ``.tar`` shards under ``dataset_cfg.instance_data_dir``."""
    return WebDatasetBackend(dataset_cfg.instance_data_dir, dataset_cfg.id)
