"""TensorCache: encode each item once, store it, and serve stacked batches of it.

The VAE-latent and text-embed caches are both this: a list of ``(key, payload)`` items, a
batched ``compute`` (the encoder) run only on the keys the store does not hold yet, and
``get_batch`` for the training loop. Keys come from :mod:`simpletuner.caching.fingerprint`
so a key names everything its value depends on; an unknown key is simply a miss.

Before a fill counts an entry as a hit it checks it against its checksum (once per fill,
i.e. at start-up, not on every read): a corrupt or truncated entry becomes a miss, is
encoded again, and the fill logs "re-encoded N corrupt entries: ...".
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import time
from collections import deque
from concurrent.futures import Executor, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterator, Mapping, Sequence

import torch
from tqdm import tqdm

from simpletuner.caching.integrity import summarise_problems
from simpletuner.caching.memory_store import MemoryTensorStore
from simpletuner.caching.store import ShardedTensorStore

if TYPE_CHECKING:
    from simpletuner.state import StateTracker

logger = logging.getLogger(__name__)

DEFAULT_FLUSH_EVERY = 256
_MODEL_TAG_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")

Entry = dict[str, torch.Tensor]
ComputeFn = Callable[[list[Any]], Sequence[Mapping[str, torch.Tensor]]]


@dataclass(frozen=True)
class FillReport:
    """What one :meth:`TensorCache.fill` did. ``num_items`` counts distinct keys."""

    num_items: int
    num_hits: int
    num_computed: int
    seconds: float
    failed: tuple[str, ...] = ()  # keys compute could not produce (returned None for); not stored
    corrupt: tuple[str, ...] = ()  # stored keys that failed their integrity check and were computed again


def _plan_batches(
    misses: Mapping[str, Any], batch_size: int, group: Callable[[Any], Hashable] | None
) -> list[list[str]]:
    """Split miss keys into batches of at most ``batch_size`` that share one ``group`` value.

    Groups keep the order in which they first appear, and items keep their order inside
    a group, so a fill is deterministic for a given item list.
    """
    by_group: dict[Hashable, list[str]] = {}
    for key, payload in misses.items():
        group_id = group(payload) if group is not None else None
        by_group.setdefault(group_id, []).append(key)
    batches = []
    for keys in by_group.values():
        batches.extend(keys[start : start + batch_size] for start in range(0, len(keys), batch_size))
    return batches


def _prepared(
    batches: list[list[str]], misses: Mapping[str, Any], prepare: Callable[[list[Any]], Any] | None, workers: int,
    pool: Executor | None = None,
) -> Iterator[tuple[list[str], Any]]:
    """``(keys, prepare(payloads))`` per batch, in order; ``prepare`` runs on ``workers`` threads
    (``pool`` when given: it is left running for its owner) up to ``2 * workers`` batches ahead.
    Closing the generator cancels what has not started and waits for what has."""
    if prepare is None or workers < 1:
        for keys in batches:
            payloads = [misses[k] for k in keys]
            yield keys, payloads if prepare is None else prepare(payloads)
        return
    own_pool = pool is None
    if own_pool:
        pool = ThreadPoolExecutor(workers, thread_name_prefix="cache-prepare")
    ahead: deque = deque()
    try:
        todo = iter(batches)
        for keys in itertools.islice(todo, 2 * workers):
            ahead.append((keys, pool.submit(prepare, [misses[k] for k in keys])))
        while ahead:
            keys, future = ahead.popleft()
            for more in itertools.islice(todo, 1):
                ahead.append((more, pool.submit(prepare, [misses[k] for k in more])))
            yield keys, future.result()
    finally:
        if own_pool:
            pool.shutdown(wait=True, cancel_futures=True)
        else:
            for _, future in ahead:
                future.cancel()
            wait([future for _, future in ahead])


class TensorCache:
    """An encode-once cache of ``dict[str, Tensor]`` entries on a :class:`ShardedTensorStore`.

    Args:
        store: where entries live.
        name: a short name for logs and progress bars ("vae", "text").
        flush_every: write a shard each time this many computed entries are pending, so
            an interrupted fill loses at most that much work.
        verify: check every hit against its checksum before ``fill`` trusts it (reads each
            needed entry once at start-up); False trusts the index.
    """

    def __init__(
        self,
        store: ShardedTensorStore | MemoryTensorStore,
        name: str,
        flush_every: int = DEFAULT_FLUSH_EVERY,
        verify: bool = True,
    ):
        if flush_every < 1:
            raise ValueError(f"flush_every must be >= 1, got {flush_every}")
        self.store = store
        self.name = name
        self.flush_every = flush_every
        self.verify = verify

    def __contains__(self, key: object) -> bool:
        return key in self.store

    def __len__(self) -> int:
        return len(self.store)

    def get(self, key: str) -> Entry:
        """One entry. Raises KeyError naming the key and the store root."""
        return self.store.get(key)

    def fill(
        self,
        items: Sequence[tuple[str, Any]],
        compute: ComputeFn,
        batch_size: int,
        group: Callable[[Any], Hashable] | None = None,
        desc: str | None = None,
        prepare: Callable[[list[Any]], Any] | None = None,
        prepare_workers: int = 0,
        prepare_pool: Executor | None = None,
    ) -> FillReport:
        """Compute and store every item whose key the store does not hold yet.

        Args:
            items: ``(key, payload)`` pairs; a key given twice is computed once (first
                payload wins).
            compute: takes a list of payloads, returns one ``dict[str, Tensor]`` per payload,
                in order, or None for a payload it cannot encode (e.g. an image whose body is
                corrupt); those keys are not stored and are listed in ``FillReport.failed``.
                It is only called with payloads that share one ``group`` value.
            batch_size: the most payloads per ``compute`` call.
            group: payload -> hashable batch group (e.g. the image bucket), so a batch can be
                stacked; None puts everything in one group.
            desc: progress-bar label; defaults to ``"caching <name>"``.
            prepare: optional CPU stage (e.g. decode images) run on each batch of payloads
                before ``compute``, which then receives its result instead of the payloads.
            prepare_workers: threads running ``prepare`` ahead of ``compute`` (at most two
                batches per thread in flight); 0 runs it inline.
            prepare_pool: run ``prepare`` on this executor (of ``prepare_workers`` threads) instead of
                starting threads for this fill; it is left running (``dataloader_persistent_workers``).

        Entries are written in shards of ``flush_every`` as they are computed, and what is
        pending is written even when ``compute`` raises, so a crash loses little. Stored
        entries that fail their checksum, or were in a shard that can no longer be read, are
        computed again (``FillReport.corrupt``); damaged shards are moved aside
        (``<name>.corrupt``) so later runs do not trip over them.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        started = time.perf_counter()
        unique: dict[str, Any] = {}
        for key, payload in items:
            unique.setdefault(key, payload)
        corrupt = self._find_corrupt(unique)
        misses = {key: payload for key, payload in unique.items() if key not in self.store}
        num_hits = len(unique) - len(misses)
        batches = _plan_batches(misses, batch_size, group)

        pending: dict[str, Entry] = {}
        failed: list[str] = []
        num_computed = 0
        progress = tqdm(total=len(misses), desc=desc or f"caching {self.name}", unit="item", disable=None)
        try:
            for batch_keys, inputs in _prepared(batches, misses, prepare, prepare_workers, prepare_pool):
                results = compute(inputs)
                self._check_results(batch_keys, results)
                for key, result in zip(batch_keys, results):
                    if result is None:
                        failed.append(key)
                    else:
                        pending[key] = dict(result)
                        num_computed += 1
                progress.update(len(batch_keys))
                if len(pending) >= self.flush_every:
                    self.store.put_many(pending)
                    pending = {}
        finally:
            progress.close()
            if pending:
                self.store.put_many(pending)

        report = FillReport(
            num_items=len(unique),
            num_hits=num_hits,
            num_computed=num_computed,
            seconds=time.perf_counter() - started,
            failed=tuple(failed),
            corrupt=tuple(corrupt),
        )
        logger.info(
            "%s cache: %d items, %d hits, %d computed (%d of them corrupt before), %d failed in %.2fs (%s)",
            self.name, report.num_items, report.num_hits, report.num_computed, len(corrupt), len(failed),
            report.seconds, self.store.root,
        )
        reencoded = {key: reason for key, reason in corrupt.items() if key in self.store}
        if reencoded:
            logger.warning("%s cache: re-encoded %d corrupt entries: %s", self.name, len(reencoded),
                           summarise_problems(reencoded))
        return report

    def _find_corrupt(self, unique: Mapping[str, Any]) -> dict[str, str]:
        """Check the entries ``unique`` would hit; drop the bad ones from the store's index so they
        are misses. Returns ``{key: reason}`` for each of them."""
        report = self.store.verify(list(unique), desc=f"verifying {self.name} cache") if self.verify else None
        corrupt = dict(report.problems) if report is not None else {}
        if corrupt:
            logger.info(
                "%s cache: %d stored entries failed their integrity check and will be encoded again: %s",
                self.name, len(corrupt), summarise_problems(corrupt),
            )
            self.store.discard(corrupt)
        self.store.quarantine_unreadable()
        return corrupt

    def _check_results(self, batch_keys: list[str], results: Any) -> None:
        if not isinstance(results, Sequence) or len(results) != len(batch_keys):
            got = len(results) if isinstance(results, Sequence) else type(results).__name__
            raise ValueError(
                f"{self.name} cache: compute returned {got} results for {len(batch_keys)} payloads; "
                "it must return one dict of tensors per payload, in order"
            )
        for key, result in zip(batch_keys, results):
            if result is None:
                continue
            if not isinstance(result, Mapping) or not result:
                raise ValueError(
                    f"{self.name} cache: compute returned {type(result).__name__} for key {key!r}; "
                    "expected a non-empty dict of tensors"
                )

    def remove(self, keys: Sequence[str]) -> int:
        """Delete ``keys`` from the store (memory and disk); returns how many it held."""
        return self.store.remove(keys)

    def get_batch(self, keys: Sequence[str]) -> Entry:
        """Entries for ``keys`` stacked along a new dim 0, one tensor per name.

        Raises:
            KeyError: a key is not cached.
            ValueError: ``keys`` is empty, or entries differ in names, shapes or dtypes.
        """
        if not keys:
            raise ValueError(f"{self.name} cache: get_batch needs at least one key")
        entries = self.store.get_many(keys)
        first_key, first = keys[0], entries[0]
        for key, entry in zip(keys[1:], entries[1:]):
            if entry.keys() != first.keys():
                raise ValueError(
                    f"{self.name} cache: entries {first_key!r} and {key!r} hold different tensors "
                    f"({sorted(first)} vs {sorted(entry)}); they cannot be stacked"
                )
            for name, tensor in entry.items():
                ref = first[name]
                if tensor.shape != ref.shape or tensor.dtype != ref.dtype:
                    raise ValueError(
                        f"{self.name} cache: {name!r} of {first_key!r} is {tuple(ref.shape)} {ref.dtype} but "
                        f"of {key!r} is {tuple(tensor.shape)} {tensor.dtype}; batch keys must share a bucket"
                    )
        stack = getattr(self.store, "stack", torch.stack)  # a unified-memory store stacks into managed memory
        return {name: stack([entry[name] for entry in entries]) for name in first}

    def __repr__(self) -> str:
        return f"TensorCache(name={self.name!r}, store={self.store!r})"


