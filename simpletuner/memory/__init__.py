"""Memory planning: hardware detection, the peak-FLOPS table, MFU (and the estimator beside them).

- :mod:`.hardware`: ``detect_hardware``, ``HardwareInfo``, ``GPU_SPECS`` / ``GpuSpec``,
  ``lookup_gpu``, ``resolve_gpu_name``, ``hardware_for_gpu``, ``mfu``, ``achieved_tflops``.
- :mod:`.autoconfig`: ``plan_batch`` (largest micro-batch that fits, accumulation for the
  effective batch), ``EstimateCache``, ``Plan``, ``DoesNotFit``.
- :mod:`.advice`: what dominates a config that does not fit, and the switches that would help.
- :mod:`.presets`: ``load_preset`` / ``load_presets`` (``config/presets/*.json``), ``Preset``,
  ``apply_preset`` (merge one into a raw config: the config's keys win).
- :mod:`.apply`: ``apply_updates`` (write keys into a JSON config: backup, atomic, diff).
- :mod:`.profile`: ``profile_training`` (real steps on a GPU vs the estimate).
"""

from __future__ import annotations

from simpletuner.memory.apply import ApplyError, apply_updates
from simpletuner.memory.autoconfig import DoesNotFit, EstimateCache, Plan, plan_batch
from simpletuner.memory.hardware import (
    GPU_SPECS,
    GpuSpec,
    HardwareInfo,
    achieved_tflops,
    detect_hardware,
    hardware_for_gpu,
    known_gpu_names,
    lookup_gpu,
    mfu,
    resolve_gpu_name,
)
from simpletuner.memory.presets import Preset, apply_preset, load_preset, load_presets

__all__ = [
    "ApplyError",
    "DoesNotFit",
    "EstimateCache",
    "GPU_SPECS",
    "GpuSpec",
    "HardwareInfo",
    "Plan",
    "Preset",
    "achieved_tflops",
    "apply_preset",
    "apply_updates",
    "detect_hardware",
    "hardware_for_gpu",
    "known_gpu_names",
    "load_preset",
    "load_presets",
    "lookup_gpu",
    "mfu",
    "plan_batch",
    "resolve_gpu_name",
]
