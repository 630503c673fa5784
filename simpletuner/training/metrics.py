"""Throughput figures: FLOPs per sample, the peak MFU is measured against, the per-window figures
(samples/s, step time, data-wait share, MFU, peak memory, the managed pool), and their log line
and progress-bar postfix.

The figures take the pieces of the machine they look at as arguments (``cuda`` module, hardware
description), so the CPU tests drive the CUDA branches with a fake.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import orjson
import torch
from torch.utils.flop_counter import FlopCounterMode

from simpletuner.hardware import gpus
from simpletuner.hardware.runtime import get_runtime

logger = logging.getLogger(__name__)


@dataclass
class FlopCount:
    """FLOPs counted by :func:`count_flops` (None until a count finished)."""

    total: int | None = None


@contextmanager
def count_flops(into: FlopCount) -> Iterator[FlopCount]:
    """Count the FLOPs (matmuls, convolutions, attention) of what runs inside into ``into.total``."""
    with FlopCounterMode(display=False) as mode:
        yield into
    into.total = int(mode.get_total_flops())


def peak_tflops_for_run(hardware: Any, mixed_precision: str, tf32: bool, override: float | None = None) -> float | None:
    """The dense peak MFU is measured against, said once in the log; None leaves MFU out.

    ``override`` (``--peak-tflops``) wins. Otherwise the GPU table's peak for the run's precision
    (``hardware`` is a :class:`simpletuner.hardware.machine.HardwareInfo`; None means no GPU):
    bf16 / fp16 tensor-core peaks, and for "no" the TF32 tensor-core peak when ``tf32``
    (``enable_tf32``) is on and the card has TF32, else the plain FP32 peak. A GPU without a
    table entry is said once: "peak unknown: pass --peak-tflops".
    """
    if override is not None:
        if not override > 0:
            raise ValueError(f"--peak-tflops must be a positive number of TFLOPS, got {override}")
        logger.info("MFU is measured against %g TFLOPS (--peak-tflops)", override)
        return float(override)
    if hardware is None or not hardware.has_gpu:
        return None
    peak = hardware.peak_tflops(mixed_precision, tf32=tf32)
    if mixed_precision != "no":
        kind = f"{mixed_precision} tensor-core"
    else:
        kind = "TF32 tensor-core" if tf32 and hardware.peak_tflops_tf32 is not None else "FP32"
    if peak is None:
        why = (
            f"{hardware.device_name} is not in the GPU table"
            if hardware.gpu_spec is None
            else f"the GPU table has no {kind} peak for {hardware.gpu_spec}"
        )
        logger.warning("MFU left out: peak unknown: pass --peak-tflops TFLOPS (%s)", why)
        return None
    logger.info(
        "MFU is measured against %g TFLOPS, the %s's dense %s peak (--peak-tflops overrides it)",
        peak,
        hardware.gpu_spec,
        kind,
    )
    return peak


@dataclass
class ThroughputWindow:
    """Figures of one logging window, measured without extra host syncs.

    The trainer calls :meth:`data_wait` around fetching micro-batches and :meth:`step_done`
    after each optimizer step; :meth:`report` (at the logging step, right after the one host
    sync of that window) turns them into figures and starts the next window.
    """

    peak_tflops: float | None = None
    flops_per_sample: float | None = None
    cuda: Any = None
    started: float = field(default_factory=time.perf_counter)
    waited: float = 0.0
    steps: int = 0
    samples: int = 0

    @contextmanager
    def data_wait(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.waited += time.perf_counter() - start

    def step_done(self, samples: int) -> None:
        self.steps += 1
        self.samples += samples

    def report(self) -> dict[str, float]:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        figures = {
            "samples_per_s": self.samples / elapsed,
            "step_time_s": elapsed / max(self.steps, 1),
            "data_wait_share": self.waited / elapsed,
        }
        if self.flops_per_sample:
            flops = self.flops_per_sample * self.samples
            figures["tflops"] = gpus.achieved_tflops(flops, elapsed) or 0.0  # elapsed > 0: never None
            utilisation = gpus.mfu(flops, elapsed, self.peak_tflops)
            if utilisation is not None:
                figures["mfu"] = utilisation
        if self.cuda is not None and self.cuda.is_available():
            figures["peak_memory_gib"] = self.cuda.max_memory_allocated() / 2**30
            self.cuda.reset_peak_memory_stats()
        self.started, self.waited, self.steps, self.samples = time.perf_counter(), 0.0, 0, 0
        return figures


def uvm_memory_figures(pool_stats: Mapping[str, int] | None) -> dict[str, float]:
    """The managed pool's reserved memory (GiB) for the log, when the pool is in use; with a bound
    (managed_memory ``all``) also its peak and the bound."""
    if not pool_stats:
        return {}
    figures = {"managed_pool_gib": pool_stats.get("reserved_bytes", 0) / 2**30}
    if pool_stats.get("limit_bytes"):
        figures["managed_pool_peak_gib"] = pool_stats.get("peak_bytes", 0) / 2**30
        figures["managed_pool_limit_gib"] = pool_stats["limit_bytes"] / 2**30
    return figures


def managed_pool_stats() -> dict | None:
    """The unified-memory pool's figures once it holds memory (caches in `unified_memory`)."""
    return get_runtime().pool_stats()


