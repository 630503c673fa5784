"""A recording stand-in for the CUDA runtime of ``simpletuner.hardware.runtime``.

CUDA cannot exist on the test machine, so the unified-memory layer is exercised against this
fake: "managed" tensors are CPU tensors the fake remembers by storage pointer, and every
advice, prefetch, pin and allocation is appended to ``calls`` with its sizes and locations (and,
for managed memory, the allocation's address, so a test can tell two ranges of one size apart).
The fake keeps every managed allocation alive, like the process-lifetime pool it stands for, so
a freed tensor's address is never handed to a plain tensor that would then look managed.
Presets model the machines we care about by their attributes (not their names).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from simpletuner.hardware.runtime import DeviceMemoryInfo

GIB = 1024**3


def gh200_info() -> DeviceMemoryInfo:
    return DeviceMemoryInfo(0, "NVIDIA GH200 480GB", (9, 0), 96 * GIB, True, True, True, True, False)


def gb10_info() -> DeviceMemoryInfo:
    return DeviceMemoryInfo(0, "NVIDIA GB10", (12, 1), 119 * GIB, True, True, True, True, True)


def discrete_info() -> DeviceMemoryInfo:
    return DeviceMemoryInfo(0, "NVIDIA H100 80GB HBM3", (9, 0), 80 * GIB, True, True, False, False, False)


@dataclass(frozen=True)
class FakeStream:
    """A side stream: ``cuda_stream`` is its number, as the real one's is its handle."""

    cuda_stream: int


@dataclass(frozen=True)
class FakeEvent:
    id: int
    stream: int


@dataclass
class Call:
    op: str
    nbytes: int = 0
    location: object = None
    detail: object = None
    ptr: int = 0  # the managed allocation's start (0 where not recorded)


@dataclass
class FakeRuntime:
    """Managed memory "works"; ``reason`` set makes it unavailable (with ``cuda`` for pinned)."""

    info: DeviceMemoryInfo | None = field(default_factory=gh200_info)
    reason: str | None = None
    cuda: bool = True
    free_bytes: int | None = None
    calls: list[Call] = field(default_factory=list)
    _managed: set[int] = field(default_factory=set)
    _held: list = field(default_factory=list)  # every managed storage: addresses are never reused
    synchronized: int = 0

    def unavailable_reason(self):
        return self.reason

    def cuda_available(self):
        return self.cuda

    def device_info(self, index=None):
        return self.info

    def current_device(self):
        return 0

    def managed_empty(self, shape, dtype):
        if self.reason is not None:
            raise RuntimeError(self.reason)
        t = torch.empty(shape, dtype=dtype)
        storage = t.untyped_storage()
        self._managed.add(storage.data_ptr())
        self._held.append(storage)
        self.calls.append(Call("managed_alloc", storage.nbytes(), detail=tuple(shape), ptr=storage.data_ptr()))
        return t

    def is_managed(self, tensor):
        return tensor.untyped_storage().data_ptr() in self._managed

    def pin(self, tensor):
        if not self.cuda:
            raise RuntimeError("pinned memory needs CUDA")
        self.calls.append(Call("pin", tensor.untyped_storage().nbytes()))
        return tensor.clone()

    def advise(self, tensor, advice, location):
        assert self.is_managed(tensor), "advice on a pointer that is not managed"
        storage = tensor.untyped_storage()
        self.calls.append(Call("advise", storage.nbytes(), location, advice, storage.data_ptr()))

    def prefetch(self, tensor, location, stream=None):
        assert self.is_managed(tensor), "prefetch of a pointer that is not managed"
        storage = tensor.untyped_storage()
        self.calls.append(Call("prefetch", storage.nbytes(), location, stream, storage.data_ptr()))

    def synchronize(self):
        self.synchronized += 1

    def mem_get_info(self):
        if self.info is None:
            return (0, 0)
        total = self.info.total_bytes
        return (total if self.free_bytes is None else self.free_bytes, total)

    def versions(self):
        return {"torch": torch.__version__, "cuda_build": "12.8", "driver": "12.8", "cuda_bindings": "12.8.0"}

    def pool_stats(self):
        """Like the real runtime: None until the first managed allocation."""
        allocs = self.ops("managed_alloc")
        if not allocs:
            return None
        total = sum(c.nbytes for c in allocs)
        return {"segments": len(allocs), "reserved_bytes": total, "peak_bytes": total, "limit_bytes": self.routed_limit}

    # --- streams, events, routing: recorded, numbered in the order they are made ---
    routed_limit: int | None = None
    routing: str | None = None  # a reason makes routing_problem() answer it
    _made: int = 0

    def new_stream(self):
        self._made += 1
        stream = FakeStream(self._made)
        self.calls.append(Call("new_stream", detail=stream.cuda_stream))
        return stream

    def record_event(self, stream):
        """On ``stream``; None (the current stream) is recorded as location None."""
        self._made += 1
        event = FakeEvent(self._made, getattr(stream, "cuda_stream", stream))
        self.calls.append(Call("record_event", location=event.stream, detail=event.id))
        return event

    def wait_event(self, event, stream=None):
        """``stream`` waits (None: the current stream), recorded as the location."""
        self.calls.append(Call("wait_event", location=getattr(stream, "cuda_stream", stream), detail=event.id))

    def routing_problem(self):
        return self.reason or self.routing

    def route_all_allocations(self, limit_bytes):
        problem = self.routing_problem()
        if problem is not None:
            raise RuntimeError(problem)
        self.routed_limit = limit_bytes
        self.calls.append(Call("route_all", limit_bytes))

    def end_routing(self):
        self.calls.append(Call("end_routing"))

    def ops(self, op: str) -> list[Call]:
        return [c for c in self.calls if c.op == op]
