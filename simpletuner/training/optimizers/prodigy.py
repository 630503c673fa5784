"""Prodigy (the ``prodigyopt`` package): Adam whose step size ``d`` is estimated as it trains; ``lr`` multiplies
``d``, so it is about 1.0.

Two additions: **one ``d`` per param group** (``split_groups``, on by default, as SimpleTuner's Prodigy):
prodigyopt refuses groups with different ``lr``, and Wan 2.2's experts have their own, so each group steps as
an optimizer of its own, its ``d`` state in the group (and the checkpoint), a group without gradients this
step left untouched; and **``prodigy_steps``**: after a group's first ``prodigy_steps`` steps its ``d`` is
frozen (the statistics stay allocated). Keys: documentation/CONFIG.md, ``optimizer_config``.
"""

from __future__ import annotations

import contextlib
import functools
import io
from typing import Any, Iterable

import torch


def _prodigy_base() -> type:
    try:
        from prodigyopt import Prodigy
    except ImportError as exc:
        raise ValueError(
            "optimizer 'prodigy' needs the prodigyopt package: pip install -e \".[prodigy]\" in the simpletuner "
            "checkout (or pip install prodigyopt), or choose another optimizer"
        ) from exc
    return Prodigy


@functools.cache
def prodigy_class() -> type:
    """The Prodigy optimizer class (prodigyopt's, split by group); ValueError naming the extra when
    prodigyopt is not installed."""
    base: Any = _prodigy_base()  # Any: a base class found at run time

    class SplitProdigy(base):
        """``prodigyopt.Prodigy`` with one ``d`` per param group and a freeze after ``prodigy_steps``.

        Args:
            params: parameters or param groups (a group may carry its own ``lr`` multiplier).
            prodigy_steps: steps of ``d`` adaptation per group; 0 adapts throughout.
            split_groups: one ``d`` per group (True) or one for all, prodigyopt's own behaviour, which
                needs every group's ``lr`` equal (False).
            **settings: prodigyopt's ``Prodigy`` arguments (``lr``, ``betas``, ``beta3``, ``eps``,
                ``weight_decay``, ``decouple``, ``use_bias_correction``, ``safeguard_warmup``, ``d0``,
                ``d_coef``, ``growth_rate``, ``slice_p``).
        """

        def __init__(
            self,
            params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
            prodigy_steps: int = 0,
            split_groups: bool = True,
            **settings: Any,
        ) -> None:
            if prodigy_steps < 0:
                raise ValueError(f"prodigy_steps={prodigy_steps!r} must be >= 0 (0: adapt d throughout)")
            with contextlib.redirect_stdout(io.StringIO()):  # prodigyopt prints a line about weight decay
                super().__init__(params, **settings)
            self.prodigy_steps = int(prodigy_steps)
            self.split_groups = bool(split_groups)
            rates = sorted({g["lr"] for g in self.param_groups})
            if not self.split_groups and len(rates) > 1:
                raise ValueError(
                    f"prodigy with split_groups false estimates one d for every param group, which needs one "
                    f"learning rate, but the groups have {rates}: set split_groups true in optimizer_config or give "
                    "the groups the same learning rate"
                )

        def step(self, closure=None):
            """One Prodigy step of each group on its own (or of all together without ``split_groups``)."""
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            groups = self.param_groups
            try:
                for part in [[g] for g in groups] if self.split_groups else [groups]:
                    self.param_groups = part
                    with self._frozen_if_due(part[0]):
                        super().step()
            finally:
                self.param_groups = groups
            return loss

        @contextlib.contextmanager
        def _frozen_if_due(self, group: dict[str, Any]):
            """Past ``prodigy_steps``: a step with ``d_coef`` 0 (the new estimate is 0, never above ``d``)
            and ``growth_rate`` 1 (``d`` cannot grow) keeps ``d`` exactly; the settings are restored after."""
            if not (self.prodigy_steps and group["k"] >= self.prodigy_steps):
                yield
                return
            saved = group["d_coef"], group["growth_rate"]
            group["d_coef"], group["growth_rate"] = 0.0, 1.0
            try:
                yield
            finally:
                group["d_coef"], group["growth_rate"] = saved

    return SplitProdigy
