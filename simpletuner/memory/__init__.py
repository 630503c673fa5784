"""Memory planning: hardware detection, the peak-FLOPS table, MFU (and the estimator beside them).

- :mod:`.hardware`: ``detect_hardware``, ``HardwareInfo``, ``GPU_SPECS`` / ``GpuSpec``,
  ``lookup_gpu``, ``resolve_gpu_name``, ``hardware_for_gpu``, ``mfu``, ``achieved_tflops``.
"""

from __future__ import annotations

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

__all__ = [
    "GPU_SPECS",
    "GpuSpec",
    "HardwareInfo",
    "achieved_tflops",
    "detect_hardware",
    "hardware_for_gpu",
    "known_gpu_names",
    "lookup_gpu",
    "mfu",
    "resolve_gpu_name",
]
