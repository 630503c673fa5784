"""A cache store held in memory: CPU RAM (`memory`) or CUDA managed memory (`unified_memory`).

Same surface as :class:`ShardedTensorStore`, so :class:`TensorCache` works on either. With a
backing disk store (``persistent_cache``) every entry is also written to disk and the next run
loads them from there instead of encoding again.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import torch
from tqdm import tqdm

from simpletuner.caching.store import ShardedTensorStore

logger = logging.getLogger(__name__)

Placement = Callable[[torch.Tensor], torch.Tensor]


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


class MemoryTensorStore:
    """Entries in a dict, each tensor passed through ``place`` when stored (e.g. into managed
    memory with a residency hint) and through ``prefetch`` when read (e.g. migrate to the GPU
    before the batch is stacked, instead of faulting page by page)."""

    def __init__(
        self,
        name: str,
        place: Placement = _keep,
        prefetch: Placement = _keep,
        backing: ShardedTensorStore | None = None,
    ):
        self.name = name
        self._place = place
        self._prefetch = prefetch
        self.backing = backing
        self.root: Path | str = backing.root if backing is not None else f"<memory:{name}>"
        self._entries: dict[str, dict[str, torch.Tensor]] = {}
        if backing is not None and len(backing):
            keys = backing.keys()
            for start in tqdm(range(0, len(keys), 256), desc=f"loading {name} cache", unit="chunk", disable=None):
                chunk = keys[start : start + 256]
                for key, entry in zip(chunk, backing.get_many(chunk)):
                    self._entries[key] = {n: self._place(t) for n, t in entry.items()}
            logger.info("%s cache: loaded %d entries from %s into memory", name, len(self._entries), backing.root)

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
        out = []
        for key in keys:
            try:
                entry = self._entries[key]
            except KeyError:
                raise KeyError(f"{key!r} is not in the {self.name} cache ({self.root})") from None
            out.append({n: self._prefetch(t) for n, t in entry.items()})
        return out

    def put_many(self, entries: Mapping[str, Mapping[str, torch.Tensor]]) -> Path | None:
        """Store in memory (placed) and, when persistent, on disk too; returns the shard written."""
        shard = self.backing.put_many(entries) if self.backing is not None else None
        for key, entry in entries.items():
            self._entries[key] = {n: self._place(t.detach().to("cpu", copy=True)) for n, t in entry.items()}
        return shard

    def __repr__(self) -> str:
        return f"MemoryTensorStore(name={self.name!r}, entries={len(self)}, backing={self.backing!r})"
