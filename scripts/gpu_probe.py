"""What only a GPU can tell about simpletuner's CUDA paths (step 3 of ``scripts/gpu_truth.sh``).

    python scripts/gpu_probe.py [--out FILE] [--budget-s S] [--cases a,b]   # every case, or some
    python scripts/gpu_probe.py --env            # versions, PyTorch APIs, device attributes: one JSON line

Each case (in ``scripts/gpu_probe_cases.py``) runs in a process of its own, with its own timeout
(routing every allocation to the managed pool cannot be undone in a process, and a crash or a hang
then costs one case), through simpletuner's own runtime (``simpletuner.hardware.runtime.
CudaBindingsRuntime``). Each writes exactly one JSON line as soon as it ends, to stdout and appended to
``--out``: its figures, or ``error`` (an exception, a timeout, a process that printed nothing), or
``skipped``, and ``seconds``. Without CUDA every case is ``{"case": ..., "skipped": "no CUDA: <why>"}``
and the exit code is 0; with CUDA it is 1 when a case ended in ``error``.

Cases (GPU-REVIEW section 3, step 3), what each answers:

- device: the device attributes behind "unified" / "discrete" (a).
- caches, caches_expandable: the ``unified_memory`` cache path (to_unified, advice, prefetch,
  stack_unified, optimize_batch_for_gh200) gives managed memory with the right values, plain and
  with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (there the runtime may refuse instead) (b).
- errors: advice on memory that is not managed raises, naming cudaErrorInvalidValue (c).
- routing: after ``route_all_allocations`` an allocation on the main thread, on another thread and
  backward's weight gradient are all managed (d).
- end_routing: after ``runtime.end_routing()`` new allocations are no longer managed.
- bound, bound_allocator: under a 1 GiB bound with cached blocks in the pool, does an allocation
  that fits only once the cache is freed raise OOM, and does ``empty_cache`` free anything; with
  ``PYTORCH_CUDA_ALLOC_CONF=""`` and with the allocator settings of ``managed_memory: all`` (e).
- record_stream: are blocks freed after ``record_stream`` on another stream reclaimed while routed (f).
- evict: does a plain cudaMalloc larger than free HBM evict resident managed pages, or fail (i).
- frozen_weights: ``place_frozen_weights`` + ``WeightPrefetcher`` against the same model in plain
  memory: equal losses and gradients, prefetch calls per pass, median step times (g).

Managed memory stays far below free HBM (more can hang the card): at most a third of it (evict), 1.5
GiB (frozen_weights) and 1-2 GiB pool bounds elsewhere.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES_SCRIPT = Path(__file__).resolve().with_name("gpu_probe_cases.py")
sys.path.insert(0, str(CASES_SCRIPT.parent))

from gpu_check import all_mode_alloc_conf  # noqa: E402 - the module beside this one


@dataclass(frozen=True)
class Case:
    """One probe case: its subprocess timeout and the environment it runs with."""

    seconds: float
    env: dict = field(default_factory=dict)


PLAIN = {"PYTORCH_CUDA_ALLOC_CONF": ""}
#: In the order they run: cheap and most telling first, the longest last.
CASES = {
    "device": Case(20),
    "caches": Case(25, PLAIN),
    "errors": Case(20, PLAIN),
    "routing": Case(25, PLAIN),
    "end_routing": Case(25, PLAIN),
    "bound": Case(25, PLAIN),
    "bound_allocator": Case(25, {"PYTORCH_CUDA_ALLOC_CONF": "ALL_MODE"}),  # what `all` adds: ALL_MODE_ALLOCATOR
    "record_stream": Case(25, PLAIN),
    "evict": Case(45, PLAIN),
    "caches_expandable": Case(25, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    "frozen_weights": Case(75, {**PLAIN, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}),
}


# --- the parent: no CUDA, or one process per case ----------------------------------------------------
def skip_reasons() -> tuple[str | None, str | None]:
    """("no CUDA: why" or None, "managed memory unavailable: why" or None). A runtime that raises is
    left to the cases (and --env) to report."""
    try:
        from simpletuner.hardware.runtime import CudaBindingsRuntime

        rt = CudaBindingsRuntime()
        if not rt.cuda_available():
            return f"no CUDA: {rt.unavailable_reason()}", None
        reason = rt.unavailable_reason()
    except Exception:
        return None, None
    return None, (None if reason is None else f"managed memory unavailable: {reason}")


def last_json(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def run_child(name: str, timeout: float) -> dict:
    env = {**os.environ, **CASES[name].env}
    if env.get("PYTORCH_CUDA_ALLOC_CONF") == "ALL_MODE":
        env["PYTORCH_CUDA_ALLOC_CONF"] = all_mode_alloc_conf()
    start = time.perf_counter()
    cmd = [sys.executable, str(CASES_SCRIPT), name]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        line = {"case": name, "error": f"timed out after {timeout:.0f} s", "stderr": stderr[-600:]}
    else:
        line = last_json(done.stdout) or {"case": name, "error": f"exit code {done.returncode}, no result"}
        if done.returncode != 0:  # e.g. a crash at exit, after the line was printed
            line.update(exit_code=done.returncode, stderr=done.stderr[-600:])
    line["seconds"] = round(time.perf_counter() - start, 2)
    return line


def environment() -> dict:
    """Versions, the PyTorch APIs the managed paths use, the device and why managed memory is (not) usable."""
    import importlib.metadata as md
    import inspect
    import platform

    import torch

    out: dict = {"python": platform.python_version(), "torch": torch.__version__, "cuda_build": torch.version.cuda}
    packages = ("cuda-bindings", "numpy", "pydantic", "typing-extensions", "diffusers", "transformers", "accelerate")
    packages += ("peft", "huggingface-hub", "safetensors", "orjson", "lz4", "python-snappy")
    out["packages"] = {}
    for name in packages:
        try:
            out["packages"][name] = md.version(name)
        except md.PackageNotFoundError:
            out["packages"][name] = None
    names = ("_cuda_beginAllocateToPool", "_cuda_beginAllocateCurrentThreadToPool", "_cuda_endAllocateToPool")
    out["torch_api"] = {name: hasattr(torch._C, name) for name in names}
    snapshot = getattr(getattr(torch.cuda, "MemPool", None), "snapshot", None)
    out["torch_api"]["MemPool.snapshot"] = str(inspect.signature(snapshot)) if snapshot else None
    out["alloc_conf_env"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    try:
        out["all_mode_allocator"] = all_mode_alloc_conf()
    except ImportError as exc:  # pydantic missing: the install step says more
        out["all_mode_allocator"] = f"{type(exc).__name__}: {exc}"
    out["no_cuda"], out["no_managed_memory"] = skip_reasons()
    if shutil.which("nvidia-smi"):  # the driver's own version (torch and cuda-bindings give CUDA's)
        query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.used", "--format=csv,noheader"]
        try:
            out["nvidia_smi"] = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            out["nvidia_smi"] = f"{type(exc).__name__}: {exc}"
    try:
        from simpletuner.hardware.runtime import CudaBindingsRuntime

        rt = CudaBindingsRuntime()
        out.update(versions=rt.versions(), unavailable_reason=rt.unavailable_reason())
        info = rt.device_info()
        out["device"] = info.as_dict() if info else None
        if info is not None:
            from simpletuner.hardware.gpus import lookup_gpu

            props = torch.cuda.get_device_properties(info.index)
            out["device"]["multi_processors"] = props.multi_processor_count
            spec = lookup_gpu(info.name, info.total_bytes)
            out["device"]["gpu_table"] = None if spec is None else spec.name
    except Exception as exc:  # the finding itself (e.g. a bindings / driver mismatch that raises)
        out["runtime_error"] = f"{type(exc).__name__}: {exc}"[:600]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="append each case's JSON line to this file too")
    parser.add_argument("--budget-s", type=float, default=100.0, help="seconds for every case together")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    parser.add_argument("--env", action="store_true", help="print versions and device attributes, run no case")
    args = parser.parse_args(argv)
    if args.env:
        print(json.dumps(environment(), default=str), flush=True)
        return 0
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        parser.error(f"--cases: unknown {', '.join(unknown)}; known: {', '.join(CASES)}")
    sink = open(args.out, "a") if args.out else None

    def emit(line: dict) -> None:
        text = json.dumps(line, default=str)
        print(text, flush=True)
        if sink is not None:
            sink.write(text + "\n")
            sink.flush()

    no_cuda, no_managed = skip_reasons()
    reason = no_cuda or no_managed
    deadline = time.monotonic() + args.budget_s
    failed = False
    for name in names:
        left = deadline - time.monotonic()
        if reason is not None:
            emit({"case": name, "skipped": reason, "seconds": 0.0})
        elif left < 5:
            emit({"case": name, "skipped": "out of the probe's time budget", "seconds": 0.0})
        else:
            line = run_child(name, min(CASES[name].seconds, left))
            failed = failed or "error" in line
            emit(line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
