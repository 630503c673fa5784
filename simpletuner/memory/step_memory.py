"""Live bytes during one fake training step, by kind: what the estimator reads from the step.

:class:`StepMemory` is a dispatch mode that sees every op of the step (forward, backward, recomputation)
and keeps, per tensor storage, its kind and size: parameters, buffers, the batch (``OTHER``), parameter
gradients, and everything else. It counts as torch's ``MemTracker`` does, without its per-module
snapshots (more than half of an estimate's trace); only the global peaks are kept. How it compares with
MemTracker: documentation/MEMORY.md, "How the estimate is made".
"""

from __future__ import annotations

from functools import wraps
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary, weakref

PARAM, BUFFER, OTHER, GRAD, MADE = "param", "buffer", "other", "grad", "made"
#: Kinds present before the step starts: what the step itself adds is measured above them.
RESIDENT = (PARAM, BUFFER, OTHER)


class StepMemory(TorchDispatchMode):
    """Tracks the storages of ``model`` and ``inputs`` and of every tensor an op returns while active.

    ``peak_activations``: the most bytes ever live that are neither resident nor parameter gradients;
    ``peak_above_resident``: at the moment of the most bytes live in all, those bytes minus the resident
    ones (activations plus the gradients made so far).
    """

    def __init__(self, model: nn.Module, inputs: list[torch.Tensor]):
        super().__init__()
        self._info = WeakIdKeyDictionary()  # storage -> [kind, bytes, weakref keeping the free callback]
        self.live = dict.fromkeys((PARAM, BUFFER, OTHER, GRAD, MADE), 0)
        self.total = 0
        self.peak_total = 0
        self.peak_above_resident = 0
        self.peak_activations = 0
        self._hooks: list[Any] = []
        self._orig_resize = None
        for p in model.parameters():
            self._classify(p, PARAM)
            if p.requires_grad:  # its gradient, as it is made and as it is accumulated
                self._hooks.append(p.register_hook(lambda grad: self._classify(grad, GRAD)))
                self._hooks.append(p.register_post_accumulate_grad_hook(lambda q: self._classify(q.grad, GRAD)))
        for b in model.buffers():
            self._classify(b, BUFFER)
        for t in inputs:
            self._classify(t, OTHER)
        self._note_peak()

    # --- storages ---
    def _add(self, storage, kind: str) -> None:
        nbytes = storage.nbytes()
        entry: list[Any] = [kind, nbytes, None]
        entry[2] = weakref.ref(storage, lambda _ref: self._free(entry))
        self._info[storage] = entry
        self.live[kind] += nbytes
        self.total += nbytes

    def _free(self, entry: list) -> None:
        self.live[entry[0]] -= entry[1]
        self.total -= entry[1]

    def _classify(self, t: torch.Tensor | None, kind: str) -> None:
        """Record ``t``'s storage as ``kind`` (a known storage changes kind)."""
        if t is None:
            return
        storage = t.untyped_storage()
        entry = self._info.get(storage)
        if entry is None:
            self._add(storage, kind)
        elif entry[0] != kind:
            self.live[entry[0]] -= entry[1]
            self.live[kind] += entry[1]
            entry[0] = kind

    def _resized(self, storage) -> None:
        entry = self._info.get(storage)
        if entry is not None and entry[1] != storage.nbytes():
            change = storage.nbytes() - entry[1]
            entry[1] += change
            self.live[entry[0]] += change
            self.total += change

    def _note_peak(self) -> None:
        live = self.live
        resident = live[PARAM] + live[BUFFER] + live[OTHER]
        if self.total > self.peak_total:
            self.peak_total = self.total
            self.peak_above_resident = self.total - resident
        activations = self.total - resident - live[GRAD]
        if activations > self.peak_activations:
            self.peak_activations = activations

    # --- the mode ---
    def __enter__(self):
        original = self._orig_resize = torch.UntypedStorage.resize_

        @wraps(original)
        def resize_(storage, size):  # not an op the dispatch mode sees
            result = original(storage, size)
            self._resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *args):
        torch.UntypedStorage.resize_ = self._orig_resize
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        return super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in tree_flatten(result)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                entry = self._info.get(storage)
                if entry is None:
                    self._add(storage, MADE)
                elif entry[1] != storage.nbytes():
                    self._resized(storage)
        self._note_peak()
        return result
