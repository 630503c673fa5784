"""A cache fill shared by the processes of a launch: each encodes a disjoint part of what is missing.

Rank 0 decides what is missing (it alone verifies the stored entries), every rank encodes its part into
shard files of its own, then every rank re-indexes the folder and sees all the entries. Parts are
contiguous runs of the fill's encode batches (:func:`split_batches`), planned over the full item list and
never splitting a shard file (tar, parquet), so an entry's value depends neither on the number of
processes nor on where an interruption stopped an earlier fill (documentation/DISTRIBUTED.md).
The fill sees the processes as a :class:`FillShare`; :func:`launch_share` makes one from the run's
Accelerator (through :mod:`simpletuner.ranks`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Hashable, Protocol, Sequence, TypeVar

from simpletuner.caching.memory_store import MemoryTensorStore
from simpletuner.caching.store import ShardedTensorStore
from simpletuner.diskspace import NoSpace
from simpletuner.ranks import from_every_process, from_main_process, probe_shared_folder

T = TypeVar("T")


class FillShare(Protocol):
    """The processes of a launch, as a cache fill needs them."""

    rank: int  # this process, 0 .. num_ranks - 1
    num_ranks: int

    def from_first(self, value: T) -> T:
        """``value`` as rank 0 has it, on every rank."""
        ...

    def from_all(self, value: T) -> list[T]:
        """Every rank's ``value``, in rank order, on every rank."""
        ...

    def sees_one_folder(self, folder: Path) -> bool:
        """Whether every rank reads ``folder`` as rank 0 writes it (not a node-local disk at that path)."""
        ...


class LaunchShare:
    """The processes of an ``accelerate.Accelerator``'s launch as a :class:`FillShare`."""

    def __init__(self, accelerator: Any):
        self.accelerator = accelerator
        self.rank, self.num_ranks = accelerator.process_index, accelerator.num_processes

    def from_first(self, value: T) -> T:
        return from_main_process(self.accelerator, value)

    def from_all(self, value: T) -> list[T]:
        return from_every_process(self.accelerator, value)

    def sees_one_folder(self, folder: Path) -> bool:
        failed, seen = probe_shared_folder(self.accelerator, folder)
        return failed is None and all(ok for ok, _ in seen)


def launch_share(accelerator: Any) -> LaunchShare | None:
    """The processes of ``accelerator``'s launch as a cache fill's share; None for one process."""
    return LaunchShare(accelerator) if accelerator.num_processes > 1 else None


def split_misses(
    keys: Sequence[str], num_ranks: int, locality: Callable[[str], Hashable | None] | None = None
) -> list[list[str]]:
    """``keys`` cut into ``num_ranks`` contiguous parts of about equal count, one per rank.

    ``locality(key)`` names the shard file a key's source lives in (None: a file of its own);
    the keys of one shard stay together (in the order they first appear) and go to the rank
    whose equal-count range holds the middle of that shard's keys.
    """
    parts = split_batches([[key] for key in keys], num_ranks, locality)
    return [[key for batch in part for key in batch] for part in parts]


def split_batches(
    batches: Sequence[Sequence[str]], num_ranks: int, locality: Callable[[str], Hashable | None] | None = None
) -> list[list[Sequence[str]]]:
    """``batches`` (of keys) cut into ``num_ranks`` contiguous parts of about equal key count, one per
    rank; a batch is never split. ``locality`` as in :func:`split_misses`, read from each batch's first
    key (a batch holds keys of one shard file): the batches of one shard go to one rank."""
    groups: dict[Hashable, list[Sequence[str]]] = {}
    for index, batch in enumerate(batches):
        where = locality(batch[0]) if locality is not None else None
        groups.setdefault(("file", index) if where is None else ("shard", where), []).append(batch)
    total = sum(len(batch) for batch in batches)
    parts: list[list[Sequence[str]]] = [[] for _ in range(num_ranks)]
    done = 0
    for group in groups.values():
        size = sum(len(batch) for batch in group)
        middle = done + size / 2
        parts[min(num_ranks - 1, int(middle * num_ranks / total))].extend(group)
        done += size
    return parts


def describe_failure(error: BaseException | None) -> tuple | None:
    """What went wrong on this rank, in a form the other ranks can receive (exceptions may not pickle)."""
    if error is None:
        return None
    if isinstance(error, NoSpace):
        return ("no_space", error.what, str(error.folder), error.needed, error.free, error.during_write)
    return ("error", f"{type(error).__name__}: {error}")


def raise_agreed(failures: Sequence[tuple | None], mine: BaseException | None, what: str) -> None:
    """After every rank told the others how its part went (``failures`` in rank order): when any
    failed, raise on every rank, so none waits for one that gave up. This rank's own exception
    when it failed; a full disk elsewhere as the same NoSpace (one exit code for the launch);
    otherwise an error naming the rank that failed and why."""
    failed = [(rank, failure) for rank, failure in enumerate(failures) if failure is not None]
    if not failed:
        return
    if mine is not None:
        raise mine
    rank, failure = failed[0]
    if failure[0] == "no_space":
        _, space_for, folder, needed, free, during = failure
        raise NoSpace(space_for, folder, needed, free, during_write=during, agreed=True)
    raise RuntimeError(
        f"process {rank} of the launch failed while filling the {what} cache: {failure[1]}; the entries every "
        "process wrote are kept, and the next run encodes only what is still missing"
    )


def shares_folder(store: Any) -> bool:
    """Whether ``store`` keeps its entries in a folder other processes can index (a disk store, or a
    memory store written through to one): only then can each process encode a part of the misses.
    A memory store of its own (``persistent_cache: false``) is filled whole by every process."""
    if isinstance(store, ShardedTensorStore):
        return True
    return isinstance(store, MemoryTensorStore) and store.backing is not None
