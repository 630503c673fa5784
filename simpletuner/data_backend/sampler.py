"""BucketSampler: batches that hold one bucket of one dataset, split across processes.

Each global batch (``batch_size * num_replicas`` samples of one ``(dataset_id, bucket)`` group) is split
across the processes, so one step sees distinct samples of one shape; dataset ``probability`` weights pick
which dataset's batch comes next. The whole order is a pure function of ``(seed, epoch)``: resuming from
``state_dict()`` replays exactly the batches an uninterrupted run would see.
See documentation/DATA_SOURCES.md, "Data order".
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
from typing import Any, Iterable, Iterator, Mapping

from simpletuner.data_backend.buckets import bucket_name
from simpletuner.data_backend.metadata import Sample

logger = logging.getLogger(__name__)

GroupKey = tuple[str, tuple[int, int]]


def _epoch_rng(seed: int, epoch: int) -> random.Random:
    digest = hashlib.sha256(f"bucket-sampler\x00{seed}\x00{epoch}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _stream_rng(seed: int, epoch: int, *names: object) -> random.Random:
    """The generator of one named stream of an epoch (the weighted dataset draw, one dataset's pass)."""
    text = "\x00".join(str(part) for part in ("bucket-sampler-mix", seed, epoch, *names))
    return random.Random(int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big"))


def _describe(key: GroupKey) -> str:
    return f"dataset {key[0]!r}, {bucket_name(key[1])}"


class BucketSampler:
    """Yields this process's micro-batches (``list[Sample]``), one epoch per ``__iter__``.

    ``samples``: every sample of every dataset (repeats included); ``batch_size`` per process; ``rank`` in
    ``[0, num_replicas)``; ``seed`` of the data order; ``weights``: dataset id -> ``probability`` (>= 0, a dataset
    not named weighs 1; None or all equal: the unweighted order).

    Raises:
        ValueError: bad arguments, every dataset weighted 0, or no ``(dataset, bucket)`` group holds a full
            global batch.
    """

    def __init__(
        self,
        samples: list[Sample],
        batch_size: int,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
        weights: Mapping[str, float] | None = None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside [0, {num_replicas})")
        if not samples:
            raise ValueError("no samples to train on: every dataset is empty")
        self.batch_size = batch_size
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = seed
        self.epoch = 0
        self.batch_index = 0
        samples, self._weights = self._apply_weights(samples, weights)
        self._groups = self._group(samples)
        self._num_batches = sum(len(g) // self.global_batch_size for g in self._groups.values())
        self._check_sizes()
        self._dataset_batches = self._batches_per_dataset()
        self._cached_epoch: int | None = None
        self._cached_batches: list[list[Sample]] = []

    @property
    def global_batch_size(self) -> int:
        """Samples consumed per step across all processes."""
        return self.batch_size * self.num_replicas

    @staticmethod
    def _group(samples: list[Sample]) -> dict[GroupKey, list[Sample]]:
        groups: dict[GroupKey, list[Sample]] = {}
        for sample in samples:
            groups.setdefault((sample.dataset_id, sample.bucket), []).append(sample)
        # Sorted groups and members: the order depends only on (seed, epoch), not on input order.
        return {key: sorted(groups[key], key=lambda s: s.key) for key in sorted(groups)}

    @staticmethod
    def _apply_weights(
        samples: list[Sample], weights: Mapping[str, float] | None
    ) -> tuple[list[Sample], dict[str, float] | None]:
        """The samples of datasets weighted above 0, and their weights (None when all are equal)."""
        if not weights:
            return samples, None
        ids = sorted({s.dataset_id for s in samples})
        bad = {i: w for i, w in weights.items() if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0)}
        if bad:
            raise ValueError(f"dataset weights must be finite and >= 0, got {bad}: fix datasets[].probability")
        of = {i: float(weights.get(i, 1.0)) for i in ids}
        kept = {i for i, w in of.items() if w > 0}
        if ids and not kept:
            raise ValueError(
                f"every dataset has probability 0 ({', '.join(ids)}): nothing to train on. "
                "Give at least one dataset a `probability` above 0"
            )
        if len(kept) < len(ids):
            samples = [s for s in samples if s.dataset_id in kept]
        positive = {i: of[i] for i in sorted(kept)}
        return samples, None if len(set(positive.values())) <= 1 else positive

    def _batches_per_dataset(self) -> dict[str, list[GroupKey]]:
        """Dataset id -> its groups that yield at least one global batch (weighted runs only)."""
        if self._weights is None:
            return {}
        need = self.global_batch_size
        out: dict[str, list[GroupKey]] = {}
        for key, group in self._groups.items():
            if len(group) >= need:
                out.setdefault(key[0], []).append(key)
        return out

    def _check_sizes(self) -> None:
        need = self.global_batch_size
        if self._num_batches == 0:
            largest_key = max(self._groups, key=lambda k: (len(self._groups[k]), k))
            raise ValueError(
                f"train_batch_size {self.batch_size} x {self.num_replicas} process(es) = {need} samples per step, "
                f"but the largest bucket ({_describe(largest_key)}) has only {len(self._groups[largest_key])} images: "
                "lower train_batch_size or add images"
            )
        small = {k: len(v) for k, v in self._groups.items() if len(v) < need}
        if small:
            listed = ", ".join(f"{_describe(k)}: {n}" for k, n in small.items())
            logger.warning(
                "%d sample(s) are never trained on: their buckets hold fewer than the %d samples of one step "
                "(train_batch_size %d x %d process(es)): %s",
                sum(small.values()),
                need,
                self.batch_size,
                self.num_replicas,
                listed,
            )

    def __len__(self) -> int:
        """Micro-batches this process gets per epoch (the same on every process)."""
        return self._num_batches

    def _epoch_batches(self, epoch: int) -> list[list[Sample]]:
        """This rank's batches of ``epoch``, in order (computed once per epoch)."""
        if self._cached_epoch == epoch:
            return self._cached_batches
        global_batches = self._weighted_epoch(epoch) if self._weights is not None else self._plain_epoch(epoch)
        start, stop = self.rank * self.batch_size, (self.rank + 1) * self.batch_size
        self._cached_epoch = epoch
        self._cached_batches = [batch[start:stop] for batch in global_batches]
        return self._cached_batches

    def _cut(self, groups: Iterable[list[Sample]], rng: random.Random) -> list[list[Sample]]:
        """Each group shuffled and cut into global batches (its remainder left out), then all shuffled."""
        need = self.global_batch_size
        global_batches: list[list[Sample]] = []
        for group in groups:
            shuffled = list(group)
            rng.shuffle(shuffled)
            usable = len(shuffled) - len(shuffled) % need
            global_batches.extend(shuffled[i : i + need] for i in range(0, usable, need))
        rng.shuffle(global_batches)
        return global_batches

    def _plain_epoch(self, epoch: int) -> list[list[Sample]]:
        """Every group's batches once, shuffled together: datasets in proportion to their size."""
        return self._cut(self._groups.values(), _epoch_rng(self.seed, epoch))

    def _weighted_epoch(self, epoch: int) -> list[list[Sample]]:
        """``len(self)`` global batches, each from a dataset drawn with chance proportional to its weight x
        its batches per pass; each dataset's batches in shuffled passes, a new pass when one runs out."""
        assert self._weights is not None
        ids = [i for i in self._weights if i in self._dataset_batches]
        per_pass = {
            i: sum(len(self._groups[k]) // self.global_batch_size for k in self._dataset_batches[i]) for i in ids
        }
        draws = _stream_rng(self.seed, epoch, "draw").choices(
            ids, weights=[self._weights[i] * per_pass[i] for i in ids], k=self._num_batches
        )
        queues: dict[str, list[list[Sample]]] = {i: [] for i in ids}
        passes = dict.fromkeys(ids, 0)
        out = []
        for dataset_id in draws:
            queue = queues[dataset_id]
            if not queue:
                groups = [self._groups[k] for k in self._dataset_batches[dataset_id]]
                queue.extend(reversed(self._cut(groups, _stream_rng(self.seed, epoch, dataset_id, passes[dataset_id]))))
                passes[dataset_id] += 1
            out.append(queue.pop())
        return out

    def __iter__(self) -> Iterator[list[Sample]]:
        """The rest of the current epoch from the current position; then the epoch advances."""
        if self.batch_index >= self._num_batches:
            # Stopped right after an epoch's last batch (e.g. a checkpoint there): next epoch.
            self.epoch += 1
            self.batch_index = 0
        batches = self._epoch_batches(self.epoch)
        while self.batch_index < len(batches):
            batch = batches[self.batch_index]
            self.batch_index += 1  # counted before yielding: a checkpoint taken now skips it
            yield batch
        self.epoch += 1
        self.batch_index = 0

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch."""
        if epoch < 0:
            raise ValueError(f"epoch must be non-negative, got {epoch}")
        self.epoch = epoch
        self.batch_index = 0

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "batch_index"}``: batch_index counts batches already yielded this epoch."""
        return {"epoch": self.epoch, "batch_index": self.batch_index}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at the batch after the last one yielded when ``state`` was taken.

        Raises:
            ValueError: missing keys, or a position past the end of an epoch (the data or
                batch size changed since the checkpoint).
        """
        missing = {"epoch", "batch_index"} - set(state)
        if missing:
            raise ValueError(f"sampler state lacks {sorted(missing)}; expected keys 'epoch' and 'batch_index'")
        epoch, batch_index = int(state["epoch"]), int(state["batch_index"])
        if epoch < 0 or not 0 <= batch_index <= self._num_batches:
            raise ValueError(
                f"sampler state epoch={epoch}, batch_index={batch_index} does not fit {self._num_batches} batches "
                "per epoch: the datasets or train_batch_size changed since the checkpoint; "
                "restore them or start a fresh run"
            )
        self.epoch = epoch
        self.batch_index = batch_index
