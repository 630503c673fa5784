"""How many micro-batches make the next optimizer step: decided by the trainer, per window.

Accelerate's ``accumulate()`` divides by a fixed count with a modulo, so changing the count
mid-window mis-scales gradients. We decide the window length before each window starts and
normalise the loss by the samples actually in it.
"""

from __future__ import annotations

from typing import Protocol


class AccumulationPolicy(Protocol):
    """Pure function of progress: the window length for the window that starts now."""

    def window_for(self, micro_batches_seen: int) -> int: ...

    def state_dict(self) -> dict: ...


class FixedAccumulation:
    """``gradient_accumulation_steps`` micro-batches per optimizer step, always."""

    def __init__(self, steps: int):
        if steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be >= 1, got {steps}")
        self.steps = steps

    def window_for(self, micro_batches_seen: int) -> int:
        return self.steps

    def state_dict(self) -> dict:
        return {"kind": "fixed", "steps": self.steps}
