"""The PyTorch the managed pool needs: the ``gh200`` extra's floor, the runtime's check of it, and the
private APIs the runtime calls, read from the installed PyTorch's stubs (``torch/_C/__init__.pyi``) and
``torch/cuda/memory.py``, so an upgrade that renames or reshapes one fails here, on CPU."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest
import torch

from simpletuner.hardware.cuda_versions import TORCH_FLOOR, torch_release
from simpletuner.hardware.runtime import CudaBindingsRuntime

ROOT = Path(__file__).resolve().parents[1]
TORCH_DIR = Path(torch.__file__).parent

#: torch._C functions simpletuner/gh200 and simpletuner/hardware call -> the parameters it passes, in order.
C_CALLS = {
    "_cuda_beginAllocateToPool": ["device", "mempool_id"],  # runtime.route_all_allocations
    "_cuda_endAllocateToPool": ["device", "mempool_id"],  # runtime.end_routing
    "_cuda_customAllocator": ["alloc_fn", "free_fn"],  # runtime._make_pool
    "_current_graph_task_id": [],  # managed_weights: forward or backward
    # what torch.cuda.use_mem_pool calls since 2.8 (pytorch#153356), the reason for TORCH_FLOOR: before it,
    # use_mem_pool caught every thread's allocations while a cache entry was made in the managed pool
    "_cuda_beginAllocateCurrentThreadToPool": ["device", "mempool_id"],
}


def _stub_functions() -> dict[str, list[str]]:
    tree = ast.parse((TORCH_DIR / "_C" / "__init__.pyi").read_text())
    return {node.name: [a.arg for a in node.args.args] for node in tree.body if isinstance(node, ast.FunctionDef)}


def test_the_installed_stubs_have_every_call_the_runtime_makes():
    stubs = _stub_functions()
    for name, params in C_CALLS.items():
        assert name in stubs, f"torch._C.{name} is gone from torch {torch.__version__}'s stubs"
        assert stubs[name] == params, f"torch._C.{name}{tuple(stubs[name])}: the runtime passes {params}"


def test_the_runtime_calls_what_the_stub_list_names():
    """The list above is the runtime's: each name is called in simpletuner/gh200 or simpletuner/hardware (and
    nothing else of torch._C's CUDA pool API is), so the check above covers what runs."""
    folders = [ROOT / "simpletuner" / "gh200", ROOT / "simpletuner" / "hardware"]
    source = "".join(p.read_text() for folder in folders for p in folder.glob("*.py"))
    called = set(re.findall(r"torch\._C\.(_\w+)\(", source))
    assert called == set(C_CALLS) - {"_cuda_beginAllocateCurrentThreadToPool"}


def test_mempool_and_use_mem_pool_take_what_the_runtime_passes():
    params = inspect.signature(torch.cuda.MemPool.__init__).parameters
    assert "allocator" in params
    assert "device" in inspect.signature(torch.cuda.use_mem_pool).parameters
    # use_mem_pool routes the calling thread only (the 2.8 form): it calls the current-thread entry point
    assert "_cuda_beginAllocateCurrentThreadToPool" in inspect.getsource(torch.cuda.use_mem_pool)
    # pool_stats asks for a snapshot without traces (2.11+) and falls back to snapshot() before that
    assert "include_traces" in inspect.signature(torch.cuda.MemPool.snapshot).parameters


def test_the_gh200_extra_declares_the_floor():
    (line,) = re.findall(r"^gh200 = (\[.*\])$", (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    requirements = ast.literal_eval(line)
    assert f"torch>={'.'.join(map(str, TORCH_FLOOR))}" in requirements
    assert not any(req.startswith("cuda-bindings") for req in requirements)  # it follows the torch build


def test_the_installed_torch_meets_the_floor():
    assert torch_release(torch.__version__) >= TORCH_FLOOR


@pytest.mark.parametrize(
    ("version", "release"), [("2.13.0+cu130", (2, 13)), ("2.8.0", (2, 8)), ("2.10.0a0+git1234", (2, 10))]
)
def test_release_parsing(version, release):
    assert torch_release(version) == release


def test_an_older_torch_is_a_reason(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.6")
    monkeypatch.setattr(torch, "__version__", "2.7.1+cu126")
    reason = CudaBindingsRuntime().unavailable_reason()
    assert reason.startswith("this PyTorch (2.7.1+cu126) is older than 2.8") and "upgrade PyTorch" in reason
