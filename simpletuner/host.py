"""What the host machine has: CPU counts, RAM from ``/proc/meminfo``, whether an NVIDIA GPU is present.

A leaf probe (imports nothing from simpletuner): the memory layer's hardware detection and the
GH200 diagnostic both read the host through it. Each probe returns plain values and never raises
for a missing or unreadable file.
"""

from __future__ import annotations

import os

MEMINFO_PATH = "/proc/meminfo"


def parse_meminfo(text: str) -> dict:
    """``MemTotal`` and ``MemAvailable`` of a /proc/meminfo text, in bytes (None where absent)."""
    values = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            values[key.strip()] = int(fields[0]) * (1024 if fields[1:2] == ["kB"] else 1)
    return {"ram_total_bytes": values.get("MemTotal"), "ram_available_bytes": values.get("MemAvailable")}


def collect_host(meminfo_path: str | None = None) -> dict:
    """CPU counts (all, and usable by this process) and RAM from /proc/meminfo (None if unreadable)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = None
    try:
        with open(meminfo_path or MEMINFO_PATH, encoding="ascii") as f:
            memory = parse_meminfo(f.read())
    except OSError:
        memory = parse_meminfo("")
    return {"cpu_count": os.cpu_count(), "cpu_affinity": usable, **memory, "nvidia_gpu_present": nvidia_gpu_present()}


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
