"""ShardedTensorStore: cached tensors on disk, many entries per safetensors file.

An entry (``dict[str, Tensor]`` under a string key) lives in a shard as tensors ``"{key}|{name}"``, read
through cached ``safe_open`` handles (mmap, no pickle, no open per read). Writes are atomic; a full disk
raises :class:`~simpletuner.diskspace.NoSpace`. Shards are indexed from their headers (an unreadable one
is skipped with a warning), which also hold a CRC-32 per tensor (``"crc32:{key}|{name}"``, checked by
:class:`~simpletuner.caching.shard_checks.ShardVerifier`, not on the training path) and an entry's source
hash (``"source:{key}"``). One writer per process; separate processes may write their own shards into one
folder and :meth:`refresh`. See documentation/RELIABILITY.md, "Caches".
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Iterable, Iterator, Mapping, Sequence

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from simpletuner.caching.integrity import (
    CHECKSUM_PREFIX,
    KEY_SEPARATOR,
    SOURCE_HASH_PREFIX,
    UNVERIFIED_VERSION,
    BadShard,
    CacheIntegrityError,
    CheckedRead,
    CompactReport,
    VerifyReport,
    group_tensor_names,
    read_header,
    tensor_checksum,
)
from simpletuner.caching.markers import FolderMarkers
from simpletuner.caching.shard_checks import QUARANTINE_SUFFIX, ShardVerifier
from simpletuner.diskspace import disk_full_guard, inject_fault, require_space
from simpletuner.file_modes import ordinary_permissions

logger = logging.getLogger(__name__)

SHARD_GLOB = "shard-*.safetensors"
_TEMP_PREFIX = ".tmp-shard-"
_FORMAT_NAME = "simpletuner.sharded_tensor_store"
_FORMAT_VERSION = "2"

__all__ = ["CacheIntegrityError", "CheckedRead", "CompactReport", "ShardedTensorStore", "VerifyReport"]


@dataclass(frozen=True)
class _Unreadable:
    reason: str
    keys: tuple[str, ...]  # entries its header lists, when the header itself could be read
    is_corrupt: bool  # a damaged safetensors file (safe to move aside), not a foreign or newer one


def _owned_cpu_tensors(entries: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Flatten entries to ``{"key|name": tensor}`` with contiguous CPU tensors owning their memory.

    safetensors refuses tensors that share storage, and a slice of a batch (the usual
    result of a batched encode) shares the batch's storage, so such views are cloned.
    """
    flat: dict[str, torch.Tensor] = {}
    seen_storage: set[int] = set()
    for key, entry in entries.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"store keys must be non-empty str, got {key!r}")
        if KEY_SEPARATOR in key:
            raise ValueError(f"store key {key!r} must not contain {KEY_SEPARATOR!r}")
        if not isinstance(entry, Mapping) or not entry:
            raise ValueError(f"entry {key!r} must be a non-empty dict of tensors, got {type(entry).__name__}")
        for name, tensor in entry.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"entry {key!r}: tensor names must be non-empty str, got {name!r}")
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"entry {key!r}: {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
            tensor = tensor.detach().to("cpu").contiguous()
            storage = tensor.untyped_storage()
            is_view = tensor.storage_offset() != 0 or storage.nbytes() != tensor.nbytes
            if is_view or storage.data_ptr() in seen_storage:
                tensor = tensor.clone()
            seen_storage.add(tensor.untyped_storage().data_ptr())
            flat[f"{key}{KEY_SEPARATOR}{name}"] = tensor
    return flat