def samples_per_s(rate: float) -> str:
    """Two significant figures (``12``, ``2.3``, ``0.042``): a step of more than 20 s on a busy CPU
    host is not "0.0 samples/s"; three or more digits before the point are shown whole (``1234``)."""
    if rate >= 99.5 or rate <= 0 or not math.isfinite(rate):
        return f"{rate:.0f}"
    return f"{rate:#.2g}".rstrip(".")


def progress_postfix(logs: dict) -> dict[str, str]:
    """The progress bar's figures: loss, lr, samples/s, step time, and MFU / eval loss when known."""
    shown = {
        "loss": f"{logs['loss']:.4f}",
        "lr": f"{logs['lr']:.2e}",
        "samples_s": samples_per_s(logs["samples_per_s"]),
        "step_s": f"{logs['step_time_s']:.3f}",
        "wait": f"{logs['data_wait_share']:.0%}",
    }
    if "mfu" in logs:
        shown["mfu"] = f"{logs['mfu']:.1%}"
    if "eval_loss" in logs:
        shown["eval"] = f"{logs['eval_loss']:.4f}"
    return shown


def log_line(logs: dict) -> str:
    """The log line of a logging window's figures (those present).

    TFLOPS are shown for GPU runs only (the window has MFU or CUDA peak memory): on CPU they read
    "0.00 TFLOPS" and mean nothing; ``metrics.jsonl`` keeps the figure either way.
    """
    parts = [
        f"loss {logs['loss']:.4f}",
        f"lr {logs['lr']:.2e}",
        f"{samples_per_s(logs['samples_per_s'])} samples/s",
        f"step {logs['step_time_s']:.3f}s",
        f"data wait {logs['data_wait_share']:.0%}",
    ]
    if "tflops" in logs and ("mfu" in logs or "peak_memory_gib" in logs):
        parts.append(f"{logs['tflops']:.2f} TFLOPS")
    if "mfu" in logs:
        # and the metrics.jsonl key in lower case: `grep mfu training.log` (the seeds' habit) finds the line
        parts.append(f"MFU {logs['mfu']:.1%} (mfu={logs['mfu']:.4f})")
    if "peak_memory_gib" in logs:
        parts.append(f"peak {logs['peak_memory_gib']:.2f} GiB")
    if "managed_pool_gib" in logs:
        parts.append(f"managed pool {logs['managed_pool_gib']:.2f} GiB")
    if "eval_loss" in logs:
        parts.append(f"eval_loss {logs['eval_loss']:.4f}")
    return ", ".join(parts)


