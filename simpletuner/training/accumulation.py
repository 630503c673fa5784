"""How many micro-batches each optimizer step accumulates: the trainer's policy.

The window length is a pure function of micro-batches seen, decided *before* each window starts
(the loss is normalised by the samples actually in the window), so no window is mis-scaled and a
resumed run continues the same sequence. Two policies: ``gradient_accumulation_steps`` fixed
windows, or the GH200 ramp (:class:`~simpletuner.gh200.ramp.GH200GradientRamp`) when
``gh200_optimizations.enable_batch_size_rampup`` is set. The GH200 layer only provides the ramp;
which policy a run uses is decided here, in the training layer.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig

logger = logging.getLogger(__name__)


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


def build_accumulation(config: "TrainingConfig", num_processes: int) -> AccumulationPolicy:
    """The ramp when enabled, else ``gradient_accumulation_steps`` fixed windows."""
    opts = config.gh200_optimizations
    if not opts.enable_batch_size_rampup:
        return FixedAccumulation(config.gradient_accumulation_steps)
    if config.gradient_accumulation_steps != 1:
        logger.info(
            "gradient_accumulation_steps=%d is ignored: the GH200 ramp decides the accumulation",
            config.gradient_accumulation_steps,
        )
    initial, target = opts.initial_effective_batch_size, opts.target_effective_batch_size
    assert initial is not None and target is not None  # the config rules require both with the ramp
    from simpletuner.gh200.ramp import GH200GradientRamp  # only runs with the ramp import it

    return GH200GradientRamp(
        initial,
        target,
        opts.batch_rampup_steps,
        config.train_batch_size,
        num_processes,
    )


def count_steps(policy: AccumulationPolicy, total_micro_batches: int) -> int:
    """Optimizer steps needed to consume ``total_micro_batches`` with ``policy``'s windows."""
    seen = steps = 0
    while seen < total_micro_batches:
        seen += policy.window_for(seen)
        steps += 1
    return max(steps, 1)