def _shard_bytes(flat: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> int:
    """About the size of the shard file: the tensors' bytes plus its JSON header (each tensor's
    name, dtype, shape and offsets, ~80 characters besides the name, and the metadata)."""
    header = sum(len(name) + 80 for name in flat) + sum(len(k) + len(v) + 6 for k, v in metadata.items())
    return sum(t.nbytes for t in flat.values()) + header


class ShardedTensorStore:
    """A folder of safetensors shards mapping string keys to ``dict[str, Tensor]`` entries.

    Args:
        root: the folder; created if missing.
        max_open_shards: how many ``safe_open`` handles (mmaps) to keep; least recently
            used ones are dropped beyond that.
    """

    def __init__(self, root: str | os.PathLike[str], max_open_shards: int = 512):
        if max_open_shards < 1:
            raise ValueError(f"max_open_shards must be >= 1, got {max_open_shards}")
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():
            raise ValueError(f"cache store root {self.root} exists and is not a folder")
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_open_shards = max_open_shards
        # key -> (shard path, tensor names in that entry); the newest shard holding a key wins
        self._index: dict[str, tuple[Path, tuple[str, ...]]] = {}
        self._indexed_shards: set[Path] = set()
        self._shard_keys: dict[Path, tuple[str, ...]] = {}  # every key each readable shard holds
        self._shard_order: dict[Path, tuple[int, str]] = {}  # (write time ns, name): newer wins
        self._unreadable: dict[Path, _Unreadable] = {}
        self._handles: OrderedDict[Path, Any] = OrderedDict()
        self._markers = FolderMarkers(self.root, self.sync_folder)
        self.refresh()

    # --- indexing ---
    def refresh(self) -> int:
        """Index shards that appeared since the last scan (written by other processes).

        Returns the number of entries added to the index.
        """
        before = len(self._index)
        leftovers = sorted(self.root.glob(f"{_TEMP_PREFIX}*"))
        if leftovers:
            logger.warning(
                "%d unfinished temp file(s) from interrupted writes in %s (e.g. %s); they are ignored "
                "and safe to delete when no writer is running",
                len(leftovers),
                self.root,
                leftovers[0].name,
            )
        new_shards = [p for p in self.root.glob(SHARD_GLOB) if p not in self._indexed_shards]
        readable = []
        for shard in new_shards:
            self._indexed_shards.add(shard)
            indexed = self._read_shard_index(shard)
            if indexed is not None:
                readable.append((shard, *indexed))
        # Oldest first, so a key written again later resolves to the newest shard.
        for shard, order, entries in sorted(readable, key=lambda item: item[1]):
            self._shard_order[shard] = order
            self._shard_keys[shard] = tuple(entries)
            for key, names in entries.items():
                current = self._index.get(key)
                if current is None or self._shard_order[current[0]] < order:
                    self._index[key] = (shard, names)
        added = len(self._index) - before
        logger.debug("indexed %d shard(s), %d new entries in %s", len(new_shards), added, self.root)
        return added

    def _read_shard_index(self, shard: Path) -> tuple[tuple[int, str], dict[str, tuple[str, ...]]] | None:
        """``(write order, {key: tensor names})`` of one shard from its header, or None (recorded
        as unreadable) when it cannot be used. The order is the write time recorded in the
        header (format 2), else the file's mtime: in-place damage and copies that do not keep
        timestamps must not make an old copy of a key win over its re-encoded one."""
        try:
            with safe_open(str(shard), framework="pt") as handle:
                tensor_names = list(handle.keys())
                metadata = handle.metadata() or {}
        except SafetensorError as error:
            self._mark_unreadable(shard, error)
            return None
        except OSError as error:
            self._mark_unreadable(shard, error, reason=f"cannot be read: {error}", is_corrupt=False)
            return None
        version = metadata.get("version", UNVERIFIED_VERSION)
        if version not in (UNVERIFIED_VERSION, _FORMAT_VERSION):
            reason = f"written by a newer simpletuner (cache format version {version}); upgrade, or clear this cache"
            self._mark_unreadable(shard, None, reason=reason, is_corrupt=False)
            return None
        try:
            entries = group_tensor_names(shard, tensor_names)
        except BadShard as error:
            self._mark_unreadable(shard, None, reason=str(error), is_corrupt=False)
            return None
        written_ns = metadata.get("written_ns", "")
        order = int(written_ns) if written_ns.isdigit() else shard.stat().st_mtime_ns
        return (order, shard.name), entries

    def _mark_unreadable(
        self, shard: Path, error: Exception | None, reason: str | None = None, is_corrupt: bool = True
    ) -> None:
        keys: tuple[str, ...] = ()
        if is_corrupt:  # say what is wrong more plainly than safetensors, and which entries are lost
            try:
                header = read_header(shard, allow_truncated=True)
            except (BadShard, OSError) as detail:
                reason = reason or str(detail)
            else:
                reason = reason or header.truncation or f"corrupt ({error})"
                try:
                    keys = tuple(group_tensor_names(shard, header.tensors))
                except BadShard:
                    keys = ()
        reason = reason or str(error)
        self._unreadable[shard] = _Unreadable(reason, keys, is_corrupt)
        lost = f"its {len(keys)} entries are misses and will be re-encoded" if keys else "its entries are misses"
        logger.warning("skipping unreadable cache shard %s: %s; %s", shard, reason, lost)

    # --- mapping-like reads ---
    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._index))

    def keys(self) -> list[str]:
        """Every key the store holds."""
        return list(self._index)

    def shard_paths(self) -> list[Path]:
        """The shards currently holding at least one indexed entry."""
        return sorted({shard for shard, _ in self._index.values()})

    def shard_entries(self) -> dict[Path, tuple[str, ...]]:
        """Every readable shard and the keys it holds (including superseded copies)."""
        return dict(self._shard_keys)

    def superseded(self) -> dict[Path, list[str]]:
        """Per shard, the copies it holds that are not served any more (a newer shard holds the
        key, or it was discarded as corrupt); :meth:`compact` removes them."""
        out: dict[Path, list[str]] = {}
        for shard, keys in self._shard_keys.items():
            dead = [k for k in keys if self._index.get(k, (None,))[0] != shard]
            if dead:
                out[shard] = dead
        return out

    @property
    def unreadable_shards(self) -> dict[Path, str]:
        """Shards that could not be indexed, and why."""
        return {shard: info.reason for shard, info in self._unreadable.items()}

    def lost_keys(self) -> dict[str, str]:
        """Keys listed by unreadable shards and held by no readable one, with the reason."""
        lost: dict[str, str] = {}
        for shard, info in self._unreadable.items():
            for key in info.keys:
                if key not in self._index:
                    lost.setdefault(key, f"shard {shard.name} is unreadable: {info.reason}")
        return lost

    def quarantined_files(self) -> list[Path]:
        """Unreadable shards moved aside by :meth:`quarantine_unreadable`."""
        return sorted(self.root.glob(SHARD_GLOB + QUARANTINE_SUFFIX))

    def shard_handle(self, shard: Path) -> Any:
        """An open ``safe_open`` handle of ``shard`` (kept, up to ``max_open_shards``)."""
        handle = self._handles.get(shard)
        if handle is not None:
            self._handles.move_to_end(shard)
            return handle
        handle = safe_open(str(shard), framework="pt")
        self._handles[shard] = handle
        while len(self._handles) > self.max_open_shards:
            self._handles.popitem(last=False)
        return handle

    def locate(self, key: str) -> tuple[Path, tuple[str, ...]]:
        """``(shard, tensor names)`` of the entry ``key``; KeyError naming the key and the store root."""
        try:
            return self._index[key]
        except KeyError:
            raise KeyError(f"no cache entry {key!r} in store {self.root}") from None

    def get(self, key: str) -> dict[str, torch.Tensor]:
        """The entry stored under ``key``. Raises KeyError naming the key and the store root."""
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[dict[str, torch.Tensor]]:
        """The entries for ``keys``, in that order; reads are grouped by shard.

        Checksums are not checked here (the hot path; see :meth:`verify`).

        Raises:
            KeyError: a key is not stored.
            CacheIntegrityError: a shard cannot be opened or read any more.
        """
        by_shard: dict[Path, list[int]] = {}
        for position, key in enumerate(keys):
            shard, _ = self.locate(key)
            by_shard.setdefault(shard, []).append(position)
        results: list[dict[str, torch.Tensor] | None] = [None] * len(keys)
        for shard, positions in by_shard.items():
            try:
                handle = self.shard_handle(shard)
                for position in positions:
                    key = keys[position]
                    names = self._index[key][1]
                    results[position] = {name: handle.get_tensor(f"{key}{KEY_SEPARATOR}{name}") for name in names}
            except (SafetensorError, OSError) as error:
                raise CacheIntegrityError(
                    f"cache shard {shard} cannot be read any more ({error}); it changed after it was indexed. "
                    "Run `simpletuner cache verify --config <your config>` to check the cache; corrupt entries "
                    "are re-encoded when training starts again"
                ) from error
        return [entry for entry in results if entry is not None]  # every position was read

    def source_hashes(self, keys: Sequence[str]) -> dict[str, str | None]:
        """``{key: source hash recorded when it was written, or None}`` for each stored key in
        ``keys`` (others are left out); None for entries written without one (before source
        hashes were stored, or not encoded from a file). Reads shard headers only."""
        by_shard: dict[Path, list[str]] = {}
        for key in keys:
            if key in self._index:
                by_shard.setdefault(self._index[key][0], []).append(key)
        out: dict[str, str | None] = {}
        for shard, group in by_shard.items():
            try:
                metadata = self.shard_handle(shard).metadata() or {}
            except (SafetensorError, OSError):
                metadata = {}  # unreadable now: no recorded hash, so a content check re-encodes it
            out.update({key: metadata.get(SOURCE_HASH_PREFIX + key) for key in group})
        return out

    def load_all_into_memory(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every entry, read into CPU memory (unchecked; see :meth:`read_checked`)."""
        keys = self.keys()
        return dict(zip(keys, self.get_many(keys)))

    def _forget_shard(self, shard: Path) -> None:
        self._handles.pop(shard, None)
        self._shard_order.pop(shard, None)
        for key in self._shard_keys.pop(shard, ()):
            if self._index.get(key, (None,))[0] == shard:
                del self._index[key]
        self._indexed_shards.discard(shard)

    def served_keys(self, shard: Path) -> list[str]:
        """The keys ``shard`` holds that the index serves from it (not superseded, not discarded)."""
        return [k for k in self._shard_keys.get(shard, ()) if self._index.get(k, (None,))[0] == shard]

    def damaged_shards(self) -> dict[Path, tuple[str, ...]]:
        """Unreadable shards that are damaged safetensors files (not foreign or newer ones), and the keys
        their headers list."""
        return {shard: info.keys for shard, info in self._unreadable.items() if info.is_corrupt}

    def delete_shard(self, shard: Path) -> None:
        """Delete ``shard`` from disk and forget it (its entries there are no longer served)."""
        self._forget_shard(shard)
        self._unreadable.pop(shard, None)
        shard.unlink(missing_ok=True)

    def folder_bytes(self) -> int:
        """Bytes of the shards (readable or not) and quarantined files in the folder."""
        paths = [*self.root.glob(SHARD_GLOB), *self.quarantined_files()]
        total = 0
        for path in paths:
            try:
                total += path.stat().st_size
            except FileNotFoundError:
                pass
        return total

    # --- writes ---
    def put_many(
        self, entries: Mapping[str, Mapping[str, torch.Tensor]], source_hashes: Mapping[str, str] | None = None
    ) -> Path:
        """Write ``entries`` as one new shard, atomically, and index them. Returns the shard path.

        Tensors go to CPU, contiguous, dtypes kept; a key already stored is overwritten (the new shard wins). The
        header records every tensor's checksum and ``source_hashes[key]`` for the keys given there.

        Raises:
            ValueError: ``entries`` is empty, a key is empty or contains ``"|"``, or an entry is not a
                non-empty dict of tensors.
            NoSpace: no room for the shard, checked first or hit while writing (the temp file is removed).
        """
        if not entries:
            raise ValueError("put_many needs at least one entry")
        flat = _owned_cpu_tensors(entries)
        shard_id = uuid.uuid4().hex
        final_path = self.root / f"shard-{shard_id}.safetensors"
        temp_path = self.root / f"{_TEMP_PREFIX}{shard_id}.safetensors"
        metadata = {
            "format": _FORMAT_NAME,
            "version": _FORMAT_VERSION,
            "num_entries": str(len(entries)),
            "checksum": "crc32 over each tensor's dtype, shape and bytes",
            "written_ns": str(time.time_ns()),
        }
        metadata.update({CHECKSUM_PREFIX + name: tensor_checksum(tensor) for name, tensor in flat.items()})
        metadata.update(
            {SOURCE_HASH_PREFIX + key: str(value) for key, value in (source_hashes or {}).items() if key in entries}
        )
        # Space: checked before the write (a disk filled since the fill's own check stops here,
        # nothing written); an ENOSPC during it removes the temp file and raises NoSpace. Shards
        # already written stay: they are complete, and the next fill reuses them.
        what, needed = f"a cache shard of {len(entries)} entries", _shard_bytes(flat, metadata)
        require_space(self.root, needed, what)
        is_done = False
        try:
            with disk_full_guard(self.root, needed, what, cleanup=[temp_path]):
                save_file(flat, str(temp_path), metadata=metadata)
                inject_fault("cache_shard")  # tests: a disk that fills before the temp file is complete
                ordinary_permissions(temp_path)  # safetensors writes 0600
                fd = os.open(temp_path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(temp_path, final_path)
            is_done = True
        finally:
            if not is_done:
                temp_path.unlink(missing_ok=True)
        self.sync_folder()
        self._indexed_shards.add(final_path)
        self._shard_keys[final_path] = tuple(entries)
        self._shard_order[final_path] = (int(metadata["written_ns"]), final_path.name)
        for key, entry in entries.items():
            self._index[key] = (final_path, tuple(entry))
        logger.debug("wrote %d entries to %s", len(entries), final_path)
        return final_path

    def sync_folder(self) -> None:
        """Persist renames in the folder (its entries); not every platform allows it."""
        if not hasattr(os, "O_DIRECTORY"):
            return
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as error:
            logger.debug("cannot open %s to fsync it: %s", self.root, error)
            return
        try:
            os.fsync(fd)
        except OSError as error:
            logger.debug("fsync of folder %s failed: %s", self.root, error)
        finally:
            os.close(fd)

    # --- integrity (:class:`~simpletuner.caching.shard_checks.ShardVerifier`) ---
    def verify(self, keys: Iterable[str] | None = None, desc: str | None = None) -> VerifyReport:
        """See :meth:`ShardVerifier.verify <simpletuner.caching.shard_checks.ShardVerifier.verify>`."""
        return ShardVerifier(self).verify(keys, desc)

    def read_checked(self, keys: Sequence[str]) -> CheckedRead:
        """See :meth:`ShardVerifier.read_checked <simpletuner.caching.shard_checks.ShardVerifier.read_checked>`."""
        return ShardVerifier(self).read_checked(keys)

    def compact(self, keep: Collection[str]) -> CompactReport:
        """See :meth:`ShardVerifier.compact <simpletuner.caching.shard_checks.ShardVerifier.compact>`."""
        return ShardVerifier(self).compact(keep)

    def discard(self, keys: Iterable[str]) -> None:
        """Stop serving ``keys`` (in this process; nothing on disk changes), e.g. corrupt
        entries about to be re-encoded: they become misses, and a later write wins."""
        for key in keys:
            self._index.pop(key, None)

    def quarantine_unreadable(self) -> list[Path]:
        """Rename damaged shards (truncated, corrupt header) to ``<name>.corrupt`` so they stop
        being scanned; returns the new paths. Foreign or newer-format shards are left alone."""
        moved = []
        for shard, info in list(self._unreadable.items()):
            if not info.is_corrupt:
                continue
            target = shard.with_name(shard.name + QUARANTINE_SUFFIX)
            try:
                os.replace(shard, target)
            except FileNotFoundError:
                pass  # already gone
            except OSError as error:
                logger.warning("cannot move unreadable cache shard %s aside: %s", shard, error)
                continue
            else:
                moved.append(target)
                logger.warning("moved unreadable cache shard %s aside to %s (%s)", shard.name, target.name, info.reason)
            del self._unreadable[shard]
            self._indexed_shards.discard(shard)
        return moved

    # --- removal (e.g. the per-epoch augmented latents) ---
    def remove(self, keys: Iterable[str]) -> int:
        """Delete the entries of ``keys`` from disk (unlike :meth:`discard`); returns how many were held.

        A shard holding nothing else is deleted; one that also holds entries still served is
        rewritten without them first (new shard atomically, then the old one deleted), so a
        crash leaves every kept entry readable. Not for a folder another process reads from.
        """
        doomed = set(keys)
        num_removed = sum(key in self._index for key in doomed)
        for shard, shard_keys in list(self._shard_keys.items()):
            if not doomed.intersection(shard_keys):
                continue
            kept = [k for k in self.served_keys(shard) if k not in doomed]
            if kept:
                self.put_many(dict(zip(kept, self.get_many(kept))), source_hashes=self.recorded_sources(kept))
            self._forget_shard(shard)
            shard.unlink(missing_ok=True)
        self.discard(doomed)  # keys held only by unreadable shards
        self.sync_folder()
        return num_removed

    def recorded_sources(self, keys: Iterable[str]) -> dict[str, str]:
        """The source hashes recorded for ``keys`` (those that have one), to rewrite them with."""
        return {key: value for key, value in self.source_hashes(list(keys)).items() if value is not None}

    # --- markers (:mod:`simpletuner.caching.markers`) ---
    def write_marker(self, name: str, content: Mapping[str, Any]) -> None:
        """Record ``content`` (JSON-able) under ``name`` in the store folder, atomically."""
        self._markers.write(name, content)

    def read_marker(self, name: str) -> dict[str, Any] | None:
        """The content of marker ``name``, or None when there is none (or it cannot be parsed)."""
        return self._markers.read(name)

    def marker_names(self) -> list[str]:
        """Names of the markers in the folder."""
        return self._markers.names()

    def remove_marker(self, name: str) -> None:
        """Delete marker ``name`` (nothing happens when there is none)."""
        self._markers.remove(name)

    def close(self) -> None:
        """Drop every open shard handle (they are reopened on the next read)."""
        self._handles.clear()

    def __repr__(self) -> str:
        return f"ShardedTensorStore(root={str(self.root)!r}, entries={len(self)})"