CACHE_TYPES = ("disk", "memory", "unified_memory")


def cache_type_in_use(kind: str) -> str:
    """The cache type a configured ``kind`` is opened as: ``unified_memory`` is a CPU-backed
    ``memory`` cache while unified-memory hints are forced off (config or environment; the log
    says so once); every other type is itself."""
    if kind != "unified_memory":
        return kind
    from simpletuner.gh200.uvm import unified_caches_fall_back_to_cpu

    return "memory" if unified_caches_fall_back_to_cpu() else kind


def _open_store(folder: Path, kind: str, name: str, persistent: bool, prefer: str) -> ShardedTensorStore | MemoryTensorStore:
    """A disk store, or a memory store (optionally backed by disk) placed per ``kind``."""
    kind = cache_type_in_use(kind)
    if kind == "disk":
        return ShardedTensorStore(folder)
    backing = ShardedTensorStore(folder) if persistent else None
    if kind == "memory":
        return MemoryTensorStore(name, backing=backing)
    if kind == "unified_memory":
        from simpletuner.gh200.uvm import prefetch_to_device, stack_unified, to_unified

        return MemoryTensorStore(name, place=lambda t: to_unified(t, prefer), prefetch=prefetch_to_device,
                                 backing=backing, stack=stack_unified)
    raise ValueError(f"cache type {kind!r} is not one of disk, memory, unified_memory")


