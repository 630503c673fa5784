"""TensorCache: encode each item once, store it, and serve stacked batches of it.

The VAE-latent and text-embed caches are both this: a list of ``(key, payload)`` items, a batched
``compute`` (the encoder) run only on the keys the store does not hold yet, and ``get_batch`` for the
training loop. Keys come from :mod:`simpletuner.caching.fingerprint`, so an unknown key is a miss. A fill
checks every entry it would reuse against its checksum (and, on request, its source file's hash), checks
the disk has room before writing, and encodes each miss among the batch-mates a full fill would give it.
Why each of these, and what they cost: documentation/RELIABILITY.md, "Caches".
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Hashable, Iterator, Mapping, NamedTuple, Sequence

import torch
from tqdm import tqdm

from simpletuner.caching.base import TensorStore
from simpletuner.caching.integrity import summarise_problems
from simpletuner.caching.memory_store import MemoryTensorStore
from simpletuner.caching.share import FillShare, describe_failure, raise_agreed, shares_folder, split_batches
from simpletuner.caching.store import ShardedTensorStore
from simpletuner.caching.threads import map_threads, run_ahead_on_threads
from simpletuner.diskspace import NoSpace, free_bytes, human_bytes, require_space
from simpletuner.faults import fault_point

logger = logging.getLogger(__name__)

DEFAULT_FLUSH_EVERY = 256

Entry = dict[str, torch.Tensor]
#: Payloads (or what ``prepare`` made of them) -> one entry per payload, in order; None: it cannot be encoded.
ComputeFn = Callable[[Any], Sequence[Mapping[str, torch.Tensor] | None]]


@dataclass(frozen=True)
class FillReport:
    """What one :meth:`TensorCache.fill` did. ``num_items`` counts distinct keys."""

    num_items: int
    num_hits: int
    num_computed: int
    seconds: float
    failed: tuple[str, ...] = ()  # keys compute could not produce (returned None for); not stored
    corrupt: tuple[str, ...] = ()  # stored keys that failed their integrity check and were computed again
    changed: tuple[str, ...] = ()  # stored keys whose source file's content changed (verify_content)
    unhashed: tuple[str, ...] = ()  # stored keys with no recorded source hash, encoded again under verify_content


@dataclass(frozen=True)
class SourceCheck:
    """What a cache's entries are encoded from, by content (the VAE cache: image and clip files).

    Args:
        hash: payload -> :func:`~simpletuner.caching.fingerprint.source_hash` of its source as it
            is now (reads the files; OSError when they cannot be read).
        name: payload -> how logs name its source (a path).
        verify: re-hash the source of every hit before the fill trusts it and encode again the
            entries whose source changed or that carry no recorded hash (``verify_content``).
    """

    hash: Callable[[Any], str]
    name: Callable[[Any], str]
    verify: bool = False


def _hash_or_none(check: SourceCheck, payload: Any) -> str | None:
    """The source hash of ``payload``, or None when its files cannot be read (then the decode
    fails too and the sample is dropped, or the entry is stored without a hash)."""
    try:
        return check.hash(payload)
    except OSError as error:
        logger.debug("cannot hash the source of %s: %s", check.name(payload), error)
        return None


def _with_source_hashes(prepare: Callable[[list[Any]], Any] | None, check: SourceCheck) -> Callable[[list[Any]], Any]:
    """``prepare`` that returns ``(source hashes, prepared)``. The files are hashed before they
    are decoded: an edit in between leaves an old hash beside a new value, which the next
    content check re-encodes (the other order would keep a stale value under a current hash)."""

    def run(payloads: list[Any]) -> tuple[list[str | None], Any]:
        hashes = [_hash_or_none(check, payload) for payload in payloads]
        return hashes, (payloads if prepare is None else prepare(payloads))

    return run


def _names(names: Sequence[str], limit: int = 10) -> str:
    more = len(names) - limit
    return ", ".join(names[:limit]) + (f"; and {more} more" if more > 0 else "")


_CACHE_WHAT = {"vae": "the VAE latent cache", "text": "the text embedding cache"}
#: Shard header bytes per tensor besides its data: its name (key and tensor name), dtype, shape and
#: offsets, its CRC-32 and the entry's source hash in the metadata.
HEADER_BYTES_PER_TENSOR = 320


def _disk_folder(store: TensorStore) -> Path | None:
    """Where ``store`` writes shards; None for a memory store without a backing folder (no disk)."""
    if isinstance(store, ShardedTensorStore):
        return store.root
    if isinstance(store, MemoryTensorStore) and store.backing is not None:
        return store.backing.root
    return None


def _entry_bytes(entry: Mapping[str, torch.Tensor]) -> int:
    return sum(t.nbytes + HEADER_BYTES_PER_TENSOR for t in entry.values())


class _SpaceCheck:
    """Stops a fill before its first shard when the cache folder's disk cannot hold the new entries
    (:class:`~simpletuner.diskspace.NoSpace`: "the VAE latent cache (N new entries) needs ~X ...").

    With ``entry_bytes`` (payload -> bytes, from the config) the total is known before anything is
    encoded. Without it, the first encoded batch is measured: its largest entry times the number of
    misses, exact for entries of one size (text embeddings are padded to one length) and an
    estimate otherwise. Either way every shard write checks its own exact size again
    (:meth:`ShardedTensorStore.put_many`), so a wrong estimate still stops before a write."""

    def __init__(
        self, store: TensorStore, name: str, misses: Mapping[str, Any], entry_bytes: Callable[[Any], int] | None
    ):
        self.folder = _disk_folder(store)
        self.what = f"{_CACHE_WHAT.get(name, f'the {name} cache')} ({len(misses)} new entries)"
        self.count = len(misses)
        self.done = self.folder is None or not misses
        if not self.done and entry_bytes is not None:
            self._require(sum(entry_bytes(payload) for payload in misses.values()))

    def after_batch(self, results: Sequence[Mapping[str, torch.Tensor] | None]) -> None:
        sizes = [_entry_bytes(result) for result in results if result is not None]
        if not self.done and sizes:
            self._require(max(sizes) * self.count)

    def _require(self, needed: int) -> None:
        self.done = True
        if self.folder is None:  # a memory store of its own writes nothing to disk
            return
        require_space(self.folder, needed, self.what)
        logger.info(
            "%s needs ~%s in %s; %s free",
            self.what,
            human_bytes(needed),
            self.folder,
            human_bytes(free_bytes(self.folder)),
        )


def _plan_batches(
    items: Mapping[str, Any],
    batch_size: int,
    group: Callable[[Any], Hashable] | None,
    locality: Callable[[Any], Hashable | None] | None = None,
) -> list[list[str]]:
    """Split every item key into batches of at most ``batch_size`` that share one ``group`` value and
    one ``locality`` (shard file), so a batch never spans two shard files.

    A batch comes out as soon as it is full, so the fill follows the items' order (a shard file,
    a parquet row group, is read once, front to back); the part-filled batches follow at the end,
    in the order their groups first appear. Deterministic for a given item list: planned over every
    item (not only the misses), it gives an entry the same batch-mates in every fill.
    """
    open_batches: dict[Hashable, list[str]] = {}
    batches = []
    for key, payload in items.items():
        where = (
            group(payload) if group is not None else None,
            locality(payload) if locality is not None else None,
        )
        batch = open_batches.setdefault(where, [])
        batch.append(key)
        if len(batch) == batch_size:
            batches.append(batch[:])
            batch.clear()
    batches.extend(batch for batch in open_batches.values() if batch)
    return batches


def _prepared(
    batches: Sequence[Sequence[str]],
    misses: Mapping[str, Any],
    prepare: Callable[[list[Any]], Any] | None,
    workers: int,
    pool: Executor | None = None,
) -> Iterator[tuple[list[str], Any]]:
    """``(keys, prepare(payloads))`` per batch, in order; ``prepare`` runs on ``workers`` threads
    (``pool`` when given: it is left running for its owner) up to ``2 * workers`` batches ahead.
    Closing the generator cancels what has not started and waits for what has."""

    def run(keys: Sequence[str]) -> tuple[Sequence[str], Any]:
        payloads = [misses[k] for k in keys]
        return keys, payloads if prepare is None else prepare(payloads)

    return run_ahead_on_threads(run, batches, workers if prepare is not None else 0, pool)


class _Misses(NamedTuple):
    """What a fill must encode: stored entries that failed their check, or whose source changed or carries
    no hash (each key -> a reason or its source's name), and every key to encode (those included)."""

    corrupt: dict[str, str]
    changed: dict[str, str]
    unhashed: dict[str, str]
    missing: list[str]


@dataclass(frozen=True)
class _Job:
    """How a fill encodes its misses (see :meth:`TensorCache.fill`); ``prepare`` returns ``(source hashes,
    prepared)`` when ``has_sources``."""

    compute: ComputeFn
    desc: str | None
    prepare: Callable[[list[Any]], Any] | None
    workers: int
    pool: Executor | None
    has_sources: bool
    entry_bytes: Callable[[Any], int] | None


class TensorCache:
    """An encode-once cache of ``dict[str, Tensor]`` entries on a :class:`~simpletuner.caching.base.TensorStore`.

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
        store: TensorStore,
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

    def fill(  # noqa: PLR0913
        self,
        items: Sequence[tuple[str, Any]],
        compute: ComputeFn,
        batch_size: int,
        group: Callable[[Any], Hashable] | None = None,
        desc: str | None = None,
        prepare: Callable[[list[Any]], Any] | None = None,
        prepare_workers: int = 0,
        prepare_pool: Executor | None = None,
        sources: SourceCheck | None = None,
        entry_bytes: Callable[[Any], int] | None = None,
        share: FillShare | None = None,
        locality: Callable[[Any], Hashable | None] | None = None,
    ) -> FillReport:
        """Compute and store every item the store lacks or holds damaged (``FillReport.corrupt``), or, with
        ``sources.verify``, encoded from a changed or unhashed source; a key given twice is computed once.

        ``compute`` takes payloads of one ``group`` (after ``prepare`` on ``prepare_workers`` / ``prepare_pool``)
        and returns an entry per payload, None for a failure (``FillReport.failed``). Batches of at most
        ``batch_size`` are planned over every item, never across a ``locality`` (a shard file), and written every
        ``flush_every``, also when ``compute`` raises. ``entry_bytes`` lets free space be checked first.
        ``share``: every process calls this with the same items and encodes its part of the batches.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        started = time.perf_counter()
        unique: dict[str, Any] = {}
        for key, payload in items:
            unique.setdefault(key, payload)
        shared = share if share is not None and share.num_ranks > 1 and shares_folder(self.store) else None
        misses = self._find_misses(unique, sources, prepare_workers, prepare_pool, shared)
        job = _Job(
            compute,
            desc,
            prepare if sources is None else _with_source_hashes(prepare, sources),
            prepare_workers,
            prepare_pool,
            sources is not None,
            entry_bytes,
        )
        mine = self._my_batches(unique, misses.missing, batch_size, group, locality, shared)
        num_computed, failed = self._encode_part(mine, unique, job, shared)
        report = FillReport(
            num_items=len(unique),
            num_hits=len(unique) - len(misses.missing),
            num_computed=num_computed,
            seconds=time.perf_counter() - started,
            failed=tuple(failed),
            corrupt=tuple(misses.corrupt),
            changed=tuple(misses.changed),
            unhashed=tuple(misses.unhashed),
        )
        self._log_fill(report, misses)
        return report

    def _find_misses(
        self,
        unique: Mapping[str, Any],
        sources: SourceCheck | None,
        workers: int,
        pool: Executor | None,
        shared: FillShare | None,
    ) -> _Misses:
        """What the fill must encode. One process checks what is stored (and moves damaged shards
        aside): rank 0 of a ``shared`` fill, which tells the others; they stop serving those keys too."""
        misses = _Misses({}, {}, {}, [])
        if shared is None or shared.rank == 0:
            corrupt = self._find_corrupt(unique)
            changed: dict[str, str] = {}
            unhashed: dict[str, str] = {}
            if sources is not None and sources.verify:
                changed, unhashed = self._find_changed_sources(unique, sources, workers, pool)
            misses = _Misses(corrupt, changed, unhashed, [key for key in unique if key not in self.store])
        if shared is not None:
            misses = shared.from_first(misses)
            if shared.rank != 0:
                self.store.discard(misses.missing)  # what rank 0 found corrupt or changed is not served here either
        return misses

    @staticmethod
    def _my_batches(
        unique: Mapping[str, Any],
        missing: Sequence[str],
        batch_size: int,
        group: Callable[[Any], Hashable] | None,
        locality: Callable[[Any], Hashable | None] | None,
        shared: FillShare | None,
    ) -> Sequence[Sequence[str]]:
        """The misses of each batch planned over every item (:func:`_plan_batches`), without the empty
        ones; of a ``shared`` fill, this rank's part (whole batches, whole shard files)."""
        wanted = set(missing)
        planned = (
            [key for key in batch if key in wanted] for batch in _plan_batches(unique, batch_size, group, locality)
        )
        mine: list[list[str]] = [batch for batch in planned if batch]
        if shared is None or not mine:
            return mine
        where = None if locality is None else (lambda key: locality(unique[key]))
        return split_batches(mine, shared.num_ranks, where)[shared.rank]

    def _encode_part(
        self, batches: Sequence[Sequence[str]], payloads: Mapping[str, Any], job: _Job, shared: FillShare | None
    ) -> tuple[int, list[str]]:
        """:meth:`_encode` this process's ``batches``. In a ``shared`` fill every rank then learns how the
        others' parts went, indexes their shards and raises when any failed; the counts are the launch's."""
        error: BaseException | None = None
        try:
            num_computed, failed = self._encode(batches, payloads, job)
        except Exception as exc:  # noqa: BLE001 - a shared fill tells the other ranks first, then raises it
            if shared is None:
                raise
            error, num_computed, failed = exc, 0, []
        if shared is None:
            return num_computed, failed
        outcomes = shared.from_all((num_computed, failed, describe_failure(error)))
        self.store.refresh()  # every rank's shards
        raise_agreed([outcome[2] for outcome in outcomes], error, self.name)
        return sum(outcome[0] for outcome in outcomes), [key for outcome in outcomes for key in outcome[1]]

    def _log_fill(self, report: FillReport, misses: _Misses) -> None:
        logger.info(
            "%s cache: %d items, %d hits, %d computed (%d of them corrupt before), %d failed in %.2fs (%s)",
            self.name,
            report.num_items,
            report.num_hits,
            report.num_computed,
            len(misses.corrupt),
            len(report.failed),
            report.seconds,
            self.store.root,
        )
        reencoded = {key: reason for key, reason in misses.corrupt.items() if key in self.store}
        if reencoded:
            logger.warning(
                "%s cache: re-encoded %d corrupt entries: %s", self.name, len(reencoded), summarise_problems(reencoded)
            )
        self._log_source_reencodes(misses.changed, misses.unhashed)

    def _encode(
        self, batches: Sequence[Sequence[str]], payloads: Mapping[str, Any], job: _Job
    ) -> tuple[int, list[str]]:
        """Compute and write ``batches`` (keys of ``payloads``); returns ``(entries written, keys compute
        could not produce)``."""
        misses = {key: payloads[key] for batch in batches for key in batch}
        space = _SpaceCheck(self.store, self.name, misses, job.entry_bytes)  # NoSpace: nothing encoded or written
        pending: dict[str, Entry] = {}
        pending_sources: dict[str, str] = {}
        failed: list[str] = []
        num_computed = 0
        progress = tqdm(total=len(misses), desc=job.desc or f"caching {self.name}", unit="item", disable=None)
        try:
            for batch_keys, inputs in _prepared(batches, payloads, job.prepare, job.workers, job.pool):
                hashes: list[str | None] = [None] * len(batch_keys)
                if job.has_sources:
                    hashes, inputs = inputs
                results = job.compute(inputs)
                self._check_results(batch_keys, results)
                space.after_batch(results)
                done = {key: dict(result) for key, result in zip(batch_keys, results) if result is not None}
                failed.extend(key for key in batch_keys if key not in done)
                pending_sources.update((k, h) for k, h in zip(batch_keys, hashes) if k in done and h is not None)
                pending.update(done)  # one call: a signal never leaves part of a batch to be written
                num_computed += len(done)
                progress.update(len(batch_keys))
                if len(pending) >= self.flush_every:
                    self._write(pending, pending_sources, job.has_sources)
                    pending, pending_sources = {}, {}
        except NoSpace:
            pending = {}  # the disk is full: writing them now would fail the same way; written shards stay
            raise
        finally:
            progress.close()
            if pending:
                self._write(pending, pending_sources, job.has_sources)
        return num_computed, failed

    def _write(self, pending: dict[str, Entry], pending_sources: dict[str, str], has_sources: bool) -> None:
        if has_sources:
            self.store.put_many(pending, source_hashes=pending_sources)
        else:  # stores that know nothing of source hashes keep working
            self.store.put_many(pending)
        fault_point("cache:shard_written")  # tests: a signal (or kill) with whole shards on disk

    def _find_changed_sources(
        self, unique: Mapping[str, Any], sources: SourceCheck, workers: int, pool: Executor | None
    ) -> tuple[dict[str, str], dict[str, str]]:
        """Hash the source of every entry ``unique`` would hit and compare it with the hash recorded
        when the entry was written; drop (as misses) those that differ or have none. Returns
        ``({key: source name}, {key: source name})`` of the changed and the unhashed ones."""
        hits = [key for key in unique if key in self.store]
        if not hits:
            return {}, {}
        started = time.perf_counter()
        recorded = self.store.source_hashes(hits)
        unhashed = {key: sources.name(unique[key]) for key in hits if recorded.get(key) is None}
        to_check = [key for key in hits if key not in unhashed]
        current = map_threads(
            lambda key: _hash_or_none(sources, unique[key]), to_check, workers, pool, f"checking {self.name} sources"
        )
        changed = {key: sources.name(unique[key]) for key, now in zip(to_check, current) if now != recorded[key]}
        logger.info(
            "%s cache: verify_content hashed the sources of %d cached entries in %.2fs: %d changed, "
            "%d without a recorded hash",
            self.name,
            len(to_check),
            time.perf_counter() - started,
            len(changed),
            len(unhashed),
        )
        self.store.discard([*changed, *unhashed])
        return changed, unhashed

    def _log_source_reencodes(self, changed: Mapping[str, str], unhashed: Mapping[str, str]) -> None:
        names = [name for key, name in changed.items() if key in self.store]
        if names:
            logger.warning(
                "%s cache: re-encoded %d entries whose source changed: %s", self.name, len(names), _names(names)
            )
        names = [name for key, name in unhashed.items() if key in self.store]
        if names:
            logger.warning(
                "%s cache: re-encoded %d entries written before source hashes were recorded (verify_content "
                "re-encodes them once, since an earlier in-place edit cannot be ruled out): %s",
                self.name,
                len(names),
                _names(names, limit=3),
            )

    def _find_corrupt(self, unique: Mapping[str, Any]) -> dict[str, str]:
        """Check the entries ``unique`` would hit; drop the bad ones from the store's index so they
        are misses. Returns ``{key: reason}`` for each of them."""
        report = self.store.verify(list(unique), desc=f"verifying {self.name} cache") if self.verify else None
        corrupt = dict(report.problems) if report is not None else {}
        if corrupt:
            logger.info(
                "%s cache: %d stored entries failed their integrity check and will be encoded again: %s",
                self.name,
                len(corrupt),
                summarise_problems(corrupt),
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
