"""Pre-flight memory check: before the cache fill, the run's estimated host and device memory against what
the machine has, so a run that cannot fit stops with the figures and what to change instead of being
killed by the kernel (exit 137, no message) an hour into the cache fill.

Host: RAM caches and, on a CPU run, the models' weights against ``MemAvailable`` read after the scan.
Device (CUDA only): :func:`simpletuner.memory.estimator.estimate_memory` with the extras against the GPU's
free memory. Raises :class:`NotEnoughMemory` (a ValueError: exit 2) when over; warns above
:data:`WARN_FRACTION`. The machine is a :class:`~simpletuner.hardware.machine.HardwareInfo`, so a test can
check a small one. What is counted: documentation/MEMORY.md, "Pre-flight check".
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from simpletuner.hardware.machine import detect_hardware
from simpletuner.memory.advice import VALIDATION_MODELS, format_bytes
from simpletuner.memory.components import component_bytes, vae_bytes

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig
    from simpletuner.data_backend.metadata import Sample
    from simpletuner.models.spec import ModelSpec

logger = logging.getLogger(__name__)

#: Above this share of what the machine has, the run goes on with a warning.
WARN_FRACTION = 0.85
_IN_RAM = ("memory", "unified_memory")


class NotEnoughMemory(ValueError):
    """The run's estimate exceeds the machine's memory; the message has both and what to change."""


@dataclass
class PreflightEstimate:
    """Bytes by what holds them, per side; ``notes`` say what is not counted."""

    host: dict[str, int] = field(default_factory=dict)
    device: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    @property
    def device_total(self) -> int:
        return sum(self.device.values())


def _numel(shape) -> int:
    return math.prod(int(d) for d in shape)


def cache_bytes(
    config: TrainingConfig, spec: ModelSpec, samples: list[Sample], text_dtype: torch.dtype
) -> dict[str, int]:
    """RAM of the ``memory`` / ``unified_memory`` caches for ``samples`` (zero rows left out);
    raises NotImplementedError when the family does not describe its batch shapes."""
    latent, conds = spec.batch_shapes(1)
    per_latent_at_resolution = _numel(latent[1:]) * 4  # latents are stored in float32
    unique = {s.key: s for s in samples}.values()
    out = {}
    cache = config.cache_config
    if cache.vae_cache_type in _IN_RAM:
        area = float(config.resolution) ** 2
        out[f"latent cache ({cache.vae_cache_type}, {len(unique)} images)"] = int(
            sum(
                per_latent_at_resolution * s.bucket[0] * s.bucket[1] / area + spec.pixel_entry_bytes(*s.bucket)
                for s in unique
            )
        )
    if cache.text_cache_type in _IN_RAM:
        # an edit pair's caption is embedded with its source where the prompt sees it (Qwen-Image-Edit): one entry
        # per pair (``caching.keys.text_id``); every line of a multi-line caption file is encoded (captions.py)
        per_pair = spec.prompt_sees_source
        captions = {c if s.source is None or not per_pair else (c, s.key) for s in unique for c in s.captions}
        from simpletuner.models.text_encoder_lora import is_token_ids  # train_text_encoder: int64 token ids

        per_caption = sum(
            _numel(shape[1:]) * (torch.int64.itemsize if is_token_ids(name) else text_dtype.itemsize)
            for name, shape in conds.items()
        )
        out[f"text-embedding cache ({cache.text_cache_type}, {len(captions)} captions)"] = per_caption * len(captions)
    return out


def host_estimate(
    config: TrainingConfig, spec: ModelSpec, samples: list[Sample], text_dtype: torch.dtype, on_gpu: bool
) -> PreflightEstimate:
    """What the run holds in host RAM from the cache fill on (see the module docstring)."""
    est = PreflightEstimate()
    try:
        est.host.update(cache_bytes(config, spec, samples, text_dtype))
    except NotImplementedError:
        est.notes.append(f"the {config.model_family} family does not describe its latent shapes: caches not counted")
    root = spec.local_root
    if not on_gpu and root is not None:
        denoiser = "unet" if (root / "unet").is_dir() else "transformer"
        parts = {
            "text_encoder": text_dtype,
            "text_encoder_2": text_dtype,
            "text_encoder_3": text_dtype,
            denoiser: text_dtype if config.training_type == "lora" else torch.float32,
        }
        model = sum(
            b
            for name, dtype in parts.items()
            if (root / name).is_dir() and (b := component_bytes(root, name, dtype)) is not None
        )
        model += vae_bytes(spec.vae_location(), torch.float32) or 0  # the model's vae/ or a separate VAE
        if model:
            est.host["models (weights)"] = model
    if not on_gpu:
        est.notes.append(
            "a CPU run: the training step's activations, gradients and optimizer state come on top (not counted)"
        )
    return est


def device_estimate(config: "TrainingConfig", num_processes: int = 1) -> dict[str, int]:
    """The training step on one GPU: the estimator's total and the extras beside the denoiser.

    With ``managed_memory: frozen_weights`` the frozen weights and the validation models are not in
    GPU memory (they live in managed memory resident in CPU memory), and the prefetch window is: the
    same split ``simpletuner estimate`` shows (:mod:`simpletuner.memory.managed_plan`)."""
    from simpletuner.memory.autoconfig import EstimateCache  # the estimator: on CUDA runs only

    estimate = EstimateCache(config, num_processes)(config.train_batch_size, config.gradient_checkpointing)
    parts = {
        f"training step, micro-batch {config.train_batch_size} (estimate)": estimate.breakdown.total,
        **estimate.extras,
    }
    if config.gh200_optimizations.managed_memory != "frozen_weights":
        return parts
    from simpletuner.memory.managed_plan import frozen_layout  # builds the meta model: only in this mode

    frozen = estimate.breakdown.weights - estimate.breakdown.trainable_weights
    parts[f"training step, micro-batch {config.train_batch_size} (estimate)"] -= frozen
    parts.pop(VALIDATION_MODELS, None)
    parts["frozen-weight prefetch window"] = min(frozen_layout(config).window_bytes, frozen)
    return parts


def _advice(config: "TrainingConfig", side: str) -> str:
    if side == "host":
        tips = []
        cache = config.cache_config
        if cache.vae_cache_type in _IN_RAM or cache.text_cache_type in _IN_RAM:
            tips.append("`cache_config.vae_cache_type` / `text_cache_type: disk` (read from disk each batch)")
        tips += [
            "a smaller `resolution`",
            "fewer images (or `minimum_image_size`)",
            "`type: local` instead of `in_memory` datasets",
            "stop other programs using RAM",
        ]
    else:
        tips = [
            "`simpletuner estimate --config CFG --target-effective-batch N --apply` (a smaller micro-batch, "
            "more accumulation)",
            "`gradient_checkpointing: true`",
            "`mixed_precision: bf16`",
            "a smaller `resolution`",
            "stop other processes on the GPU",
            "on GH200 / GB10: `gh200_optimizations.managed_memory` frozen_weights or all (see `simpletuner estimate "
            "--config CFG` for what each mode needs)",
        ]
    return "; ".join(tips)


def check_run_memory(
    config: TrainingConfig,
    spec: ModelSpec,
    datasets: list,
    text_dtype: torch.dtype,
    hardware: Any = None,
    num_processes: int = 1,
) -> PreflightEstimate:
    """Compare the run's estimate with ``hardware`` (default: this machine, detected) before the
    cache fill. Raises :class:`NotEnoughMemory` naming the estimate, what the machine has and what
    to change; warns above :data:`WARN_FRACTION`; returns the estimate."""
    hw = hardware if hardware is not None else detect_hardware()
    samples = [s for ds in datasets for s in ds.samples]
    on_gpu = bool(hw.has_gpu)
    est = host_estimate(config, spec, samples, text_dtype, on_gpu)
    _compare(config, "host", "RAM", est.host, hw.host_ram_available_bytes, "available (MemAvailable)", est.notes)
    if on_gpu:  # after the host: the estimator costs seconds, and a host verdict needs none of it
        try:
            est.device = device_estimate(config, num_processes)
        except NotImplementedError as exc:  # a family without a memory estimate: nothing to compare
            logger.info("no GPU memory check before the cache fill: %s", exc)
            return est
        if config.gh200_optimizations.managed_memory == "all":  # the pool spills into CPU memory: its bound decides
            logger.info("managed_memory all: GPU memory is not checked before the cache fill; the pool's bound is")
            return est
        _compare(config, "device", "GPU memory", est.device, hw.gpu_free_bytes, "free", [])
    return est


def _compare(
    config: TrainingConfig,
    side: str,
    noun: str,
    parts: dict[str, int],
    have: int | None,
    have_word: str,
    notes: list[str],
) -> None:
    total = sum(parts.values())
    if not parts or have is None:
        return
    listed = ", ".join(f"{name} {format_bytes(n)}" for name, n in parts.items())
    if total > have:
        raise NotEnoughMemory(
            f"not enough {noun} for this run: it needs about {format_bytes(total)} ({listed}), and this machine has "
            f"{format_bytes(have)} {have_word}"
            + "".join(f"; {n}" for n in notes)
            + f". Stopped before the cache fill instead of being killed part-way. Change: {_advice(config, side)}"
        )
    if total > WARN_FRACTION * have:
        logger.warning(
            "%s: this run needs about %s of the %s %s (%s); little is left for the rest",
            noun,
            format_bytes(total),
            format_bytes(have),
            have_word,
            listed,
        )
