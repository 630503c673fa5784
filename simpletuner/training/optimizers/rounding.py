"""Stochastic rounding of fp32 values into bf16 tensors, and the seeded generators it draws from.

Rounding to nearest loses an update smaller than half a bf16 ulp every time (a bf16 weight near 1.0
ignores any step below about 0.002). Stochastic rounding rounds up or down with probability by distance,
so the expected stored value equals the fp32 value and small updates add up over steps instead of
vanishing. The optimizers that keep bf16 tensors (Automagic, AdamW-bf16) share this module.

The random bits come from one ``torch.Generator`` per device, seeded by the run's ``seed`` (the same
on every rank, so data-parallel replicas round identically) and saved with the optimizer's state.
"""

from __future__ import annotations

from typing import Any

import torch


def stochastic_round_to_bf16(src: torch.Tensor, dst: torch.Tensor, generator: torch.Generator) -> None:
    """Round fp32 ``src`` into bf16 ``dst``, up or down with probability by distance.

    A bf16 value is the top 16 bits of an fp32 pattern: adding 16 uniform random low bits to the
    pattern and truncating carries into the kept bits with probability (dropped bits) / 2**16.
    """
    bits = src.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device, generator=generator)
    rounded = noise.add_(bits).bitwise_and_(-(1 << 16))  # keep the bf16 bits; exact cast below
    dst.copy_(rounded.view(torch.float32))


class RoundingGenerators:
    """One seeded ``torch.Generator`` per device, created on first use; saved and restored exactly.

    A restored state waits (``pending``) until its device's generator is first asked for, so a
    checkpoint loads on a machine before any tensor has reached the device.
    """

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)
        self._generators: dict[str, torch.Generator] = {}
        self._pending: dict[str, torch.Tensor] = {}

    def get(self, device: torch.device) -> torch.Generator:
        """The generator of ``device`` (seeded with ``seed``, or at its restored state)."""
        key = str(device)
        generator = self._generators.get(key)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(self.seed)
            pending = self._pending.pop(key, None)
            if pending is not None:
                generator.set_state(pending.cpu())
            self._generators[key] = generator
        return generator

    def state_dict(self) -> dict[str, Any]:
        """``{"seed": int, "states": {device: uint8 tensor}}`` (loadable with ``weights_only``)."""
        states = {key: state.clone() for key, state in self._pending.items()}
        states.update({key: generator.get_state() for key, generator in self._generators.items()})
        return {"seed": self.seed, "states": states}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.seed = int(saved["seed"])
        self._generators = {}
        self._pending = {key: state.clone().cpu() for key, state in saved["states"].items()}
