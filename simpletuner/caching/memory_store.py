"""A cache store held in memory: CPU RAM (`memory`) or CUDA managed memory (`unified_memory`).

Same surface as :class:`ShardedTensorStore`, so :class:`TensorCache` works on either. With a
backing disk store (``persistent_cache``) every entry is also written to disk and the next run
loads them from there instead of encoding again. Loading checks every entry's checksum (it reads
each one anyway): a corrupt one is not loaded, becomes a miss, and :meth:`MemoryTensorStore.verify`
names it so the cache fill re-encodes and reports it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from tqdm import tqdm

from simpletuner.caching.integrity import VerifyReport, summarise_problems
from simpletuner.caching.markers import check_marker_name
from simpletuner.caching.store import ShardedTensorStore

logger = logging.getLogger(__name__)

Placement = Callable[[torch.Tensor], torch.Tensor]
Stack = Callable[[list[torch.Tensor]], torch.Tensor]


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


class MemoryTensorStore:
    """Entries in a dict, each tensor passed through ``place`` when stored (e.g. into managed
    memory with a residency hint) and through ``prefetch`` when read (e.g. migrate to the GPU
    before the batch is stacked, instead of faulting page by page; once per distinct entry of a
    read). ``stack`` builds a batch from entries (:meth:`TensorCache.get_batch`): into managed
    memory for a unified-memory cache, so the batch itself can be placed and prefetched."""

    def __init__(
        self,
        name: str,
        place: Placement = _keep,
        prefetch: Placement = _keep,
        backing: ShardedTensorStore | None = None,
        stack: Stack = torch.stack,
    ):
        self.name = name
        self._place = place
        self._prefetch = prefetch
        self.stack = stack
        self.backing = backing
        self.root: Path | str = backing.root if backing is not None else f"<memory:{name}>"
        self._entries: dict[str, dict[str, torch.Tensor]] = {}
        self._rejected: dict[str, str] = {}  # key -> why its backing copy was not loaded
        self._markers: dict[str, dict[str, Any]] = {}  # without a backing folder
        self._sources: dict[str, str] = {}  # source hashes, without a backing folder
        if backing is not None:
            self._load(backing)

    def refresh(self) -> int:
        """Load the entries other processes wrote to the backing folder since this store was opened
        (checked as at start-up); returns how many were added. Nothing to do without a backing folder."""
        if self.backing is None:
            return 0
        self.backing.refresh()
        before = len(self._entries)
        self._load(self.backing, [key for key in self.backing.keys() if key not in self._entries])
        return len(self._entries) - before

    def _load(self, backing: ShardedTensorStore, keys: list[str] | None = None) -> None:
        """Read and check every backing entry (or those of ``keys``); place the good ones, remember the bad ones."""
        self._rejected.update(backing.lost_keys())
        keys = backing.keys() if keys is None else keys
        num_unverified = 0
        for start in tqdm(range(0, len(keys), 256), desc=f"loading {self.name} cache", unit="chunk", disable=None):
            read = backing.read_checked(keys[start : start + 256])
            for key, entry in read.entries.items():
                self._entries[key] = {n: self._place(t) for n, t in entry.items()}
            self._rejected.update(read.problems)
            backing.discard(read.problems)  # the disk index must not serve them either
            num_unverified += read.num_unverified
        if keys:
            logger.info(
                "%s cache: loaded %d entries from %s into memory%s",
                self.name,
                len(self._entries),
                backing.root,
                f" ({num_unverified} unverified: written before checksums)" if num_unverified else "",
            )
        if self._rejected:
            logger.warning(
                "%s cache: %d corrupt entries in %s were not loaded; they are misses, re-encoded when needed: %s",
                self.name,
                len(self._rejected),
                backing.root,
                summarise_problems(self._rejected),
            )

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def keys(self) -> list[str]:
        return list(self._entries)

    def get(self, key: str) -> dict[str, torch.Tensor]:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[dict[str, torch.Tensor]]:
        """The entries for ``keys``, in order; each distinct entry is prefetched once (a batch often
        repeats a caption, and a dataset's repeats can put one sample twice in a batch)."""
        if self._prefetch is _keep:
            try:
                return [dict(self._entries[key]) for key in keys]  # a copy: callers may change theirs
            except KeyError as error:
                raise self._missing(error.args[0]) from None
        read: dict[str, dict[str, torch.Tensor]] = {}
        out = []
        for key in keys:
            entry = read.get(key)
            if entry is None:
                try:
                    stored = self._entries[key]
                except KeyError:
                    raise self._missing(key) from None
                entry = read[key] = {n: self._prefetch(t) for n, t in stored.items()}
            out.append(entry)
        return out

    def _missing(self, key: str) -> KeyError:
        return KeyError(f"{key!r} is not in the {self.name} cache ({self.root})")

    def put_many(
        self, entries: Mapping[str, Mapping[str, torch.Tensor]], source_hashes: Mapping[str, str] | None = None
    ) -> Path | None:
        """Store in memory (placed) and, when persistent, on disk too (with ``source_hashes``, see
        :meth:`ShardedTensorStore.put_many`); returns the shard written."""
        if self.backing is not None:
            shard = self.backing.put_many(entries, source_hashes=source_hashes)
        else:
            shard = None
            self._sources.update({k: v for k, v in (source_hashes or {}).items() if k in entries})
        for key, entry in entries.items():
            self._entries[key] = {n: self._place(t.detach().to("cpu", copy=True)) for n, t in entry.items()}
            self._rejected.pop(key, None)
        return shard

    def source_hashes(self, keys: Sequence[str]) -> dict[str, str | None]:
        """See :meth:`ShardedTensorStore.source_hashes` (the backing folder's, when there is one)."""
        held = [key for key in keys if key in self._entries]
        if self.backing is not None:
            return self.backing.source_hashes(held)
        return {key: self._sources.get(key) for key in held}

    # --- integrity (the same surface as ShardedTensorStore) ---
    def verify(self, keys: Iterable[str] | None = None, desc: str | None = None) -> VerifyReport:
        """Entries in memory were checked when loaded (or written by this process), so this
        reports the backing copies that failed their check at load time, for ``keys``."""
        asked = list(self._rejected) if keys is None else list(dict.fromkeys(keys))
        problems = {k: self._rejected[k] for k in asked if k in self._rejected}
        num_ok = sum(k in self._entries for k in asked) if keys is not None else len(self._entries)
        unreadable = self.backing.unreadable_shards if self.backing is not None else {}
        return VerifyReport(num_ok, 0, problems, unreadable)

    def discard(self, keys: Iterable[str]) -> None:
        """Stop serving ``keys`` (they become misses)."""
        keys = list(keys)
        for key in keys:
            self._entries.pop(key, None)
        if self.backing is not None:
            self.backing.discard(keys)

    def remove(self, keys: Iterable[str]) -> int:
        """Delete ``keys`` from memory and from the backing folder; returns how many were held."""
        keys = list(dict.fromkeys(keys))
        num_removed = sum(self._entries.pop(key, None) is not None for key in keys)
        for key in keys:
            self._rejected.pop(key, None)
            self._sources.pop(key, None)
        if self.backing is not None:
            self.backing.remove(keys)
        return num_removed

    # Markers live in the backing folder when there is one (they must outlive the process), else here.
    def write_marker(self, name: str, content: Mapping[str, Any]) -> None:
        """See :meth:`ShardedTensorStore.write_marker`."""
        if self.backing is not None:
            self.backing.write_marker(name, content)
        else:
            self._markers[check_marker_name(name)] = dict(content)

    def read_marker(self, name: str) -> dict[str, Any] | None:
        """See :meth:`ShardedTensorStore.read_marker`."""
        return self.backing.read_marker(name) if self.backing is not None else self._markers.get(name)

    def marker_names(self) -> list[str]:
        """See :meth:`ShardedTensorStore.marker_names`."""
        return self.backing.marker_names() if self.backing is not None else sorted(self._markers)

    def remove_marker(self, name: str) -> None:
        """See :meth:`ShardedTensorStore.remove_marker`."""
        if self.backing is not None:
            self.backing.remove_marker(name)
        self._markers.pop(name, None)

    def quarantine_unreadable(self) -> list[Path]:
        """Move damaged backing shards aside (see :meth:`ShardedTensorStore.quarantine_unreadable`)."""
        return self.backing.quarantine_unreadable() if self.backing is not None else []

    def __repr__(self) -> str:
        return f"MemoryTensorStore(name={self.name!r}, entries={len(self)}, backing={self.backing!r})"
