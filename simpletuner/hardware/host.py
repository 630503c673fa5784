"""What the host machine has: CPU counts, RAM from ``/proc/meminfo``, the NUMA layout from
``/sys/devices/system/node``, whether an NVIDIA GPU is present.

A leaf probe (imports nothing from simpletuner): hardware detection (:mod:`.machine`), the GH200
managed-memory checks and ``simpletuner diagnose`` read the host through it. Each probe returns
plain values and never raises for a missing or unreadable file.
"""

from __future__ import annotations

import os

MEMINFO_PATH = "/proc/meminfo"
NUMA_ROOT = "/sys/devices/system/node"


def parse_meminfo(text: str) -> dict:
    """``MemTotal`` and ``MemAvailable`` of a /proc/meminfo text, in bytes (None where absent)."""
    values = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            values[key.strip()] = int(fields[0]) * (1024 if fields[1:2] == ["kB"] else 1)
    return {"ram_total_bytes": values.get("MemTotal"), "ram_available_bytes": values.get("MemAvailable")}


def memory_only_numa_bytes(root: str = NUMA_ROOT) -> int:
    """Bytes of the NUMA nodes that have memory but no CPU: on GH200 in NUMA mode (the driver's default)
    the GPU's HBM is such a node, so MemAvailable already counts it. 0 where there are none (x86 hosts,
    GH200 in CDMM mode, GB10) or the layout is unreadable.

    Reads ``node<N>/cpulist`` (empty: no CPU) and ``node<N>/meminfo`` (``Node N MemTotal: X kB``)."""
    total = 0
    try:
        names = sorted(n for n in os.listdir(root) if n.startswith("node") and n[4:].isdigit())
    except OSError:
        return 0
    for name in names:
        try:
            with open(os.path.join(root, name, "cpulist"), encoding="ascii") as f:
                if f.read().strip():
                    continue
            with open(os.path.join(root, name, "meminfo"), encoding="ascii") as f:
                meminfo = f.read()
        except OSError:
            continue
        for line in meminfo.splitlines():
            fields = line.split()
            if len(fields) >= 4 and fields[2] == "MemTotal:" and fields[3].isdigit():
                total += int(fields[3]) * 1024
    return total


def hbm_in_host_memory(device_total_bytes: int | None, memory_only_numa_bytes: int | None) -> bool:
    """Whether the GPU's memory is a CPU-less NUMA node of the host (GH200 in NUMA mode, the driver's
    default), so /proc/meminfo's MemAvailable already counts it: such nodes hold at least half the GPU's
    memory (:func:`memory_only_numa_bytes`)."""
    return bool(device_total_bytes and memory_only_numa_bytes and memory_only_numa_bytes >= device_total_bytes / 2)


def collect_host(meminfo_path: str | None = None, numa_root: str = NUMA_ROOT) -> dict:
    """CPU counts (all, and usable by this process), RAM from /proc/meminfo (None if unreadable), and the
    memory of CPU-less NUMA nodes (:func:`memory_only_numa_bytes`)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = None
    try:
        with open(meminfo_path or MEMINFO_PATH, encoding="ascii") as f:
            memory = parse_meminfo(f.read())
    except OSError:
        memory = parse_meminfo("")
    return {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": usable,
        **memory,
        "memory_only_numa_bytes": memory_only_numa_bytes(numa_root),
        "nvidia_gpu_present": nvidia_gpu_present(),
    }


def nvidia_gpu_present(proc_gpus: str = "/proc/driver/nvidia/gpus", dev: str = "/dev") -> bool:
    """Whether the host has an NVIDIA GPU at all (its driver lists one, or a /dev/nvidiaN node exists),
    whatever PyTorch sees: without one the GPU verdicts do not apply; with one they must pass."""
    try:
        if any(os.scandir(proc_gpus)):
            return True
    except OSError:
        pass
    try:
        return any(e.name.startswith("nvidia") and e.name[6:].isdigit() for e in os.scandir(dev))
    except OSError:
        return False
