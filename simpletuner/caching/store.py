"""ShardedTensorStore: cached tensors on disk, many entries per safetensors file.

One file per sample (the usual layout) costs an open, a header parse and a pickle load
for every latent read, and leaves hundreds of thousands of small files behind. Here an
entry (``dict[str, Tensor]`` under a string key) lives in a shard, a safetensors file
holding many entries with tensor names ``"{key}|{name}"``. Reading goes through cached
``safe_open`` handles (mmap, no pickle), grouped by shard.

Writes are atomic: a shard is written to a hidden temp file in the same folder, fsync'd,
then ``os.replace``'d into place, so a crash leaves either the whole shard or none of it.
On start the store indexes shards from their headers only; a shard that cannot be opened
(truncated, corrupt, foreign) is skipped with a warning and its entries become misses.

Not safe for concurrent writers in one process; separate processes may each write their
own shards into one folder (names are uuids) and call :meth:`refresh` to see the others'.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

logger = logging.getLogger(__name__)

SHARD_GLOB = "shard-*.safetensors"
KEY_SEPARATOR = "|"
_TEMP_PREFIX = ".tmp-shard-"
_FORMAT_NAME = "simpletuner.sharded_tensor_store"
_FORMAT_VERSION = "1"


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
        # key -> (shard path, tensor names in that entry)
        self._index: dict[str, tuple[Path, tuple[str, ...]]] = {}
        self._indexed_shards: set[Path] = set()
        self._handles: OrderedDict[Path, object] = OrderedDict()
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
                len(leftovers), self.root, leftovers[0].name,
            )
        new_shards = [p for p in self.root.glob(SHARD_GLOB) if p not in self._indexed_shards]
        # Oldest first, so a key written again later resolves to the newest shard.
        new_shards.sort(key=lambda p: (p.stat().st_mtime_ns, p.name))
        for shard in new_shards:
            entries = self._read_shard_index(shard)
            self._indexed_shards.add(shard)
            if entries is None:
                continue
            for key, names in entries.items():
                self._index[key] = (shard, names)
        added = len(self._index) - before
        logger.debug("indexed %d shard(s), %d new entries in %s", len(new_shards), added, self.root)
        return added

    def _read_shard_index(self, shard: Path) -> dict[str, tuple[str, ...]] | None:
        """Key -> tensor names of one shard from its header, or None when it cannot be used."""
        try:
            with safe_open(str(shard), framework="pt") as handle:
                tensor_names = list(handle.keys())
        except (SafetensorError, OSError) as error:
            logger.warning("skipping unreadable cache shard %s (its entries will be recomputed): %s", shard, error)
            return None
        grouped: dict[str, list[str]] = {}
        for tensor_name in tensor_names:
            key, sep, name = tensor_name.partition(KEY_SEPARATOR)
            if not sep or not key or not name:
                logger.warning("skipping cache shard %s: tensor %r is not named 'key|name'", shard, tensor_name)
                return None
            grouped.setdefault(key, []).append(name)
        return {key: tuple(names) for key, names in grouped.items()}

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

    def _handle(self, shard: Path):
        handle = self._handles.get(shard)
        if handle is not None:
            self._handles.move_to_end(shard)
            return handle
        handle = safe_open(str(shard), framework="pt")
        self._handles[shard] = handle
        while len(self._handles) > self.max_open_shards:
            self._handles.popitem(last=False)
        return handle

    def _locate(self, key: str) -> tuple[Path, tuple[str, ...]]:
        try:
            return self._index[key]
        except KeyError:
            raise KeyError(f"no cache entry {key!r} in store {self.root}") from None

    def get(self, key: str) -> dict[str, torch.Tensor]:
        """The entry stored under ``key``. Raises KeyError naming the key and the store root."""
        shard, names = self._locate(key)
        handle = self._handle(shard)
        return {name: handle.get_tensor(f"{key}{KEY_SEPARATOR}{name}") for name in names}

    def get_many(self, keys: Sequence[str]) -> list[dict[str, torch.Tensor]]:
        """The entries for ``keys``, in that order; reads are grouped by shard."""
        by_shard: dict[Path, list[int]] = {}
        for position, key in enumerate(keys):
            shard, _ = self._locate(key)
            by_shard.setdefault(shard, []).append(position)
        results: list[dict[str, torch.Tensor] | None] = [None] * len(keys)
        for shard, positions in by_shard.items():
            handle = self._handle(shard)
            for position in positions:
                key = keys[position]
                names = self._index[key][1]
                results[position] = {name: handle.get_tensor(f"{key}{KEY_SEPARATOR}{name}") for name in names}
        return results  # type: ignore[return-value]

    def load_all_into_memory(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every entry, read into CPU memory (for memory-backed caches)."""
        keys = self.keys()
        return dict(zip(keys, self.get_many(keys)))

    # --- writes ---
    def put_many(self, entries: Mapping[str, Mapping[str, torch.Tensor]]) -> Path:
        """Write ``entries`` as one new shard, atomically, and index them. Returns the shard path.

        Tensors are detached, moved to CPU and made contiguous; dtypes are kept. A key that
        is already stored is overwritten (the new shard wins).

        Raises:
            ValueError: ``entries`` is empty, a key is empty or contains ``"|"``, or an entry
                is not a non-empty dict of tensors.
        """
        if not entries:
            raise ValueError("put_many needs at least one entry")
        flat = _owned_cpu_tensors(entries)
        shard_id = uuid.uuid4().hex
        final_path = self.root / f"shard-{shard_id}.safetensors"
        temp_path = self.root / f"{_TEMP_PREFIX}{shard_id}.safetensors"
        metadata = {"format": _FORMAT_NAME, "version": _FORMAT_VERSION, "num_entries": str(len(entries))}
        is_done = False
        try:
            save_file(flat, str(temp_path), metadata=metadata)
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
        self._fsync_root()
        self._indexed_shards.add(final_path)
        for key, entry in entries.items():
            self._index[key] = (final_path, tuple(entry))
        logger.debug("wrote %d entries to %s", len(entries), final_path)
        return final_path

    def _fsync_root(self) -> None:
        """Persist the rename itself (the folder entry); not every platform allows it."""
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

    def close(self) -> None:
        """Drop every open shard handle (they are reopened on the next read)."""
        self._handles.clear()

    def __repr__(self) -> str:
        return f"ShardedTensorStore(root={str(self.root)!r}, entries={len(self)})"
