"""What machine a run trains on (:class:`HardwareInfo`): detected, or hypothetical for ``estimate --gpu``.

:func:`detect_hardware` describes this machine from the unified-memory runtime (injectable; default
:func:`simpletuner.hardware.runtime.get_runtime`) and the host (:mod:`.host`); whether memory is unified
comes from the device's attributes, never from its name. :func:`hardware_for_gpu` builds the machine
``simpletuner estimate --gpu NAME [--gpu-memory GB]`` plans for from the GPU table (:mod:`.gpus`).
:func:`collect_device` is the device section of ``simpletuner diagnose``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from simpletuner.diskspace import GIB, format_gib
from simpletuner.hardware.gpus import GpuSpec, default_memory_gb, lookup_gpu, resolve_gpu_name
from simpletuner.hardware.host import MEMINFO_PATH, collect_host, hbm_in_host_memory
from simpletuner.hardware.runtime import DeviceMemoryInfo, get_runtime

if TYPE_CHECKING:
    from simpletuner.hardware.runtime import UnifiedMemoryRuntime


@dataclass(frozen=True)
class HardwareInfo:
    """The machine a run trains on (detected) or plans for (hypothetical, from the table).

    ``usable_memory_bytes`` is what training can place on the GPU: the shared memory (host RAM
    total) on an integrated GPU such as GB10; the HBM on GH200 (its host RAM is extra and reported
    as ``host_ram_bytes``); the card's memory on a discrete GPU; None without a GPU.
    """

    device_name: str | None
    gpu_memory_bytes: int | None
    gpu_free_bytes: int | None
    compute_capability: tuple[int, int] | None
    unified_memory: bool
    memory_kind: str
    usable_memory_bytes: int | None
    cpu_cores: int | None
    host_ram_bytes: int | None
    host_ram_available_bytes: int | None
    peak_tflops_bf16: float | None
    peak_tflops_fp16: float | None
    peak_tflops_tf32: float | None
    peak_tflops_fp32: float | None
    bf16_supported: bool | None
    gpu_spec: str | None
    hypothetical: bool = False
    #: The GPU's memory is a CPU-less NUMA node that MemAvailable already counts (GH200 in NUMA mode).
    hbm_in_host_memory: bool = False

    @property
    def has_gpu(self) -> bool:
        return self.device_name is not None

    def peak_tflops(self, precision: str, tf32: bool = True) -> float | None:
        """The dense peak a run in ``mixed_precision`` ``precision`` can reach; None where unknown.

        "bf16" / "fp16": the tensor-core peak of that format. "no" (fp32 weights and matmuls): the
        TF32 tensor-core peak when ``tf32`` is allowed (``enable_tf32``) and the card has TF32,
        else the plain FP32 peak.
        """
        if precision == "no":
            if tf32 and self.peak_tflops_tf32 is not None:
                return self.peak_tflops_tf32
            return self.peak_tflops_fp32
        return {"bf16": self.peak_tflops_bf16, "fp16": self.peak_tflops_fp16}.get(precision)

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> list[str]:
        """A few human lines: GPU, memory, peak FLOPS, host."""
        host = f"host: {_count(self.cpu_cores, 'CPU core')}, RAM {format_gib(self.host_ram_bytes)}"
        if self.host_ram_available_bytes is not None:
            host += f" ({format_gib(self.host_ram_available_bytes)} available)"
        if not self.has_gpu:
            return ["GPU: none (no CUDA device); training would run on the CPU", host]
        major, minor = self.compute_capability or (0, 0)
        bf16 = "bf16 supported" if self.bf16_supported else "no bf16 (use fp16 mixed precision)"
        spec = f"table entry {self.gpu_spec}" if self.gpu_spec else "not in the GPU table: peak FLOPS unknown"
        kind = "hypothetical " if self.hypothetical else ""
        lines = [
            f"GPU: {kind}{self.device_name} (sm_{major}{minor}, {bf16}; {spec})",
            f"memory: {self.memory_kind}; GPU total {format_gib(self.gpu_memory_bytes)}, "
            f"free {format_gib(self.gpu_free_bytes)}, usable for training {format_gib(self.usable_memory_bytes)}",
        ]
        if self.gpu_spec:
            lines.append(
                f"peak dense TFLOPS: bf16 {_tflops(self.peak_tflops_bf16)}, fp16 {_tflops(self.peak_tflops_fp16)}, "
                f"tf32 {_tflops(self.peak_tflops_tf32)}, fp32 {_tflops(self.peak_tflops_fp32)}"
            )
        return [*lines, host]


def _tflops(value: float | None) -> str:
    return "unsupported" if value is None else f"{value:g}"


def _count(value: int | None, noun: str) -> str:
    return f"unknown {noun}s" if value is None else f"{value} {noun}{'' if value == 1 else 's'}"


def _no_gpu(cpu_cores: int | None, host_total: int | None, host_available: int | None) -> HardwareInfo:
    return HardwareInfo(
        device_name=None,
        gpu_memory_bytes=None,
        gpu_free_bytes=None,
        compute_capability=None,
        unified_memory=False,
        memory_kind="none",
        usable_memory_bytes=None,
        cpu_cores=cpu_cores,
        host_ram_bytes=host_total,
        host_ram_available_bytes=host_available,
        peak_tflops_bf16=None,
        peak_tflops_fp16=None,
        peak_tflops_tf32=None,
        peak_tflops_fp32=None,
        bf16_supported=None,
        gpu_spec=None,
    )


def _from_device(
    info: DeviceMemoryInfo,
    free_bytes: int,
    spec: GpuSpec | None,
    cpu_cores: int | None,
    host_total: int | None,
    host_available: int | None,
    hypothetical: bool = False,
) -> HardwareInfo:
    """One HardwareInfo from a device's attributes: the same path for detected and hypothetical machines."""
    usable = host_total if info.integrated and host_total else info.total_bytes
    major, minor = info.compute_capability
    return HardwareInfo(
        device_name=info.name,
        gpu_memory_bytes=info.total_bytes,
        gpu_free_bytes=free_bytes,
        compute_capability=(major, minor),
        unified_memory=info.unified,
        memory_kind=info.kind,
        usable_memory_bytes=usable,
        cpu_cores=cpu_cores,
        host_ram_bytes=host_total,
        host_ram_available_bytes=host_available,
        peak_tflops_bf16=spec.bf16_tflops if spec else None,
        peak_tflops_fp16=spec.fp16_tflops if spec else None,
        peak_tflops_tf32=spec.tf32_tflops if spec else None,
        peak_tflops_fp32=spec.fp32_tflops if spec else None,
        bf16_supported=(major, minor) >= (8, 0),
        gpu_spec=spec.name if spec else None,
        hypothetical=hypothetical,
    )


