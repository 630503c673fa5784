"""GH200 / GB10 layer: unified-memory hints, managed memory, the accumulation ramp.

- :mod:`.uvm`: ``gh200_uvm_enabled``, ``prefer_cpu_residency``, ``prefer_gpu_residency``,
  ``prefetch_to_device``, ``optimize_batch_for_gh200`` (called once per prepared batch by the
  trainer's data path), ``stack_unified``, ``set_uvm_hint_override``, ``to_unified``.
- :mod:`simpletuner.hardware.runtime`: the CUDA runtime behind them (managed pool via cuda-bindings), injectable.
- :mod:`.ramp`: ``GH200GradientRamp``; :mod:`.wiring`: ``configure_runtime`` -> ``RuntimeDecisions``.
- :mod:`.diagnostic`: the GH200 checks of ``simpletuner diagnose`` (``gh200_diagnostic.py``).

Names are imported lazily (``from simpletuner.gh200 import GH200GradientRamp`` works) so that
importing one submodule does not pull in the others.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "gh200_uvm_enabled": "uvm",
    "prefer_cpu_residency": "uvm",
    "prefer_gpu_residency": "uvm",
    "prefetch_to_device": "uvm",
    "optimize_batch_for_gh200": "uvm",
    "set_uvm_hint_override": "uvm",
    "stack_unified": "uvm",
    "to_unified": "uvm",
    "unified_memory_status": "uvm",
    "GH200GradientRamp": "ramp",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
