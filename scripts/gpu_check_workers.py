"""The subprocesses of ``scripts/gpu_check.py``: the machine probe and one managed-memory mode per
process (``all`` routes every allocation of its process to the managed pool, so each mode gets a
fresh one). ``python scripts/gpu_check_workers.py probe`` prints the machine as JSON;
``python scripts/gpu_check_workers.py MODE --result FILE [--steps N] [--hbm-fraction F]`` runs a mode
and writes its row to FILE (updated as it goes, so a killed worker leaves what it measured).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import MODES, default_fraction, size_mode  # noqa: E402 - the sizing rules live with the orchestrator


def probe() -> dict:
    """The machine: GPU name, memory, kind, driver / torch / CUDA / cuda-bindings versions, host RAM, date."""
    import torch

    from simpletuner.hardware.host import collect_host
    from simpletuner.hardware.runtime import get_runtime

    runtime = get_runtime()
    machine = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": collect_host(),
        "versions": runtime.versions(),
        "cuda": False,
    }
    info = runtime.device_info() if torch.cuda.is_available() else None
    if info is None:
        machine["reason"] = runtime.unavailable_reason() or "no CUDA device"
        return machine
    free, _ = runtime.mem_get_info()
    machine.update(cuda=True, device={**info.as_dict(), "free_bytes": free})
    machine["managed_memory"] = runtime.unavailable_reason() or "available"
    return machine


def adapter_stack(num_blocks: int, width: int, rank: int = 16):
    """On ``meta``: ``blocks``, an nn.ModuleList of blocks, each two frozen width x width Linears (bf16)
    and a trainable rank-``rank`` adapter beside them (the shape of a LoRA run over a transformer)."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.frozen_in, self.frozen_out = nn.Linear(width, width, bias=False), nn.Linear(width, width, bias=False)
            self.down, self.up = nn.Linear(width, rank, bias=False), nn.Linear(rank, width, bias=False)

        def forward(self, x):
            return x + 0.1 * torch.tanh(self.frozen_out(torch.tanh(self.frozen_in(x)))) + self.up(self.down(x))

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(num_blocks))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    with torch.device("meta"):
        model = Stack().to(torch.bfloat16)
    for block in model.blocks:
        block.frozen_in.weight.requires_grad_(False)
        block.frozen_out.weight.requires_grad_(False)
    return model


