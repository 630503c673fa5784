"""Checking the memory estimate against reality: :func:`measure_cpu_step` runs one real training step
on CPU (tiny models only: it loads the weights) and measures it with the torch profiler, independently
of the estimator's fake-tensor trace; the tests and ``scripts/bench_estimate.py`` compare the two.

``simpletuner.models`` (diffusers: seconds to import) is imported inside the function, as in the estimator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from simpletuner.memory.estimator import batch_shapes
from simpletuner.precision import reset_accelerate_state, run_dtype

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig


@dataclass(frozen=True)
class MeasuredStep:
    """Memory of one real training step on CPU, from the profiler's allocation events.

    ``peak``: the most bytes allocated during loss + backward above what was allocated before
    it (parameters, the batch), as ``MemoryBreakdown.backward_peak``; ``activations``: the most
    of that ever live that is not a parameter gradient, as ``MemoryBreakdown.activations``.
    """

    peak: int
    activations: int


def measure_cpu_step(config: "TrainingConfig", batch_size: int | None = None, seed: int = 0) -> MeasuredStep:  # noqa: PLR0915
    """Run one real training step of ``config`` on CPU and measure it (loads the weights: tiny
    models only). Independent of the estimate: real tensors and weights, the trainer's own
    setup (``load_denoiser``, ``prepare_for_training``, ``Accelerator.prepare`` for mixed precision) and
    the CPU allocator's own accounting as the torch profiler records it, not MemTracker."""
    from accelerate import Accelerator
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    from simpletuner.models import get_model_spec

    batch_size = batch_size or config.train_batch_size
    spec = get_model_spec(config)
    weight_dtype = run_dtype(config)
    model = spec.load_denoiser(weight_dtype if config.training_type == "lora" else torch.float32)
    model = spec.prepare_denoiser(model, weight_dtype)
    generator = torch.Generator().manual_seed(seed)
    latent_shape, cond_shapes = batch_shapes(config, batch_size)
    latents = torch.randn(latent_shape.shape, generator=generator).to(latent_shape.dtype)
    conditioning = {k: torch.randn(s.shape, generator=generator).to(s.dtype) for k, s in cond_shapes.items()}
    spec.load_noise_scheduler()
    reset_accelerate_state()
    try:
        accelerator = Accelerator(cpu=True, mixed_precision=config.mixed_precision)
        prepared = accelerator.prepare(model)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            per_sample = spec.training_loss(prepared, latents, conditioning, generator)
            accelerator.backward(per_sample.sum() / batch_size)
    finally:
        reset_accelerate_state()

    events = []  # (time, ptr, signed bytes, allocator total after the event)
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.typed[0] == _EventType.Allocation:
            fields = event.typed[1]
            events.append((event.start_time_ns, fields.ptr, fields.alloc_size, fields.total_allocated))
        stack.extend(event.children)
    events.sort(key=lambda e: e[0])
    before = events[0][3] - events[0][2]
    # A gradient's buffer is the last allocation at its storage's address (never freed since).
    grad_ptrs = {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    grad_allocs = {ptr: i for i, (_, ptr, size, _) in enumerate(events) if size > 0 and ptr in grad_ptrs}
    grad_at = {i: events[i][2] for i in grad_allocs.values()}
    peak = activations = gradients = 0
    for i, (_, _, _, total) in enumerate(events):
        gradients += grad_at.get(i, 0)
        peak = max(peak, total - before)
        activations = max(activations, total - before - gradients)
    return MeasuredStep(peak=peak, activations=activations)
