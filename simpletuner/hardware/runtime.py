"""The CUDA runtime behind the unified-memory layer, injectable so every code path runs on CPU.

:class:`CudaBindingsRuntime` is the real one: managed memory from a process-lifetime pool
(``cudaMallocManaged`` through ``cuda.bindings.runtime``, wrapped with
``torch._C._cuda_customAllocator`` and used through ``torch.cuda.MemPool``), plus
``cudaMemAdvise`` / ``cudaMemPrefetchAsync`` on managed pointers only. Where anything is
missing (no CUDA build, no device, no cuda-bindings, no managed-memory support) it says why
through :meth:`unavailable_reason` and the callers fall back.

Tests install a recording fake with :func:`use_runtime`; nothing else in the package talks to
CUDA for unified memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Literal, Protocol

import torch

from simpletuner.hardware.cuda_versions import (
    TORCH_FLOOR,
    bindings_error_reason,
    cuda_version_text,
    install_hint,
    torch_release,
    version_call,
)
from simpletuner.hardware.managed_pool import PoolAccount

logger = logging.getLogger(__name__)

#: Where memory should live: the CPU, or a CUDA device ordinal.
Location = Literal["cpu"] | int
#: The advice kinds we use (cudaMemAdviseSet*).
Advice = Literal["preferred_location", "accessed_by", "read_mostly"]


@dataclass(frozen=True)
class DeviceMemoryInfo:
    """What a CUDA device reports about its memory (from device attributes, never its name)."""

    index: int
    name: str
    compute_capability: tuple[int, int]
    total_bytes: int
    managed_memory: bool
    concurrent_managed_access: bool
    pageable_memory_access: bool
    pageable_uses_host_page_tables: bool
    integrated: bool
    problem: str | None = None  # why the attributes above could not be read (they then read False)

    @property
    def unified(self) -> bool:
        """CPU and GPU share memory (GB10) or the GPU reads host memory through ATS (GH200)."""
        return self.integrated or (self.pageable_memory_access and self.pageable_uses_host_page_tables)

    @property
    def kind(self) -> str:
        if self.problem is not None:
            return f"unknown (the device attributes are unreadable: {self.problem})"
        if self.integrated:
            return "integrated (CPU and GPU share one memory, e.g. GB10)"
        if self.unified:
            return "coherent (GPU reads host memory through host page tables, e.g. GH200)"
        return "discrete (GPU memory separate from host RAM)"

    def as_dict(self) -> dict:
        return {**asdict(self), "unified": self.unified, "kind": self.kind}


class UnifiedMemoryRuntime(Protocol):
    """What the unified-memory layer needs from CUDA."""

    def unavailable_reason(self) -> str | None:
        """None when managed memory can be used; otherwise why not, in words."""

    def cuda_available(self) -> bool:
        """Whether a CUDA device is usable at all (pinned memory needs one)."""

    def device_info(self, index: int | None = None) -> DeviceMemoryInfo | None: ...

    def current_device(self) -> int: ...

    def managed_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor in managed memory from the process-lifetime pool."""

    def is_managed(self, tensor: torch.Tensor) -> bool: ...

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """A page-locked CPU copy (needs a CUDA device)."""

    def advise(self, tensor: torch.Tensor, advice: Advice, location: Location) -> None: ...

    def prefetch(self, tensor: torch.Tensor, location: Location, stream: int | None = None) -> None: ...

    def synchronize(self) -> None: ...

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of the current device."""

    def versions(self) -> dict[str, str | None]:
        """torch, CUDA build, driver, cuda-bindings versions (None where absent)."""

    # --- what managed_memory frozen_weights / all need beyond caches ---
    def new_stream(self) -> object:
        """A CUDA stream of its own (the weight prefetcher's side stream); it has ``cuda_stream``."""

    def record_event(self, stream: object | None) -> object:
        """An event recorded on ``stream`` (None: the current stream) now: done when the work queued
        there so far is."""

    def wait_event(self, event: object, stream: object | None = None) -> None:
        """Make ``stream`` (None: the current stream) wait for ``event`` before running what is
        queued on it after this call."""

    def route_all_allocations(self, limit_bytes: int | None) -> None:
        """From now on every CUDA allocation of this process, on any thread, comes from the managed
        pool, which may hold at most ``limit_bytes`` (None: unbounded)."""

    def pool_stats(self) -> dict | None:
        """What the managed pool holds (see :meth:`CudaBindingsRuntime.pool_stats`); None before it exists."""

    def end_routing(self) -> None:
        """Stop :meth:`route_all_allocations`: later allocations come from PyTorch's own pools again
        (what the managed pool holds stays valid; its cached blocks are freed with the process)."""

    def routing_problem(self) -> str | None:
        """Why :meth:`route_all_allocations` cannot work in this PyTorch, or None."""


class NoCudaRuntime:
    """No managed memory, for a stated reason (also what tests use for "no CUDA")."""

    def __init__(self, reason: str = "no CUDA device (torch.cuda.is_available() is False)", cuda: bool = False):
        self.reason = reason
        self._cuda = cuda

    def unavailable_reason(self) -> str | None:
        return self.reason

    def cuda_available(self) -> bool:
        return self._cuda

    def device_info(self, index: int | None = None) -> DeviceMemoryInfo | None:
        return None

    def current_device(self) -> int:
        return 0

    def managed_empty(self, shape, dtype):
        raise RuntimeError(f"managed memory is unavailable: {self.reason}")

    def is_managed(self, tensor) -> bool:
        return False

    def pin(self, tensor):
        if not self._cuda:
            raise RuntimeError(f"pinned memory needs a CUDA device: {self.reason}")
        return tensor.pin_memory()

    def advise(self, tensor, advice, location) -> None:
        raise RuntimeError(f"managed memory is unavailable: {self.reason}")

    def prefetch(self, tensor, location, stream=None) -> None:
        raise RuntimeError(f"managed memory is unavailable: {self.reason}")

    def synchronize(self) -> None:
        pass

    def mem_get_info(self) -> tuple[int, int]:
        return (0, 0)

    def versions(self) -> dict[str, str | None]:
        return {"torch": torch.__version__, "cuda_build": torch.version.cuda, "driver": None, "cuda_bindings": None}

    def new_stream(self):
        raise RuntimeError(f"CUDA streams are unavailable: {self.reason}")

    def record_event(self, stream):
        raise RuntimeError(f"CUDA events are unavailable: {self.reason}")

    def wait_event(self, event, stream=None) -> None:
        raise RuntimeError(f"CUDA events are unavailable: {self.reason}")

    def route_all_allocations(self, limit_bytes) -> None:
        raise RuntimeError(f"managed memory is unavailable: {self.reason}")

    def end_routing(self) -> None:
        pass

    def pool_stats(self) -> dict | None:
        return None

    def routing_problem(self) -> str | None:
        return f"managed memory is unavailable: {self.reason}"


class CudaBindingsRuntime:
    """Managed memory through ``cuda.bindings.runtime`` (the ``[gh200]`` extra)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: torch.cuda.MemPool | None = None
        self._callbacks: tuple[Any, Any] | None = None  # ctypes trampolines: must live as long as the process
        self._rt: Any = None  # cuda.bindings.runtime, imported on first use
        self._reason: str | None = None
        self._checked = False
        self.account = PoolAccount()  # what the pool holds; bounded by route_all_allocations
        self._routed: int | None = None  # the device every allocation is routed to the pool on
        self._verified = False  # the pool's first allocation was checked to be managed

    # --- availability ---
    def _bindings(self):
        if self._rt is None:
            from cuda.bindings import runtime

            self._rt = runtime
        return self._rt

    def cuda_available(self) -> bool:
        return torch.version.cuda is not None and torch.cuda.is_available()

    def unavailable_reason(self) -> str | None:
        if not self._checked:
            self._reason = self._find_reason()
            self._checked = True
        return self._reason

    def _find_reason(self) -> str | None:
        if torch.version.cuda is None:
            return f"this PyTorch build ({torch.__version__}) has no CUDA"
        if torch_release(torch.__version__) < TORCH_FLOOR:
            return (
                f"this PyTorch ({torch.__version__}) is older than {'.'.join(map(str, TORCH_FLOOR))}, the first whose "
                "torch.cuda.use_mem_pool keeps other threads' allocations out of a pool; upgrade PyTorch"
            )
        if not torch.cuda.is_available():
            return "no CUDA device (torch.cuda.is_available() is False)"
        try:
            self._bindings()
        except ImportError:
            return f"cuda-bindings is not installed ({install_hint()})"
        info = self.device_info()
        if info is not None and info.problem is not None:
            return info.problem
        if info is None or not info.managed_memory:
            return f"device {self.current_device()} does not support managed memory"
        return None

    def _attr(self, name: str, index: int) -> int:
        rt = self._bindings()
        err, value = rt.cudaDeviceGetAttribute(getattr(rt.cudaDeviceAttr, name), index)
        self._check(err, f"cudaDeviceGetAttribute({name})")
        return int(value)

    def _bindings_problem(self, exc: Exception) -> str:
        """``exc`` (a cuda-bindings call that failed) in words, with the fix."""
        import cuda.bindings

        rt = self._bindings()
        runtime_version = version_call(rt, "cudaRuntimeGetVersion")
        driver_version = version_call(rt, "cudaDriverGetVersion")
        version = getattr(cuda.bindings, "__version__", "?")
        return bindings_error_reason(str(exc), version, runtime_version or 0, driver_version or 0)

    def device_info(self, index: int | None = None) -> DeviceMemoryInfo | None:
        """What device ``index`` (default: the current one) reports, or None without CUDA. Never raises
        for cuda-bindings: attributes it cannot read are False, and ``problem`` says why."""
        if not self.cuda_available():
            return None
        index = self.current_device() if index is None else index
        props = torch.cuda.get_device_properties(index)
        names = (
            ("managed_memory", "cudaDevAttrManagedMemory"),
            ("concurrent_managed_access", "cudaDevAttrConcurrentManagedAccess"),
            ("pageable_memory_access", "cudaDevAttrPageableMemoryAccess"),
            ("pageable_uses_host_page_tables", "cudaDevAttrPageableMemoryAccessUsesHostPageTables"),
        )
        problem = None
        try:
            attrs = {name: bool(self._attr(attr, index)) for name, attr in names}
        except ImportError:
            attrs = {name: False for name, _ in names}
        except Exception as exc:  # a driver the bindings cannot use: a reason, never a crash at start
            attrs = {name: False for name, _ in names}
            problem = self._bindings_problem(exc)
        return DeviceMemoryInfo(
            index=index,
            name=props.name,
            compute_capability=(props.major, props.minor),
            total_bytes=int(props.total_memory),
            integrated=bool(getattr(props, "is_integrated", False)),
            problem=problem,
            **attrs,
        )

    def current_device(self) -> int:
        return torch.cuda.current_device() if self.cuda_available() else 0

    # --- the managed pool ---
    def _check(self, result, what: str) -> None:
        err = result[0] if isinstance(result, tuple) else result
        if err != self._bindings().cudaError_t.cudaSuccess:
            raise RuntimeError(f"{what} failed: {err}")

    def _make_pool(self):
        rt = self._bindings()
        alloc_t = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
        free_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)

        account = self.account

        def alloc(size, device, stream):
            if not account.reserve(size):  # over the bound: the caching allocator frees its cache, retries, then OOMs
                return 0
            err, ptr = rt.cudaMallocManaged(size, rt.cudaMemAttachGlobal)
            if err != rt.cudaError_t.cudaSuccess:
                account.cancel(size)
                logger.error("cudaMallocManaged(%d bytes) failed: %s", size, err)
                return 0  # the caching allocator turns this into an OOM error
            account.allocated(int(ptr), size)
            return int(ptr)

        def free(ptr, size, device, stream):
            if ptr:
                account.release(ptr, size)
                try:
                    rt.cudaFree(ptr)
                except Exception:  # interpreter shutdown: nothing left to report to
                    pass

        self._callbacks = (alloc_t(alloc), free_t(free))
        alloc_ptr = ctypes.cast(self._callbacks[0], ctypes.c_void_p).value
        free_ptr = ctypes.cast(self._callbacks[1], ctypes.c_void_p).value
        allocator = torch._C._cuda_customAllocator(alloc_ptr, free_ptr)
        return torch.cuda.MemPool(allocator=allocator)

    def _get_pool(self):
        with self._lock:
            if self._pool is None:
                self._pool = self._make_pool()
                logger.info("managed-memory pool created on cuda:%d", self.current_device())
            return self._pool

    def managed_empty(self, shape, dtype):
        reason = self.unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"managed memory is unavailable: {reason}")
        device = f"cuda:{self.current_device()}"
        if self._routed is not None:  # every allocation already comes from the pool
            return torch.empty(shape, dtype=dtype, device=device)
        with torch.cuda.use_mem_pool(self._get_pool()):
            tensor = torch.empty(shape, dtype=dtype, device=device)
        if not self._verified and tensor.numel():
            self._verify_managed(tensor)
        return tensor

    def _verify_managed(self, tensor: torch.Tensor) -> None:
        """The pool's first allocation must be managed: some PyTorch releases bypass a pool's own allocator
        under ``expandable_segments:True`` (pytorch#147851) and would hand out plain GPU memory."""
        if not self.is_managed(tensor):
            raise RuntimeError(
                f"the managed pool returned memory that is not managed (PyTorch {torch.__version__}, "
                f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r}): with "
                "expandable_segments:True some PyTorch releases bypass a pool's own allocator. Remove "
                "expandable_segments from PYTORCH_CUDA_ALLOC_CONF (scripts/setup_gh200_env.sh sets it when the "
                'variable is unset: export PYTORCH_CUDA_ALLOC_CONF="" after sourcing it)'
            )
        self._verified = True

    def pool_stats(self) -> dict | None:
        """Bytes the managed pool holds (segments, reserved, the account's bound and peak), or None
        before the first managed allocation."""
        if self._pool is None:
            return None
        try:
            snapshot = self._pool.snapshot(include_traces=False)  # 2.11+: without the (slow) trace history
        except TypeError:
            snapshot = self._pool.snapshot()
        return {
            "segments": len(snapshot),
            "reserved_bytes": sum(s.get("total_size", 0) for s in snapshot),
            **self.account.as_dict(),
        }

    # --- managed_memory all: every allocation from the pool ---
    def routing_problem(self) -> str | None:
        reason = self.unavailable_reason()
        if reason is not None:
            return f"managed memory is unavailable: {reason}"
        if not hasattr(torch._C, "_cuda_beginAllocateToPool"):
            return (
                f"this PyTorch ({torch.__version__}) has no torch._C._cuda_beginAllocateToPool, which routes every "
                "thread's allocations to one pool"
            )
        return None

    def route_all_allocations(self, limit_bytes: int | None) -> None:
        problem = self.routing_problem()
        if problem is not None:
            raise RuntimeError(problem)
        self.account.set_limit(limit_bytes)
        pool, device = self._get_pool(), self.current_device()
        # Unlike torch.cuda.use_mem_pool (this thread only), this routes every stream and thread,
        # the autograd engine's backward thread included: the stock-PyTorch form of the fork's use_uvm.
        torch._C._cuda_beginAllocateToPool(device, pool.id)
        self._routed = device

    def end_routing(self) -> None:
        if self._routed is None or self._pool is None:  # routing made the pool
            return
        torch._C._cuda_endAllocateToPool(self._routed, self._pool.id)
        self._routed = None

    # --- streams and events (the weight prefetcher) ---
    def new_stream(self):
        return torch.cuda.Stream()

    def record_event(self, stream):
        event = torch.cuda.Event()
        event.record(stream if stream is not None else torch.cuda.current_stream())
        return event

    def wait_event(self, event, stream=None) -> None:
        (stream if stream is not None else torch.cuda.current_stream()).wait_event(event)

    def is_managed(self, tensor: torch.Tensor) -> bool:
        if not tensor.is_cuda or self.unavailable_reason() is not None:
            return False
        rt = self._bindings()
        err, attrs = rt.cudaPointerGetAttributes(tensor.data_ptr())
        if err != rt.cudaError_t.cudaSuccess:
            return False
        return attrs.type == rt.cudaMemoryType.cudaMemoryTypeManaged

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory()

    # --- advice and prefetch ---
    # cuda-bindings 12.x: cudaMemAdvise / cudaMemPrefetchAsync take a device int; the
    # cudaMemLocation forms are the *_v2 functions. 13.x: the plain names take the struct and
    # the *_v2 names are gone. Both are called with the struct form, through whichever exists.
    def _location(self, location: Location):
        rt = self._bindings()
        loc = rt.cudaMemLocation()
        if location == "cpu":
            loc.type = rt.cudaMemLocationType.cudaMemLocationTypeHost
            loc.id = 0
        else:
            loc.type = rt.cudaMemLocationType.cudaMemLocationTypeDevice
            loc.id = int(location)
        return loc

    @staticmethod
    def _range(tensor: torch.Tensor) -> tuple[int, int]:
        """The whole allocation behind ``tensor`` (a view's data_ptr + storage size would overrun)."""
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()

    def advise(self, tensor, advice, location) -> None:
        rt = self._bindings()
        kind = {
            "preferred_location": rt.cudaMemoryAdvise.cudaMemAdviseSetPreferredLocation,
            "accessed_by": rt.cudaMemoryAdvise.cudaMemAdviseSetAccessedBy,
            "read_mostly": rt.cudaMemoryAdvise.cudaMemAdviseSetReadMostly,
        }[advice]
        call = getattr(rt, "cudaMemAdvise_v2", None) or rt.cudaMemAdvise
        self._check(call(*self._range(tensor), kind, self._location(location)), f"cudaMemAdvise({advice})")

    def prefetch(self, tensor, location, stream=None) -> None:
        rt = self._bindings()
        if stream is None:
            stream = torch.cuda.current_stream().cuda_stream
        call = getattr(rt, "cudaMemPrefetchAsync_v2", None) or rt.cudaMemPrefetchAsync
        self._check(call(*self._range(tensor), self._location(location), 0, stream), "cudaMemPrefetchAsync")

    def synchronize(self) -> None:
        if self.cuda_available():
            torch.cuda.synchronize()

    def mem_get_info(self) -> tuple[int, int]:
        if not self.cuda_available():
            return (0, 0)
        free, total = torch.cuda.mem_get_info()
        return int(free), int(total)

    def versions(self) -> dict[str, str | None]:
        out: dict[str, str | None] = {
            "torch": torch.__version__,
            "cuda_build": torch.version.cuda,
            "driver": None,
            "cuda_bindings": None,
        }
        try:
            import cuda.bindings

            out["cuda_bindings"] = getattr(cuda.bindings, "__version__", "installed")
            driver = version_call(self._bindings(), "cudaDriverGetVersion")
        except ImportError:
            return out
        out["driver"] = cuda_version_text(driver) if driver else None  # 0: no driver loaded
        return out


_runtime: UnifiedMemoryRuntime | None = None


def get_runtime() -> UnifiedMemoryRuntime:
    """The runtime in use: the real one unless a test installed another."""
    global _runtime
    if _runtime is None:
        _runtime = CudaBindingsRuntime()
    return _runtime


def set_runtime(runtime: UnifiedMemoryRuntime | None) -> None:
    """Install ``runtime`` (None: back to the real one, created on next use)."""
    global _runtime
    _runtime = runtime


@contextlib.contextmanager
def use_runtime(runtime: UnifiedMemoryRuntime) -> Iterator[UnifiedMemoryRuntime]:
    """Use ``runtime`` inside the block, then restore the previous one."""
    global _runtime
    previous = _runtime
    _runtime = runtime
    try:
        yield runtime
    finally:
        _runtime = previous
