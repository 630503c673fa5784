"""GH200GradientRamp: grow the effective batch from a small start to a large target.

The ramp changes how many micro-batches each optimizer step accumulates, never the micro-batch, so
memory stays flat. The window length is a pure function of micro-batches seen, decided before each
window starts, so no window is mis-scaled and a resumed run continues the same sequence. A pure policy
that imports nothing from simpletuner: :mod:`simpletuner.training.accumulation` uses it.
See documentation/GH200_OPTIMIZATION.md, "The accumulation ramp".
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class GH200GradientRamp:
    """Accumulation windows growing linearly from ``initial`` to ``target`` effective batch.

    Args:
        initial_effective_batch_size: samples per optimizer step (all processes) at the start.
        target_effective_batch_size: samples per optimizer step once the ramp is done; a
            multiple of ``micro_batch_size * num_processes``.
        rampup_micro_batches: micro-batches over which the ramp runs (0: target at once).
        micro_batch_size: ``train_batch_size`` (per process).
        num_processes: processes training together.
    """

    def __init__(
        self,
        initial_effective_batch_size: int,
        target_effective_batch_size: int,
        rampup_micro_batches: int,
        micro_batch_size: int,
        num_processes: int = 1,
    ):
        per_micro = micro_batch_size * num_processes
        where = (
            f"train_batch_size {micro_batch_size} x {num_processes} process(es) = {per_micro} samples per micro-batch"
        )
        if initial_effective_batch_size > target_effective_batch_size:
            raise ValueError(
                f"gh200_optimizations.initial_effective_batch_size {initial_effective_batch_size} is larger than "
                f"target_effective_batch_size {target_effective_batch_size}: the ramp only grows"
            )
        if target_effective_batch_size % per_micro:
            raise ValueError(
                f"gh200_optimizations.target_effective_batch_size {target_effective_batch_size} is not a multiple of "
                f"{where}; use a multiple such as "
                f"{max(per_micro, target_effective_batch_size // per_micro * per_micro)}"
            )
        if initial_effective_batch_size < per_micro:
            raise ValueError(
                f"gh200_optimizations.initial_effective_batch_size {initial_effective_batch_size} is smaller than one "
                f"micro-batch ({where}); raise it to at least {per_micro}"
            )
        if rampup_micro_batches < 0:
            raise ValueError(f"gh200_optimizations.batch_rampup_steps must be >= 0, got {rampup_micro_batches}")
        self.initial = initial_effective_batch_size
        self.target = target_effective_batch_size
        self.rampup_micro_batches = rampup_micro_batches
        self.per_micro = per_micro
        self.min_window = initial_effective_batch_size // per_micro
        self.max_window = target_effective_batch_size // per_micro
        self._last_window: int | None = None
        logger.info(
            "GH200 gradient accumulation ramp enabled: effective batch %d -> %d over %d micro-batches "
            "(accumulation %d -> %d)",
            self.initial,
            self.target,
            self.rampup_micro_batches,
            self.min_window,
            self.max_window,
        )

    def window_for(self, micro_batches_seen: int) -> int:
        """Micro-batches in the window that starts after ``micro_batches_seen`` micro-batches."""
        if micro_batches_seen >= self.rampup_micro_batches:
            window = self.max_window
        else:
            progress = micro_batches_seen / self.rampup_micro_batches
            desired = self.initial + (self.target - self.initial) * progress
            window = min(max(int(desired // self.per_micro), self.min_window), self.max_window)
        if window != self._last_window:
            logger.debug("GH200 ramp adjusted gradient_accumulation_steps -> %d", window)
            self._last_window = window
        return window

    def state_dict(self) -> dict:
        """What defines the sequence (the position is the trainer's micro-batch count)."""
        return {
            "kind": "gh200_ramp",
            "initial_effective_batch_size": self.initial,
            "target_effective_batch_size": self.target,
            "rampup_micro_batches": self.rampup_micro_batches,
            "samples_per_micro_batch": self.per_micro,
        }
