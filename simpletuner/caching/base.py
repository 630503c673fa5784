"""The protocol every tensor store implements: what :class:`~simpletuner.caching.tensor_cache.TensorCache`
and the re-encoding modes ask of the store under them.

Implementations: :class:`~simpletuner.caching.store.ShardedTensorStore` (safetensors shards on disk) and
:class:`~simpletuner.caching.memory_store.MemoryTensorStore` (RAM or managed memory, optionally written
through to a disk store). A store may also offer ``stack(tensors)``, which ``get_batch`` uses to build a
batch (into managed memory for a unified-memory cache); without it batches are ``torch.stack``-ed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol, Sequence, runtime_checkable

import torch

from simpletuner.caching.integrity import VerifyReport

#: Called with each cache folder a run writes to disk (``StateTracker.register_cache_dir``).
RecordCacheDir = Callable[[Path], None]


@runtime_checkable
class TensorStore(Protocol):
    """String keys mapping to ``dict[str, Tensor]`` entries, with checksums, source hashes and markers."""

    @property
    def root(self) -> Path | str:
        """Where the entries live (a folder), or a name for logs when they live in memory only."""
        ...

    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[str]: ...

    def keys(self) -> list[str]:
        """Every key held, as a list."""
        ...

    def refresh(self) -> int:
        """Take in the entries other processes stored since this store was opened; returns how many."""
        ...

    def get(self, key: str) -> dict[str, torch.Tensor]:
        """One entry; KeyError naming the key and the store when it is not held."""
        ...

    def get_many(self, keys: Sequence[str]) -> list[dict[str, torch.Tensor]]:
        """The entries of ``keys``, in order (a key may repeat)."""
        ...

    def put_many(
        self, entries: Mapping[str, Mapping[str, torch.Tensor]], source_hashes: Mapping[str, str] | None = None
    ) -> Path | None:
        """Store ``entries`` (a stored key is overwritten), each with its source hash when given; returns
        the shard written, if any."""
        ...

    def source_hashes(self, keys: Sequence[str]) -> dict[str, str | None]:
        """The source hash recorded with each held key of ``keys`` (None: none recorded)."""
        ...

    def verify(self, keys: Iterable[str] | None = None, desc: str | None = None) -> VerifyReport:
        """Check ``keys`` (every entry when None) against their checksums."""
        ...

    def discard(self, keys: Iterable[str]) -> None:
        """Stop serving ``keys`` (they become misses); nothing is deleted."""
        ...

    def remove(self, keys: Iterable[str]) -> int:
        """Delete ``keys``; returns how many were held."""
        ...

    def quarantine_unreadable(self) -> list[Path]:
        """Move damaged shards aside; returns where they went."""
        ...

    def write_marker(self, name: str, content: Mapping[str, Any]) -> None:
        """Record a small JSON-able marker (e.g. "this epoch's latents are whole") under ``name``."""
        ...

    def read_marker(self, name: str) -> dict[str, Any] | None:
        """The marker ``name``, or None."""
        ...

    def marker_names(self) -> list[str]:
        """Every marker's name, sorted."""
        ...

    def remove_marker(self, name: str) -> None:
        """Delete the marker ``name`` (nothing when there is none)."""
        ...