def flops_per_sample(loss_fn, model: torch.nn.Module, num_samples: int, accelerator) -> float:
    """Forward + backward FLOPs per sample of ``loss_fn(model, generator)`` (a per-sample loss over
    one micro-batch of ``num_samples``), counted on a throwaway pass with the RNG forked and the
    gradients dropped afterwards, so the run's own steps are bit-identical with or without it."""
    count = FlopCount()
    device = accelerator.device
    devices = [device.index or 0] if device.type == "cuda" else []
    model.to(device)  # where prepare() would put it
    with torch.random.fork_rng(devices=devices), accelerator.autocast(), count_flops(count):
        loss_fn(model, torch.Generator().manual_seed(0)).mean().backward()
    model.zero_grad(set_to_none=True)
    assert count.total is not None  # set as count_flops' block ends
    return count.total / num_samples


#: The file in ``cache_config.cache_dir`` that keeps counted FLOPs per sample by :func:`flops_key`.
FLOPS_FILE = "flops_per_sample.json"
#: Config keys that cannot change the counted pass (one forward + backward of the prepared denoiser on one
#: micro-batch, whose shapes are keyed apart): bookkeeping, optimizer, schedule, data and validation settings.
_NOT_IN_THE_PASS = (
    "adam_",
    "cache_config",
    "caption_dropout_probability",
    "checkpoint",
    "data_backend_config",
    "dataloader_",
    "datasets",
    "ema_",
    "eval_",
    "grad_clip_method",
    "gradient_accumulation_steps",
    "high_noise_l",
    "learning_rate",
    "logging_steps",
    "low_noise_l",
    "lr_",
    "max_",
    "min_lr",
    "nonfinite_policy",
    "num_",
    "optimizer",
    "output_dir",
    "prodigy_steps",
    "report_to",
    "resume_from_checkpoint",
    "seed",
    "tracker_project_name",
    "use_ema",
    "validation_",
    "weight_decay",
)


def flops_key(spec_name: str, model: torch.nn.Module, shapes: Mapping[str, Any], config: Mapping[str, Any]) -> str:
    """What FLOPs per sample depend on, hashed: the ModelSpec, the prepared denoiser's parameters (names, shapes,
    which train: the architecture and the adapter), the micro-batch's tensor shapes, the config keys that may
    touch the pass, and the library versions that run it."""
    import diffusers

    params = [(name, tuple(p.shape), p.requires_grad) for name, p in model.named_parameters()]
    settings = {k: v for k, v in config.items() if not k.startswith(_NOT_IN_THE_PASS)}
    material = [spec_name, params, dict(shapes), settings, torch.__version__, diffusers.__version__]
    return hashlib.sha256(orjson.dumps(material, option=orjson.OPT_SORT_KEYS, default=str)).hexdigest()[:32]


def remembered_flops(folder: Path, key: str) -> float | None:
    """FLOPs per sample counted before for ``key`` in ``folder`` (None: not counted, or unreadable)."""
    try:
        value = orjson.loads((folder / FLOPS_FILE).read_bytes()).get(key)
    except (OSError, orjson.JSONDecodeError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def remember_flops(folder: Path, key: str, per_sample: float) -> None:
    """Keep ``per_sample`` for ``key`` in ``folder`` (written whole, by replace); a folder that cannot be
    written (a read-only cache) only means counting again next time."""
    path = folder / FLOPS_FILE
    try:
        known = orjson.loads(path.read_bytes()) if path.is_file() else {}
    except (OSError, orjson.JSONDecodeError):
        known = {}
    known = {**(known if isinstance(known, dict) else {}), key: per_sample}
    tmp = path.with_name(f".{FLOPS_FILE}.{os.getpid()}.tmp")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(orjson.dumps(known))
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        logger.debug("FLOPs per sample not kept in %s (%s): they are counted again next time", path, exc)