def open_tensor_cache(folder: str | os.PathLike[str], kind: str, name: str, persistent: bool = True,
                      prefer: str = "cpu", verify: bool = True) -> TensorCache:
    """One :class:`TensorCache` in ``folder`` of cache type ``kind`` (`disk`, `memory`,
    `unified_memory`; memory ones written through to ``folder`` when ``persistent``). A
    `unified_memory` cache is a `memory` one while hints are forced off (:func:`cache_type_in_use`).

    Raises:
        ValueError: an unknown cache type.
    """
    if kind not in CACHE_TYPES:
        raise ValueError(f"cache type {kind!r} is not one of {', '.join(CACHE_TYPES)}")
    return TensorCache(_open_store(Path(folder), kind, name, persistent, prefer), name, verify=verify)


def open_caches(
    cache_dir: str | os.PathLike[str],
    model_tag: str,
    state: "StateTracker | None" = None,
    vae_type: str = "disk",
    text_type: str = "disk",
    persistent: bool = True,
    verify: bool = True,
) -> tuple[TensorCache, TensorCache]:
    """Open the ``(vae_cache, text_cache)`` pair of a model under ``cache_dir/model_tag``.

    The stores live in ``cache_dir/model_tag/vae`` and ``cache_dir/model_tag/text``; both
    folders are registered with ``state.register_cache_dir`` when a state is given, so
    ``state.delete_cache_files()`` removes them. ``vae_type`` / ``text_type`` choose
    `disk`, `memory` or `unified_memory` (latents prefer CPU residency, text embeddings GPU;
    a CPU-backed `memory` cache while unified-memory hints are forced off, see
    :func:`cache_type_in_use`); memory stores are written through to disk when ``persistent``
    (both kinds share the disk format, so either reloads the other's entries). ``verify`` is passed to
    :class:`TensorCache` (check each needed entry's checksum when filling).

    Raises:
        ValueError: ``model_tag`` is not a plain folder name (letters, digits, ``._-``), or a
            cache type is unknown.
    """
    if not isinstance(model_tag, str) or not _MODEL_TAG_PATTERN.match(model_tag):
        raise ValueError(
            f"model_tag {model_tag!r} must be a plain folder name of letters, digits, '.', '_' or '-' "
            "(not starting with '.' or '-')"
        )
    for kind in (vae_type, text_type):
        if kind not in CACHE_TYPES:
            raise ValueError(f"cache type {kind!r} is not one of {', '.join(CACHE_TYPES)}")
    base = Path(cache_dir) / model_tag
    vae_dir, text_dir = base / "vae", base / "text"
    vae_cache = TensorCache(_open_store(vae_dir, vae_type, "vae", persistent, "cpu"), "vae", verify=verify)
    text_cache = TensorCache(_open_store(text_dir, text_type, "text", persistent, "gpu"), "text", verify=verify)
    if state is not None:
        for folder, kind in ((vae_dir, vae_type), (text_dir, text_type)):
            if kind == "disk" or persistent:
                state.register_cache_dir(folder)
    return vae_cache, text_cache
