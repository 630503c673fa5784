"""What ``simpletuner diagnose`` checks on a GH200 / GB10 (or any) machine, beyond the facts of
:mod:`simpletuner.hardware`: versions and what is missing, the environment, the managed pool, one
verdict per capability, and the oversubscription test.

Every CUDA fact comes from the runtime passed in (:func:`simpletuner.hardware.runtime.get_runtime`),
so every check runs on CPU against a fake runtime. The checks return plain dicts; the command
(:mod:`simpletuner.cli.diagnose`) prints them.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import torch

from simpletuner.configuration.alloc_conf import ALLOC_CONF_VAR, FORK_ONLY_KEYS, check_alloc_conf
from simpletuner.diskspace import GIB, format_gib
from simpletuner.gh200.managed_memory import backable_bytes
from simpletuner.gh200.uvm import ENV_ALIAS, ENV_VAR, env_hint_request
from simpletuner.hardware.cuda_versions import install_hint
from simpletuner.hardware.host import hbm_in_host_memory
from simpletuner.hardware.runtime import DeviceMemoryInfo, Location, UnifiedMemoryRuntime

ENV_VARS = (
    ENV_VAR,
    ENV_ALIAS,  # the ai-toolkit GH200 fork's name for the same switch
    ALLOC_CONF_VAR,
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
)
TORCH_CUDA_FIX = "install a CUDA build of PyTorch (https://pytorch.org/get-started/locally/)"
DEVICE_FIX = "check `nvidia-smi`, the NVIDIA driver and CUDA_VISIBLE_DEVICES"
ENV_FIX = "source scripts/setup_gh200_env.sh"
#: Where a user of the GH200 fork of ai-toolkit looks for its unified-memory statistics, and what stands in
#: for them on stock PyTorch (the seed reads them from ``torch.cuda.memory_stats()``).
FORK_UVM_STATS = (
    "torch.cuda.memory_stats()'s uvm.stage, uvm.light_reclamations and uvm.hard_reclamations are statistics of "
    "the GH200 fork's patched PyTorch (its use_uvm allocator) and do not exist on stock PyTorch (KeyError). "
    "Here: the managed pool's reserved and peak bytes (this section; managed_pool_gib in metrics.jsonl and the "
    "log line), torch.cuda.memory_stats()'s num_alloc_retries (the caching allocator freed its cache and retried) "
    "and num_ooms, and for pages moving between CPU and GPU memory Nsight Systems: nsys profile "
    "--cuda-um-cpu-page-faults=true --cuda-um-gpu-page-faults=true"
)


def collect_versions(runtime: UnifiedMemoryRuntime) -> dict[str, Any]:
    """torch / CUDA build / driver / cuda-bindings versions, and each missing piece with its fix."""
    versions = dict(runtime.versions())
    missing: list[dict] = []
    if versions.get("cuda_build") is None:
        missing.append({"what": f"this PyTorch build ({versions.get('torch')}) has no CUDA", "fix": TORCH_CUDA_FIX})
    elif not runtime.cuda_available() or runtime.device_info() is None:
        reason = runtime.unavailable_reason() or "none visible"
        what = reason if reason.startswith("no CUDA device") else f"no CUDA device ({reason})"
        missing.append({"what": what, "fix": DEVICE_FIX})
    if versions.get("cuda_bindings") is None:
        missing.append({"what": "cuda-bindings not installed (managed memory needs it)", "fix": install_hint()})
    return {**versions, "missing": missing}


def alloc_conf_problems(value: str | None) -> list[str]:
    """Keys of a PYTORCH_CUDA_ALLOC_CONF value that a stock PyTorch rejects: the GH200 fork's keys,
    then any other key stock PyTorch is not known to accept (see :mod:`simpletuner.configuration.alloc_conf`)."""
    check = check_alloc_conf(value)
    return [*check.fork_keys, *check.unknown_keys]


def _alloc_conf_fix(value: str, bad: list[str]) -> str:
    kept = [item.strip() for item in value.split(",") if item.strip() and item.partition(":")[0].strip() not in bad]
    return f'export {ALLOC_CONF_VAR}="{",".join(kept)}"' if kept else f"unset {ALLOC_CONF_VAR}"


def collect_environment(environ=None) -> dict:
    """The variables that shape a run (None when unset) and warnings about them."""
    environ = os.environ if environ is None else environ
    values = {name: environ.get(name) for name in ENV_VARS}
    warnings = []
    check = check_alloc_conf(values[ALLOC_CONF_VAR])
    bad = [*check.fork_keys, *check.unknown_keys]
    if check.fork_keys:  # keys of the ai-toolkit GH200 fork's patched PyTorch: say what replaces each
        instead = "; ".join(f"`{key}`: {FORK_ONLY_KEYS[key]}" for key in dict.fromkeys(check.fork_keys))
        warnings.append(
            f"{ALLOC_CONF_VAR} has key(s) {', '.join(check.fork_keys)} that a stock PyTorch rejects at the first "
            f"CUDA allocation (they belong to the ai-toolkit GH200 fork's patched PyTorch): remove them "
            f"({_alloc_conf_fix(check.value, bad)}). Instead: {instead}"
        )
    warnings += check.warnings()
    try:
        hints, hints_source = env_hint_request(environ)
        hints_error = None
    except ValueError as error:  # both names set, disagreeing: a run would stop at start
        hints, hints_source, hints_error = None, "", str(error)
        warnings.append(hints_error)
    return {
        "variables": values,
        "unsupported_alloc_conf_keys": bad,
        "uvm_hints": {"requested": hints, "source": hints_source or None, "error": hints_error},
        "warnings": warnings,
    }


def collect_pool(runtime: UnifiedMemoryRuntime) -> dict[str, Any]:
    """Whether the managed-memory pool can be used, and what it holds."""
    reason = runtime.unavailable_reason()
    return {
        "status": "available" if reason is None else reason,
        "stats": runtime.pool_stats(),
        "fork_uvm_stats": FORK_UVM_STATS,  # the fork's `uvm.*` keys: not here, and what replaces them
    }


def verdicts(summary: dict) -> list[dict]:
    """One line per capability: ready or not, the fix where it is not, and a ``status``: ``ok``,
    ``failed`` (exit code 3), ``not applicable`` (not ready, but this machine has no NVIDIA GPU, or
    the GPU is discrete and unified memory does not exist there: nothing to fix, not a failure) or
    ``advice`` (hint environment variables unset or off: a config can still turn hints on)."""
    device, pool, env = summary["device"], summary["managed_pool"], summary["environment"]
    has_gpu = summary["host"].get("nvidia_gpu_present", True)
    out = []

    def add(ready: bool, what: str, fix: str | None = None, applies: bool | str = True) -> None:
        status = "ok" if ready else ("failed" if applies is True else applies or "not applicable")
        out.append({"ready": ready, "what": what, "fix": None if ready else fix, "status": status})

    device_fix = TORCH_CUDA_FIX if summary["versions"].get("cuda_build") is None else DEVICE_FIX
    if device is None:
        reasons = "; ".join(m["what"] for m in summary["versions"]["missing"] if "cuda-bindings" not in m["what"])
        add(False, f"CUDA device: {reasons or 'none'}", device_fix, applies=has_gpu)
    else:
        add(
            True,
            f"CUDA device: {device['name']} (sm_{device['compute_capability'][0]}{device['compute_capability'][1]})",
        )
    if "cuda-bindings is not installed" in pool["status"]:
        pool_fix = install_hint()
    elif "cuda-bindings" in pool["status"]:  # installed but unusable: the status names the fix
        pool_fix = "as the line says (a driver and cuda-bindings of one CUDA major)"
    else:
        pool_fix = device_fix if device is None else "use a GPU that supports managed memory"
    add(
        pool["status"] == "available",
        f"managed memory pool: {pool['status']}",
        pool_fix,
        applies=device is not None or has_gpu,
    )
    if device is not None:
        add(
            device["unified"],
            f"unified memory: {device['kind']}",
            "nothing to fix: on a discrete GPU unified-memory hints stay off and oversubscription is refused",
            applies=False,
        )
        if device["unified"]:
            hints = env["uvm_hints"]
            if hints["error"] is not None:
                add(False, f"{ENV_VAR} / {ENV_ALIAS}: {hints['error']}", f"unset {ENV_ALIAS}")
            else:
                add(
                    hints["requested"] is True,
                    f"{hints['source'] or f'{ENV_VAR}=unset'} (placement hints for managed tensors)",
                    f"{ENV_FIX} (or set gh200_optimizations.enable_uvm_hints in the config)",
                    applies="advice",  # a unified_memory cache or enable_uvm_hints turns them on per run
                )
    bad = env["unsupported_alloc_conf_keys"]
    if bad:
        value = env["variables"][ALLOC_CONF_VAR] or ""
        add(
            False,
            f"{ALLOC_CONF_VAR} has keys stock PyTorch rejects: {', '.join(bad)}",
            f"{_alloc_conf_fix(value, bad)} (remove them; {ENV_FIX} sets expandable_segments:True when the variable "
            "is unset)",
        )
    return out


def oversubscription_limit(info: DeviceMemoryInfo, free_bytes: int, host: dict) -> int | None:
    """The most managed memory the machine can back: host RAM available (plus free device memory
    where the OS does not count it already); None when /proc/meminfo could not be read."""
    hbm_in_host = not info.integrated and hbm_in_host_memory(info.total_bytes, host.get("memory_only_numa_bytes"))
    return backable_bytes(info, free_bytes, host.get("ram_available_bytes"), hbm_in_host)


def check_oversubscription(
    runtime: UnifiedMemoryRuntime, scale: float, force: bool, host: dict
) -> tuple[dict | None, list[str]]:
    """Whether the test may run: (a skipped/refused result, or None to go ahead; warnings to print first)."""
    info = runtime.device_info()
    if info is None or runtime.unavailable_reason() is not None:
        reason = runtime.unavailable_reason() or "no CUDA device"
        return {"status": "skipped", "reason": f"needs managed memory on a CUDA device: {reason}"}, []
    requested = int(scale * info.total_bytes)
    free, _ = runtime.mem_get_info()
    warnings = []
    if not info.unified:
        refusal = (
            f"refusing to oversubscribe managed memory on {info.name}: it is a {info.kind}, where managed memory "
            f"beyond the card's {format_gib(info.total_bytes)} thrashes over PCIe and can hang the GPU. "
            "Run this test on a GH200 or GB10, or pass --force to run it anyway at your own risk"
        )
        if not force:
            return {"status": "refused", "reason": refusal}, []
        warnings.append(f"WARNING: --force: {refusal}")
        if requested > free:
            warnings.append(
                f"WARNING: {format_gib(requested)} requested but only {format_gib(free)} of device memory is free"
            )
    limit = oversubscription_limit(info, free, host)
    if limit is not None and requested > limit:
        refusal = (
            f"refusing to allocate {format_gib(requested)} of managed memory: this machine can back about "
            f"{format_gib(limit)} (available host RAM{'' if info.integrated else ' + free device memory'}); "
            "lower --oversubscription-scale"
        )
        if not force:
            return {"status": "refused", "reason": refusal}, warnings
        warnings.append(f"WARNING: --force: {refusal}")
    return None, warnings


def run_oversubscription(runtime: UnifiedMemoryRuntime, scale: float, chunk_bytes: int = GIB) -> dict[str, Any]:
    """Allocate ``scale`` x device memory as managed memory in chunks, touch it, prefetch it to the
    GPU and back to the CPU (timing each direction), then free it, also on error or Ctrl-C."""
    info = runtime.device_info()
    assert info is not None, "check_oversubscription lets the test run only on a device"
    requested = int(scale * info.total_bytes)
    sizes = [chunk_bytes] * (requested // chunk_bytes) + ([requested % chunk_bytes] if requested % chunk_bytes else [])
    chunks: list[torch.Tensor] = []
    chunk = None
    try:
        start = time.perf_counter()
        for size in sizes:
            chunk = runtime.managed_empty((size,), torch.uint8)
            chunk.fill_(1)  # touch every page so the memory really exists
            chunks.append(chunk)
        runtime.synchronize()
        seconds = {"allocate_and_touch": time.perf_counter() - start}
        targets: tuple[tuple[str, Location], ...] = (("to_gpu", info.index), ("to_cpu", "cpu"))
        for direction, location in targets:
            start = time.perf_counter()
            for chunk in chunks:
                runtime.prefetch(chunk, location)
            runtime.synchronize()
            seconds[direction] = time.perf_counter() - start
        return {
            "status": "ok",
            "scale": scale,
            "requested_bytes": requested,
            "num_chunks": len(chunks),
            "seconds": seconds,
            "gb_per_s": {d: requested / max(seconds[d], 1e-9) / 1e9 for d in ("to_gpu", "to_cpu")},
        }
    finally:
        chunk = None  # drop every reference before collecting (a traceback keeps this frame alive)
        chunks.clear()
        gc.collect()
        if runtime.cuda_available() and torch.cuda.is_available():
            torch.cuda.empty_cache()
