"""Which cuda-bindings, driver and PyTorch the managed pool needs, and a failure of theirs in words.

A cuda-bindings release speaks one CUDA major (12.x or 13.x) and needs a driver of that major or newer;
PyTorch 2.13 from PyPI is a CUDA 13 build that already depends on cuda-bindings 13. Nothing here talks
to a GPU: :mod:`.runtime` passes in what the bindings reported.
"""

from __future__ import annotations

import torch

#: The oldest PyTorch the managed pool is built for: 2.8 made ``torch.cuda.use_mem_pool`` route the
#: calling thread only (pytorch#153356); before it, every thread's allocations land in the managed
#: pool while a cache entry is made. ``pyproject.toml``'s ``gh200`` extra declares the same floor, and
#: tests/test_gh200_torch_floor.py checks both, and the stubs of the torch installed, against this.
TORCH_FLOOR = (2, 8)
#: The NVIDIA driver branch each CUDA major needs (CUDA's release notes: 12.0 -> r525, 13.0 -> r580).
MIN_DRIVER_BRANCH = {12: 525, 13: 580}


def bindings_requirement(torch_cuda: str | None) -> str:
    """The cuda-bindings requirement that matches a PyTorch build's CUDA (``torch.version.cuda``):
    the same major, so one driver serves both."""
    major = int(str(torch_cuda).split(".")[0]) if torch_cuda else 13
    return f"cuda-bindings>={12.6 if major == 12 else major},<{major + 1}"


def install_hint(torch_cuda: str | None = None) -> str:
    """How to get the cuda-bindings a PyTorch build needs: the same CUDA major as the build (PyTorch 2.13
    from PyPI, a CUDA 13 build, already depends on it)."""
    torch_cuda = torch.version.cuda if torch_cuda is None else torch_cuda
    if not torch_cuda:
        return (
            "install a CUDA build of PyTorch (2.13 from PyPI brings cuda-bindings 13); with a CUDA 12 build: "
            f'pip install "{bindings_requirement("12")}"'
        )
    return f'pip install "{bindings_requirement(torch_cuda)}" (the CUDA major of this PyTorch build, {torch_cuda})'


def cuda_version_text(value: int) -> str:
    """CUDA's integer version (12040) as text ("12.4")."""
    return f"{value // 1000}.{value % 1000 // 10}"


def bindings_error_reason(error: str, bindings_version: str, runtime_version: int, driver_version: int) -> str:
    """Why cuda-bindings failed, in words with the fix: no driver, a driver too old for the bindings'
    CUDA major (cuda-bindings 13.x on a CUDA-12 driver), or the error as CUDA reported it.

    ``runtime_version`` / ``driver_version`` are CUDA's integers (``cudaRuntimeGetVersion`` of the
    bindings, ``cudaDriverGetVersion``: 0 when no driver is loaded)."""
    major = runtime_version // 1000
    if driver_version == 0:
        return f"cuda-bindings {bindings_version} finds no NVIDIA driver ({error}); install or load the NVIDIA driver"
    if driver_version // 1000 < major:
        branch = MIN_DRIVER_BRANCH.get(major)
        needs = f"an NVIDIA driver for CUDA {major} (r{branch} or newer)" if branch else f"a driver for CUDA {major}"
        return (
            f"cuda-bindings {bindings_version} (CUDA {cuda_version_text(runtime_version)}) needs {needs}, but this "
            f"driver supports CUDA {cuda_version_text(driver_version)} ({error}). Install the cuda-bindings of the "
            f'driver\'s CUDA: pip install "{bindings_requirement(str(driver_version // 1000))}", with a PyTorch '
            "built for that CUDA, or update the driver"
        )
    return f"cuda-bindings {bindings_version} failed: {error}"


def version_call(rt, name: str) -> int | None:
    """``rt.<name>()`` (cudaDriverGetVersion / cudaRuntimeGetVersion) as an int, None when it fails."""
    try:
        err, value = getattr(rt, name)()
    except Exception:  # the bindings could not load libcudart at all: the version is unknown, not an error
        return None
    return int(value) if err == rt.cudaError_t.cudaSuccess else None


def torch_release(version: str) -> tuple[int, int]:
    """(major, minor) of a PyTorch version string ("2.13.0+cu130" -> (2, 13))."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        return (0, 0)
