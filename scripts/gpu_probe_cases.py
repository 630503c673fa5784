"""The cases of ``scripts/gpu_probe.py``, one per process: ``python scripts/gpu_probe_cases.py NAME``
runs case NAME here and prints its JSON line (figures, or ``error`` with the exception). Needs CUDA;
the module docstring of gpu_probe.py says what each case answers.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MiB, GiB = 1 << 20, 1 << 30


def _cuda_empty(nbytes: int):
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, device="cuda")


def case_device(rt) -> dict:
    free, total = rt.mem_get_info()
    info = rt.device_info()
    return {"device": info.as_dict() if info else None, "free_bytes": free, "total_bytes": total}


def case_caches(rt) -> dict:
    import torch

    from simpletuner.gh200 import uvm
    from simpletuner.hardware.runtime import set_runtime

    set_runtime(rt)
    uvm.set_uvm_hint_override(True, "gpu_probe")
    src = torch.arange(4096, dtype=torch.float32)  # 16 KiB
    try:
        cpu_side, gpu_side = uvm.to_unified(src, "cpu"), uvm.to_unified(src, "gpu")
    except RuntimeError as exc:  # the runtime's own refusal (expandable segments bypassing the pool): by design
        if "not managed" not in str(exc):
            raise
        return {"refused": str(exc)[:400], "ok": True}
    gpu = rt.current_device()
    rt.advise(cpu_side, "preferred_location", "cpu")
    rt.advise(cpu_side, "accessed_by", gpu)
    rt.prefetch(cpu_side, gpu)
    rt.prefetch(cpu_side, "cpu")
    batch = {"latents": uvm.stack_unified([cpu_side, gpu_side]), "prompt_embeds": uvm.stack_unified([gpu_side])}
    uvm.optimize_batch_for_gh200(batch, gpu)
    rt.synchronize()
    out = {
        "to_unified_managed": [rt.is_managed(cpu_side), rt.is_managed(gpu_side)],
        "stack_unified_managed": [rt.is_managed(batch["latents"]), rt.is_managed(batch["prompt_embeds"])],
        "values_equal": torch.equal(batch["latents"].cpu(), torch.stack([src, src])),
        "plain_tensor_managed": rt.is_managed(torch.ones(2, device="cuda")),
        "pool": rt.pool_stats(),
    }
    out["ok"] = all(out["to_unified_managed"] + out["stack_unified_managed"]) and out["values_equal"]
    out["ok"] = out["ok"] and not out["plain_tensor_managed"]
    return out


def case_errors(rt) -> dict:
    import torch

    plain, pinned = torch.ones(1024, device="cuda"), torch.ones(1024).pin_memory()
    out = {}
    for name, call in (
        ("advise_cuda_plain", lambda: rt.advise(plain, "preferred_location", "cpu")),
        ("advise_cpu_pinned", lambda: rt.advise(pinned, "preferred_location", "cpu")),
        ("prefetch_cuda_plain", lambda: rt.prefetch(plain, "cpu")),
    ):
        try:
            call()
            rt.synchronize()
            out[name] = "no error"
        except RuntimeError as exc:
            out[name] = str(exc)[:300]
    out["ok"] = all("cudaErrorInvalidValue" in message for message in out.values())
    return out


def _managed_on_other_thread(rt) -> bool | str:
    seen: dict = {}

    def work():
        try:
            seen["managed"] = rt.is_managed(_cuda_empty(MiB))
        except Exception as exc:  # reported, not lost with the thread
            seen["managed"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    return seen.get("managed", "thread did not run")


def _managed_grad(rt) -> bool:
    """Whether backward's weight gradient (made on the autograd engine's device thread) is managed."""
    import torch

    linear = torch.nn.Linear(256, 256, device="cuda")
    linear(torch.randn(8, 256, device="cuda")).sum().backward()
    return rt.is_managed(linear.weight.grad)


def case_routing(rt) -> dict:
    rt.route_all_allocations(GiB)
    out = {"main": rt.is_managed(_cuda_empty(MiB)), "thread": _managed_on_other_thread(rt)}
    out["backward_grad"] = _managed_grad(rt)
    out["ok"] = out["main"] is True and out["thread"] is True and out["backward_grad"] is True
    return {**out, "pool": rt.pool_stats()}


def case_end_routing(rt) -> dict:
    import torch

    rt.route_all_allocations(GiB)
    out: dict = {"routed_main": rt.is_managed(_cuda_empty(MiB))}
    if not hasattr(rt, "end_routing"):
        return {**out, "end_routing": "missing"}
    rt.end_routing()
    out.update(end_routing="called", after_main=rt.is_managed(_cuda_empty(MiB)))
    out.update(after_thread=_managed_on_other_thread(rt), after_backward_grad=_managed_grad(rt))
    out["managed_empty_still_managed"] = rt.is_managed(rt.managed_empty((256,), torch.float32))
    before = rt.pool_stats()
    torch.cuda.empty_cache()
    out.update(pool_before_empty_cache=before, pool_after_empty_cache=rt.pool_stats())
    after = (out["after_main"], out["after_thread"], out["after_backward_grad"])
    out["ok"] = out["routed_main"] is True and all(a is False for a in after) and out["managed_empty_still_managed"]
    return out


def case_bound(rt) -> dict:
    """Three blocks of b under a bound of 3b + 64 MiB, two freed (cached in the pool), then one of
    2b - 64 MiB: it fits only if the pool's cached blocks are freed first. b is above the chosen
    ``max_split_size_mb``, so that setting, where it is in force, can release them."""
    import torch

    from simpletuner.gh200.managed_memory import ALL_MODE_ALLOCATOR

    split = int(ALL_MODE_ALLOCATOR.get("max_split_size_mb") or 0)
    block = max(160, split + 64) * MiB
    limit, ask = 3 * block + 64 * MiB, 2 * block - 64 * MiB
    rt.route_all_allocations(limit)
    held = [_cuda_empty(block) for _ in range(3)]
    del held[:2]
    out: dict = {"limit_bytes": limit, "block_bytes": block, "ask_bytes": ask, "pool_before": rt.pool_stats()}
    try:
        big = _cuda_empty(ask)
        out["oom"] = False
        del big
    except Exception as exc:  # OutOfMemoryError expected; anything else is recorded as it is
        out.update(oom=isinstance(exc, torch.cuda.OutOfMemoryError), raised=f"{type(exc).__name__}: {exc}"[:300])
    out["pool_after_ask"] = rt.pool_stats()
    torch.cuda.empty_cache()
    out["pool_after_empty_cache"] = rt.pool_stats()
    out["memory_reserved_bytes"] = torch.cuda.memory_reserved()
    return out


def case_record_stream(rt) -> dict:
    import torch

    def churn(times: int) -> tuple[list[int], list[int]]:
        side, reserved, pool = torch.cuda.Stream(), [], []
        for _ in range(times):
            x = _cuda_empty(64 * MiB)
            x.record_stream(side)
            del x
            torch.cuda.synchronize()
            reserved.append(torch.cuda.memory_reserved() // MiB)
            pool.append((rt.pool_stats() or {}).get("reserved_bytes", 0) // MiB)
        return reserved, pool

    control, _ = churn(5)  # not routed: the default pool reclaims the block once the side stream is done
    rt.route_all_allocations(2 * GiB)
    routed, pool = churn(20)
    return {
        "control_reserved_mib": control,
        "routed_reserved_mib": routed,
        "routed_pool_reserved_mib": pool,
        "routed_grows": pool[-1] > pool[0] + 64,
        "pool": rt.pool_stats(),
    }


def case_evict(rt) -> dict:
    """Managed pages resident in HBM (a third of free HBM at most, 8 GiB at most), then a plain
    allocation of what is free plus half of them: done by evicting managed pages, or OOM."""
    import torch

    free0, total = rt.mem_get_info()
    size = min(8 * GiB, free0 // 3)
    managed = rt.managed_empty((size,), torch.uint8)
    rt.prefetch(managed, rt.current_device())
    managed.fill_(1)
    rt.synchronize()
    free1 = rt.mem_get_info()[0]
    ask = free1 + min(4 * GiB, size // 2)
    out: dict = {"managed_bytes": size, "free_before": free0, "free_with_managed": free1, "ask_bytes": ask}
    try:
        plain = _cuda_empty(ask)
        plain.fill_(2)
        rt.synchronize()
        out.update(evicted=True, free_with_both=rt.mem_get_info()[0])
        del plain
    except Exception as exc:  # OutOfMemoryError: the managed pages stayed; anything else is recorded as it is
        out.update(evicted=False, raised=f"{type(exc).__name__}: {exc}"[:300])
    torch.cuda.empty_cache()
    out["managed_values_intact"] = int(managed.sum(dtype=torch.int64)) == size
    return out


def case_frozen_weights(rt, blocks: int = 24, width: int = 4096, tokens: int = 1024, steps: int = 4) -> dict:
    """The same adapter stack (bf16, 2 x width^2 frozen per block: 1.5 GiB) in plain GPU memory and
    with its frozen weights placed in managed memory and prefetched one block ahead."""
    import copy

    import torch

    sys.path.insert(0, str(ROOT / "scripts"))
    from gpu_check_workers import adapter_stack

    from simpletuner.gh200.managed_weights import WeightPrefetcher, place_frozen_weights

    gen = torch.Generator().manual_seed(0)
    template = (torch.randn(width, width, generator=gen) / width**0.5).to(torch.bfloat16)
    managed = adapter_stack(blocks, width)
    with torch.no_grad():
        for block in managed.blocks:
            block.to_empty(device="cpu")
            block.frozen_in.weight.copy_(template)
            block.frozen_out.weight.copy_(template.T)
            block.down.weight.copy_(torch.randn(block.down.weight.shape, generator=gen) * width**-0.5)
            block.up.weight.copy_(torch.randn(block.up.weight.shape, generator=gen) * 0.01)
    plain = copy.deepcopy(managed).to("cuda")
    placed = place_frozen_weights(managed, rt)
    managed.to("cuda")  # the adapters; the managed tensors are CUDA tensors already
    calls = {"n": 0}
    prefetch = rt.prefetch

    def counting(tensor, location, stream=None):
        calls["n"] += 1
        return prefetch(tensor, location, stream)

    rt.prefetch = counting
    x = torch.randn(tokens, width, generator=gen).to("cuda", torch.bfloat16)

    def train(model, passes: list | None):
        losses, grads, times = [], [], []
        params = [p for p in model.parameters() if p.requires_grad]
        for _ in range(steps):
            torch.cuda.synchronize()
            start, before = time.perf_counter(), calls["n"]
            for p in params:
                p.grad = None
            loss = model(x).float().pow(2).mean()
            middle = calls["n"]
            loss.backward()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            if passes is not None:
                passes.append({"forward": middle - before, "backward": calls["n"] - middle})
            losses.append(loss.detach())
            grads.append([p.grad.detach().clone() for p in params])
            with torch.no_grad():
                for p in params:
                    p -= 1e-3 * p.grad
        return losses, grads, times

    plain_run = train(plain, None)
    passes: list = []
    with WeightPrefetcher(managed, 1, rt) as prefetcher:
        managed_run = train(managed, passes)
        units = len(prefetcher.units)
    diffs = [max(float((a - b).abs().max()) for a, b in zip(ga, gb)) for ga, gb in zip(plain_run[1], managed_run[1])]
    return {
        "placed_bytes": placed.placed_bytes,
        "units": units,
        "losses_equal": all(torch.equal(a, b) for a, b in zip(plain_run[0], managed_run[0])),
        "grads_equal": all(d == 0 for d in diffs),
        "max_grad_diff_per_step": diffs,
        "losses": [[float(a), float(b)] for a, b in zip(plain_run[0], managed_run[0])],
        "prefetch_calls_per_pass": passes,
        "step_s_plain": [round(t, 4) for t in plain_run[2]],
        "step_s_managed": [round(t, 4) for t in managed_run[2]],
        "median_step_s_after_first": {
            "plain": statistics.median(plain_run[2][1:]),
            "managed": statistics.median(managed_run[2][1:]),
        },
        "pool": rt.pool_stats(),
    }


RUNNERS = {
    "device": case_device,
    "caches": case_caches,
    "caches_expandable": case_caches,
    "errors": case_errors,
    "routing": case_routing,
    "end_routing": case_end_routing,
    "bound": case_bound,
    "bound_allocator": case_bound,
    "record_stream": case_record_stream,
    "evict": case_evict,
    "frozen_weights": case_frozen_weights,
}


def run_here(name: str) -> dict:
    """One case in this process: its figures, or ``error`` with the exception's last lines."""
    out: dict = {"case": name, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    try:
        from simpletuner.hardware.runtime import CudaBindingsRuntime

        out.update(RUNNERS[name](CudaBindingsRuntime()))
    except Exception as exc:  # the line says what broke; the other cases still run
        out.update(error=f"{type(exc).__name__}: {exc}"[:600], where=traceback.format_exc().splitlines()[-6:])
    return out


if __name__ == "__main__":
    print(json.dumps(run_here(sys.argv[1]), default=str), flush=True)
