"""managed_memory ``frozen_weights``: frozen weights in CPU memory, read in place by the GPU and
prefetched a few blocks ahead of use.

:func:`place_frozen_weights` moves a model's frozen parameters and buffers into managed memory that
prefers CPU memory and is mapped for the GPU; call it after any dtype cast and before making a
:class:`WeightPrefetcher`, which migrates the next blocks to HBM on a side stream while one computes.
Streams, passes and why the hooks are where they are: the ``frozen_weights`` sections of
documentation/GH200_OPTIMIZATION.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from simpletuner.hardware.runtime import UnifiedMemoryRuntime, get_runtime

logger = logging.getLogger(__name__)

GIB = 1024**3


@runtime_checkable
class SideStream(Protocol):
    """What the prefetcher needs of ``runtime.new_stream()``: the raw stream handle it queues prefetches on."""

    cuda_stream: int


@dataclass(frozen=True)
class WeightUnit:
    """One block the prefetcher moves as a whole: its qualified name, the module, and the bytes of
    its frozen parameters and buffers."""

    name: str
    module: nn.Module
    frozen_bytes: int


def _frozen_bytes(module: nn.Module) -> int:
    params = sum(p.numel() * p.element_size() for p in module.parameters() if not p.requires_grad)
    return params + sum(b.numel() * b.element_size() for b in module.buffers())


def weight_units(model: nn.Module) -> list[WeightUnit]:
    """The repeated blocks of ``model``: every child of the outermost ``nn.ModuleList`` s (a
    transformer's ``blocks`` / ``transformer_blocks``, a UNet's ``down_blocks`` / ``up_blocks``;
    both Wan 2.2 experts' blocks), in registration order. A module outside any list that holds lists
    of its own contributes their children (a UNet's mid block: its resnets and attentions); what
    lies outside every list (embeddings, norms, projections) is not a unit."""
    units: list[WeightUnit] = []

    def walk(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, nn.ModuleList):
                for index, block in enumerate(child):
                    units.append(WeightUnit(f"{path}.{index}", block, _frozen_bytes(block)))
            else:
                walk(path, child)

    walk("", model)
    return units


# --- placement ---


@dataclass(frozen=True)
class PlacedWeights:
    """What :func:`place_frozen_weights` did: tensors moved to managed memory, the bytes of the
    storages behind them, and the bytes of trainable parameters it left alone."""

    num_tensors: int
    placed_bytes: int
    trainable_bytes: int


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    return (str(tensor.device), tensor.untyped_storage().data_ptr())


def _plain(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor behind a parameter or buffer, or ValueError for what cannot be placed."""
    data = tensor.data if isinstance(tensor, nn.Parameter) else tensor
    if type(data) is not torch.Tensor:
        raise ValueError(
            f"managed_memory frozen_weights: {name} is a {type(data).__name__}, not a plain tensor (a quantised "
            "or wrapped weight cannot be moved into managed memory); train without base-model quantisation, "
            "or use managed_memory 'caches'"
        )
    if data.is_meta:
        raise ValueError(
            f"managed_memory frozen_weights: {name} is on the meta device (no values to place); load the weights "
            "before placing them"
        )
    return data


def _managed_storage_for(group: list[torch.Tensor], runtime: UnifiedMemoryRuntime, gpu: int) -> list[torch.Tensor]:
    """Managed copies of the tensors in ``group`` (all on one storage), advised before the copy so
    the pages land in CPU memory, then prefetched to the CPU. Returns one tensor per input, sharing
    one managed storage exactly as the inputs shared theirs."""
    first = group[0]
    storage = first.untyped_storage()
    whole = (
        len(group) == 1
        and first.storage_offset() == 0
        and first.is_contiguous()
        and first.numel() * first.element_size() == storage.nbytes()
    )
    if whole:
        managed = runtime.managed_empty(tuple(first.shape), first.dtype)
    else:  # views into one storage (tied or fused weights): copy the storage's bytes, rebuild each view
        managed = runtime.managed_empty((storage.nbytes(),), torch.uint8)
    runtime.advise(managed, "preferred_location", "cpu")
    runtime.advise(managed, "accessed_by", gpu)
    if whole:
        managed.copy_(first)
        out = [managed]
    else:
        source = torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage)
        managed.copy_(source)
        target = managed.untyped_storage()
        out = [
            torch.empty(0, dtype=t.dtype, device=managed.device).set_(target, t.storage_offset(), t.shape, t.stride())
            for t in group
        ]
    runtime.prefetch(managed, "cpu", None)
    return out


def place_frozen_weights(
    model: nn.Module, runtime: UnifiedMemoryRuntime | None = None, device: int | None = None
) -> PlacedWeights:
    """Move every frozen parameter (``requires_grad`` False) and every buffer of ``model`` into
    managed memory that prefers CPU memory and is mapped for GPU ``device`` (default: the runtime's
    current device), advised before the copy so the pages are populated in CPU memory.

    Tensors are swapped in place (``tensor.data = managed``), so every reference stays valid. Trainable
    parameters, and frozen tensors sharing storage with one, are never touched; tied storages are placed
    once and stay shared; tensors already managed are left alone (a second call places nothing). A later
    dtype cast would copy them out of managed memory: cast first.

    Raises ValueError naming the parameter for a tensor subclass (quantised weights) or a meta tensor.
    """
    runtime = runtime or get_runtime()
    gpu = runtime.current_device() if device is None else device
    named: list[tuple[str, torch.Tensor]] = [(f"parameter {n}", p) for n, p in model.named_parameters()]
    named += [(f"buffer {n}", b) for n, b in model.named_buffers()]

    groups: dict[tuple[str, int], list[torch.Tensor]] = {}
    trainable_storages: dict[tuple[str, int], int] = {}
    for name, tensor in named:
        data = _plain(name, tensor)
        key = _storage_key(data)
        if isinstance(tensor, nn.Parameter) and tensor.requires_grad:
            trainable_storages[key] = data.untyped_storage().nbytes()
            continue
        if data.untyped_storage().nbytes() == 0 or runtime.is_managed(data):
            continue
        groups.setdefault(key, []).append(tensor)

    num_tensors = placed = 0
    for key, group in groups.items():
        if key in trainable_storages:  # tied to a trainable parameter: it trains with it, so it stays
            continue
        datas = [_plain("", t) for t in group]
        for tensor, managed in zip(group, _managed_storage_for(datas, runtime, gpu)):
            tensor.data = managed
        num_tensors += len(group)
        placed += datas[0].untyped_storage().nbytes()
    runtime.synchronize()
    trainable = sum(trainable_storages.values())
    logger.info(
        "managed_memory frozen_weights: %d frozen tensors (%.2f GiB) placed in managed memory (preferred in CPU "
        "memory, read in place by cuda:%d); %.2f GiB of trainable parameters left as they are",
        num_tensors,
        placed / GIB,
        gpu,
        trainable / GIB,
    )
    return PlacedWeights(num_tensors=num_tensors, placed_bytes=placed, trainable_bytes=trainable)


# --- the prefetcher ---


def _managed_frozen_tensors(module: nn.Module, runtime: UnifiedMemoryRuntime) -> list[torch.Tensor]:
    """One tensor per managed storage among ``module``'s frozen parameters and buffers."""
    seen: set[tuple[str, int]] = set()
    out = []
    candidates = [p for p in module.parameters() if not p.requires_grad] + list(module.buffers())
    for tensor in candidates:
        if tensor.untyped_storage().nbytes() == 0:
            continue
        key = _storage_key(tensor)
        if key not in seen and runtime.is_managed(tensor):
            seen.add(key)
            out.append(tensor)
    return out


def _owners(model: nn.Module, units: list[WeightUnit]) -> list[str]:
    """Per unit, the path of the model that runs it: the nearest enclosing module that is a model of
    its own (has ``save_pretrained``: each Wan 2.2 expert, a UNet), else the root ("")."""
    models = [name for name, m in model.named_modules() if name and callable(getattr(m, "save_pretrained", None))]

    def owner(unit: str) -> str:
        enclosing = [name for name in models if unit.startswith(name + ".")]
        return max(enclosing, key=len) if enclosing else ""

    return [owner(unit.name) for unit in units]


class WeightPrefetcher:
    """Prefetches the managed frozen weights of the next ``blocks_ahead`` units (see
    :func:`weight_units`) to the GPU on a side stream while the current one computes; in backward,
    the previous ones. Only units holding managed frozen tensors get hooks; ``blocks_ahead`` 0
    registers none. documentation/GH200_OPTIMIZATION.md states the stream semantics and how passes are
    told apart.

    Use as a context manager, or call :meth:`remove` to take every hook off.
    """

    def __init__(
        self,
        model: nn.Module,
        blocks_ahead: int,
        runtime: UnifiedMemoryRuntime | None = None,
        device: int | None = None,
    ):
        if isinstance(blocks_ahead, bool) or not isinstance(blocks_ahead, int) or blocks_ahead < 0:
            raise ValueError(
                f"WeightPrefetcher: blocks_ahead must be a whole number >= 0 (0 turns prefetching off), "
                f"not {blocks_ahead!r}; set gh200_optimizations.prefetch_blocks_ahead"
            )
        self.runtime = runtime or get_runtime()
        self.blocks_ahead = blocks_ahead
        self.device = self.runtime.current_device() if device is None else device
        self.units: list[WeightUnit] = []
        self._tensors: list[list[torch.Tensor]] = []
        self._owners: list[str] = []
        self._handles: list = []
        self._stream: SideStream | None = None
        # the learned order: owner -> unit indices in execution order, and index -> (that list, position)
        self._order: dict[str, list[int]] = {}
        self._position: dict[int, tuple[list[int], int]] = {}
        # the current pass
        self._backward: bool | None = None
        self._started: set[int] = set()
        self._issued: set[int] = set()
        self._pending: dict[int, object] = {}
        if blocks_ahead == 0:
            return
        units = weight_units(model)
        for unit, owner in zip(units, _owners(model, units)):
            tensors = _managed_frozen_tensors(unit.module, self.runtime)
            if not tensors:
                continue
            index = len(self.units)
            self.units.append(unit)
            self._tensors.append(tensors)
            self._owners.append(owner)
            self._handles.append(unit.module.register_forward_pre_hook(self._forward_hook(index)))
            self._handles.append(unit.module.register_forward_hook(self._output_hook(index)))
        logger.info(
            "weight prefetcher: %d units with managed frozen weights, %d ahead on a side stream",
            len(self.units),
            blocks_ahead,
        )

    # --- hooks ---
    def _forward_hook(self, index: int):
        def hook(module, args):
            self._start(index, backward=torch._C._current_graph_task_id() != -1)

        return hook

    def _output_hook(self, index: int):
        """After a forward that autograd records (not a checkpoint recompute): a hook on each of the
        unit's top-level output tensors, which fires when the gradient reaching that output is
        ready, i.e. just before the unit's own backward runs."""

        def on_grad(grad):
            self._start(index, backward=True)

        def hook(module, args, output):
            if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
                return
            for tensor in output if isinstance(output, tuple) else (output,):
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(on_grad)

        return hook

    def _start(self, index: int, backward: bool) -> None:
        if backward:
            if self._backward is not True:
                self._new_pass(backward=True)
        else:
            if self._backward is not False or index in self._started:
                self._new_pass(backward=False)
            if index not in self._position:
                order = self._order.setdefault(self._owners[index], [])
                self._position[index] = (order, len(order))
                order.append(index)
        self._started.add(index)
        event = self._pending.pop(index, None)
        if event is not None:
            self.runtime.wait_event(event)
        if index not in self._position:
            return
        order, pos = self._position[index]
        ahead = (
            order[max(0, pos - self.blocks_ahead) : pos][::-1]
            if backward
            else order[pos + 1 : pos + 1 + self.blocks_ahead]
        )
        todo = [other for other in ahead if other not in self._issued and other not in self._started]
        if not todo:
            return
        stream = self._side_stream()
        # The gate: the side stream starts these migrations only once the GPU reaches this unit, so the
        # host running ahead never has more than blocks_ahead units migrating beyond the one computing.
        self.runtime.wait_event(self.runtime.record_event(None), stream)
        for other in todo:
            self._prefetch(other, stream)

    def _new_pass(self, backward: bool) -> None:
        self._backward = backward
        self._started.clear()
        self._issued.clear()
        self._pending.clear()

    def _side_stream(self) -> SideStream:
        """The one side stream every prefetch is queued on, made on first use."""
        if self._stream is None:
            stream = self.runtime.new_stream()
            assert isinstance(stream, SideStream), f"runtime.new_stream() gave a {type(stream).__name__}"
            self._stream = stream
        return self._stream

    def _prefetch(self, index: int, stream: SideStream) -> None:
        for tensor in self._tensors[index]:
            self.runtime.prefetch(tensor, self.device, stream.cuda_stream)
        self._pending[index] = self.runtime.record_event(stream)
        self._issued.add(index)

    # --- lifetime ---
    def remove(self) -> None:
        """Take every hook off (idempotent); pending events are dropped."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._pending.clear()

    def __enter__(self) -> WeightPrefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