def detect_hardware(
    runtime: UnifiedMemoryRuntime | None = None, meminfo_path: str = MEMINFO_PATH, cpu_count: int | None = None
) -> HardwareInfo:
    """This machine: the runtime's current device (default :func:`get_runtime`) and the host.

    CPU cores are those this process may use (``cpu_count`` overrides); host RAM is ``MemTotal``
    / ``MemAvailable`` of ``meminfo_path`` (None where it cannot be read). Without a device the
    GPU fields are None and the host fields are still filled.
    """
    runtime = get_runtime() if runtime is None else runtime
    host = collect_host(meminfo_path)
    cores = cpu_count if cpu_count is not None else (host["cpu_affinity"] or host["cpu_count"])
    total, available = host["ram_total_bytes"], host["ram_available_bytes"]
    info = runtime.device_info() if runtime.cuda_available() else None
    if info is None:
        return _no_gpu(cores, total, available)
    free, _total = runtime.mem_get_info()
    spec = lookup_gpu(info.name, memory_bytes=info.total_bytes)
    detected = _from_device(info, int(free), spec, cores, total, available)
    numa = not info.integrated and hbm_in_host_memory(info.total_bytes, host["memory_only_numa_bytes"])
    return dataclasses.replace(detected, hbm_in_host_memory=numa)


def hardware_for_gpu(
    name_or_spec: str | GpuSpec,
    gpu_memory_gb: float | None = None,
    cpu_cores: int | None = None,
    host_ram_bytes: int | None = None,
) -> HardwareInfo:
    """A hypothetical, idle machine with this GPU, for ``simpletuner estimate --gpu NAME``.

    ``gpu_memory_gb`` (GiB) overrides the table's memory ("a 24 GB card"); on an integrated GPU
    it is the shared memory. Superchips default to their host side from the table (GH200: 480 GB
    LPDDR5X, 72 cores; GB10: the shared memory, 20 cores). ValueError for an unknown name.
    """
    if isinstance(name_or_spec, GpuSpec):
        spec, memory_gb = name_or_spec, default_memory_gb(name_or_spec)
    else:
        spec = resolve_gpu_name(name_or_spec)
        memory_gb = default_memory_gb(spec, name_or_spec)
    if gpu_memory_gb is not None:
        if gpu_memory_gb <= 0:
            raise ValueError(f"--gpu-memory must be a positive number of GB, got {gpu_memory_gb}")
        memory_gb = gpu_memory_gb
    total = int(memory_gb * GIB)
    if host_ram_bytes is None and spec.host_memory_gb is not None:
        host_ram_bytes = total if spec.integrated else int(spec.host_memory_gb * GIB)
    info = DeviceMemoryInfo(
        index=0,
        name=spec.name,
        compute_capability=spec.compute_capability,
        total_bytes=total,
        managed_memory=True,
        concurrent_managed_access=True,
        pageable_memory_access=spec.unified,
        pageable_uses_host_page_tables=spec.unified,
        integrated=spec.integrated,
    )
    cores = cpu_cores if cpu_cores is not None else spec.host_cpu_cores
    return _from_device(info, total, spec, cores, host_ram_bytes, None, hypothetical=True)


def collect_device(runtime: UnifiedMemoryRuntime) -> dict | None:
    """The current device's memory attributes and free memory; None without a device."""
    info = runtime.device_info()
    if info is None:
        return None
    free, _total = runtime.mem_get_info()
    return {**info.as_dict(), "free_bytes": int(free)}