def mode_worker(
    mode: str,
    result: Path,
    steps: int,
    fraction: float | None,
    width: int = 8192,
    tokens: int = 1024,
    runtime=None,
    device: str = "cuda",
) -> int:
    """One managed-memory mode: build the stack, train ``steps`` steps (+1 warm-up), write ``result``
    after each stage (a kill keeps what was measured). ``runtime`` / ``device`` "cpu" / a small
    ``width`` run it on CPU against a fake runtime (tests)."""
    from types import SimpleNamespace

    import torch

    from simpletuner.configuration.sections import GH200Optimizations
    from simpletuner.gh200.managed_memory import check_managed_memory, start_managed_memory
    from simpletuner.hardware.host import collect_host
    from simpletuner.hardware.runtime import get_runtime

    row: dict = {"mode": mode, "outcome": "running"}

    def save(**values) -> None:
        row.update(values)
        tmp = result.with_name(f".{result.name}.tmp")
        tmp.write_text(json.dumps(row, default=str))
        tmp.replace(result)

    runtime, host, on_gpu = runtime or get_runtime(), collect_host(), device == "cuda"
    info = runtime.device_info() if torch.cuda.is_available() or not on_gpu else None
    if info is None:
        save(outcome="skipped", reason="no CUDA device")
        return 0
    free, total = runtime.mem_get_info()
    fraction = default_fraction(info) if fraction is None else fraction
    sizing = size_mode(mode, info, free, host["ram_available_bytes"], fraction)
    save(**asdict(sizing))
    if sizing.expect == "refused":
        save(outcome="refused")
        return 0
    if mode != "caches":
        opts = GH200Optimizations(
            managed_memory=mode,
            force_managed_memory=sizing.force,
            oversubscription_ratio=sizing.oversubscription_ratio,
        )
        config = SimpleNamespace(
            gh200_optimizations=opts, cuda_allocator=None, base_model_precision="no_change", low_vram=False,
            enable_compile=False,
        )  # fmt: skip
        try:
            plan = check_managed_memory(config, runtime, host["ram_available_bytes"], os.environ)
        except ValueError as exc:
            save(outcome="refused", reason=str(exc))
            return 0
        save(plan=plan.as_dict())
        try:
            start_managed_memory(plan, runtime)
        except RuntimeError as exc:  # routing failed in this PyTorch: the row says why, the check fails
            save(outcome="error", error=f"start_managed_memory: {exc}")
            return 0
    block_bytes = 2 * width * width * 2  # two bf16 width x width weights
    model = adapter_stack(max(1, sizing.model_bytes // block_bytes), width)
    save(model_bytes=len(model.blocks) * block_bytes, num_blocks=len(model.blocks), width=width, tokens=tokens)
    prefetcher, times, used = None, [], []
    try:
        start = time.perf_counter()
        _materialise(model, mode, runtime, width, device)
        if mode == "frozen_weights":
            from simpletuner.gh200.managed_weights import WeightPrefetcher

            prefetcher = WeightPrefetcher(model, 1, runtime)
        save(build_s=time.perf_counter() - start)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        x = torch.randn(tokens, width, device=device, dtype=torch.bfloat16)
        for step in range(steps + 1):  # step 0: warm-up (and the prefetcher's order recording)
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            model(x).float().pow(2).mean().backward()
            optimizer.step()
            runtime.synchronize()
            if step:
                times.append(time.perf_counter() - start)
            used.append(total - runtime.mem_get_info()[0])
            save(step_s=statistics.median(times) if times else None, steps_done=step, **_memory(runtime, used, on_gpu))
        save(outcome="ran")
    except torch.cuda.OutOfMemoryError as exc:
        save(outcome="oom", error=str(exc)[:400], **_memory(runtime, used, on_gpu))
    except Exception as exc:  # recorded, not hidden: the row says what broke, the check fails
        save(outcome="error", error=f"{type(exc).__name__}: {str(exc)[:400]}")
    finally:
        if prefetcher is not None:
            prefetcher.remove()
    return 0


def _materialise(model, mode: str, runtime, width: int, device: str) -> None:
    """Give the meta stack real memory, block by block: frozen weights copied from one random
    template (fast at any size); ``frozen_weights`` builds each block in CPU memory and places it."""
    import torch

    build_on = "cpu" if mode == "frozen_weights" else device
    template = (torch.randn(width, width, device=build_on) / width**0.5).to(torch.bfloat16)
    place = None
    if mode == "frozen_weights":
        from simpletuner.gh200.managed_weights import place_frozen_weights as place
    with torch.no_grad():
        for block in model.blocks:
            block.to_empty(device=build_on)
            block.frozen_in.weight.copy_(template)
            block.frozen_out.weight.copy_(template)
            torch.nn.init.normal_(block.down.weight, std=width**-0.5)
            torch.nn.init.zeros_(block.up.weight)
            if place is not None:
                place(block, runtime)
                block.to(device)  # the adapter; managed tensors are CUDA tensors already and stay put


def _memory(runtime, used: list[int], on_gpu: bool) -> dict:
    import torch

    stats = runtime.pool_stats() or {}
    return {
        "peak_hbm_bytes": max(used) if used else None,  # device memory in use, sampled after each step
        "peak_allocated_bytes": torch.cuda.max_memory_allocated() if on_gpu else None,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved() if on_gpu else None,
        "pool_bytes": stats.get("reserved_bytes"),
        "pool": stats,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="gpu_check.py's subprocesses (not meant to be run by hand)")
    parser.add_argument("worker", choices=("probe", *MODES))
    parser.add_argument("--result", help="where a mode writes its row (JSON)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hbm-fraction", type=float)
    args = parser.parse_args(argv)
    if args.worker == "probe":
        print(json.dumps(probe(), default=str))
        return 0
    return mode_worker(args.worker, Path(args.result), args.steps, args.hbm_fraction)


if __name__ == "__main__":
    sys.exit(main())
