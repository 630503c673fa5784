"""What the flow-matching families (sd3, flux, wan) share: the Euler flow scheduler, the
``flow_matching`` target, and the static resolution shift (``flow_shift``, else the scheduler's)."""

from __future__ import annotations

from simpletuner.models.sd import StableDiffusionSpec


class FlowMatchingSpec(StableDiffusionSpec):
    """Base of the flow-matching families; the sd family's loading and encoding otherwise."""

    def load_noise_scheduler(self):
        from diffusers import FlowMatchEulerDiscreteScheduler

        if self._scheduler is None:
            self._scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(
                self.model_path, subfolder="scheduler", **self._kwargs()
            )
        return self._scheduler

    @property
    def prediction_type(self) -> str:
        return "flow_matching"

    @property
    def shift(self) -> float:
        """The resolution shift applied to sampled sigmas: ``flow_shift``, else the scheduler's ``shift``."""
        if self.config.flow_shift is not None:
            return float(self.config.flow_shift)
        return float(self.load_noise_scheduler().config.get("shift", 1.0))
