"""The managed pool's accounting: what it holds, its peak, and the bound it may not pass.

The real runtime's allocation callback (``cudaMallocManaged`` behind ``torch.cuda.MemPool``)
asks :meth:`PoolAccount.reserve` before every allocation and calls :meth:`PoolAccount.release`
after every free. A refused reservation makes the callback return a null pointer, which the
caching allocator turns into an ordinary out-of-memory error. Before that error it retries once,
but while ``managed_memory: all`` routes every allocation to the pool the only cached blocks it frees
first are those of at least ``max_split_size_mb`` (which that mode therefore sets:
:data:`~simpletuner.gh200.managed_memory.ALL_MODE_ALLOCATOR`; read in PyTorch's allocator source, to be
confirmed on a GPU by scripts/gpu_probe.py). Pure Python, so the bound is tested on CPU.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class PoolAccount:
    """Bytes allocated from the managed pool; ``limit_bytes`` None means unbounded.

    Thread-safe: the caching allocator calls the allocation callback from whichever thread
    allocates (the autograd engine's device thread in backward).
    """

    limit_bytes: int | None = None
    allocated_bytes: int = 0
    peak_bytes: int = 0
    num_allocations: int = 0
    num_refused: int = 0
    largest_refused_bytes: int = 0
    _sizes: dict[int, int] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def set_limit(self, limit_bytes: int | None) -> None:
        """Bound the pool (None: unbounded). Memory already held stays; later reservations obey it."""
        if limit_bytes is not None and limit_bytes <= 0:
            raise ValueError(f"a managed pool limit must be positive, got {limit_bytes}")
        with self._lock:
            self.limit_bytes = limit_bytes

    def reserve(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit under the limit; counted as allocated when they do."""
        with self._lock:
            if self.limit_bytes is not None and self.allocated_bytes + nbytes > self.limit_bytes:
                self.num_refused += 1
                self.largest_refused_bytes = max(self.largest_refused_bytes, nbytes)
                return False
            self.allocated_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
            return True

    def allocated(self, ptr: int, nbytes: int) -> None:
        """Remember the size of the allocation at ``ptr`` (reserved before it was made)."""
        with self._lock:
            self.num_allocations += 1
            self._sizes[ptr] = nbytes

    def cancel(self, nbytes: int) -> None:
        """Give back a reservation whose allocation failed."""
        with self._lock:
            self.allocated_bytes -= nbytes

    def release(self, ptr: int, nbytes: int | None = None) -> None:
        """The allocation at ``ptr`` was freed (its size as recorded; ``nbytes`` when it was not)."""
        with self._lock:
            size = self._sizes.pop(ptr, nbytes or 0)
            self.allocated_bytes -= size

    def as_dict(self) -> dict[str, int | None]:
        with self._lock:
            return {
                "limit_bytes": self.limit_bytes,
                "allocated_bytes": self.allocated_bytes,
                "peak_bytes": self.peak_bytes,
                "num_allocations": self.num_allocations,
                "num_refused": self.num_refused,
                "largest_refused_bytes": self.largest_refused_bytes,
            }
