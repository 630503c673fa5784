"""Automagic: Adafactor-style steps with a learning rate per element that adapts itself.

Each element's lr rises by ``lr_bump`` while its normalised update keeps its sign and falls when it
flips, within ``[min_lr, max_lr]``; the update is ``g / sqrt(v_hat)`` with Adafactor's factored second
moments (>= 2-D parameters) or Adam's (1-D), RMS-clipped, with decoupled weight decay. State: ~3 bytes
per element of a >= 2-D parameter (an int16 lr index on a uniform grid, an int8 sign), 7 for 1-D ones.
bf16 parameters are rounded back stochastically. The exact rule and why the state is stored this way:
documentation/CONFIG.md, "optimizer: automagic".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import torch

from simpletuner.training.optimizers.rounding import RoundingGenerators, stochastic_round_to_bf16

#: Grid points for the per-element learning rate (int16 range).
_GRID_POINTS = 1 << 16
_INDEX_MIN = -(1 << 15)
_INDEX_MAX = (1 << 15) - 1
#: Key of the stochastic-rounding generators in ``state_dict()``.
_RNG_KEY = "automagic_rng"


def _group_label(group: Mapping[str, Any], index: int) -> str:
    name = group.get("name")
    return f"param group {name!r}" if name is not None else f"param group {index}"


def _validate_group(group: Mapping[str, Any], label: str) -> None:
    """Raise ValueError naming ``label`` and the fix for any unusable option."""
    lr, min_lr, max_lr, lr_bump = group["lr"], group["min_lr"], group["max_lr"], group["lr_bump"]
    prefix = f"automagic {label}:"
    if not (isinstance(min_lr, (int, float)) and math.isfinite(min_lr) and min_lr > 0):
        raise ValueError(f"{prefix} min_lr={min_lr!r} must be a finite number > 0")
    if not (isinstance(max_lr, (int, float)) and math.isfinite(max_lr)):
        raise ValueError(f"{prefix} max_lr={max_lr!r} must be a finite number")
    if min_lr > max_lr:
        raise ValueError(f"{prefix} min_lr={min_lr!r} is greater than max_lr={max_lr!r}; set min_lr <= max_lr")
    if not (isinstance(lr, (int, float)) and min_lr <= lr <= max_lr):
        raise ValueError(
            f"{prefix} initial lr={lr!r} is outside [min_lr, max_lr] = [{min_lr!r}, {max_lr!r}]; "
            "set the lr inside the bounds or widen them"
        )
    if not (isinstance(lr_bump, (int, float)) and math.isfinite(lr_bump) and lr_bump > 0):
        raise ValueError(f"{prefix} lr_bump={lr_bump!r} must be a finite number > 0")
    span = max_lr - min_lr
    if span > 0 and math.floor((_GRID_POINTS - 1) * lr_bump / span) < 1:
        raise ValueError(
            f"{prefix} lr_bump={lr_bump!r} is below the per-element lr resolution "
            f"(max_lr - min_lr) / 65535 = {span / (_GRID_POINTS - 1):.3g}; raise lr_bump or narrow [min_lr, max_lr]"
        )
    if not 0.0 <= group["beta2"] < 1.0:
        raise ValueError(f"{prefix} beta2={group['beta2']!r} must be in [0, 1)")
    if not group["eps"] > 0:
        raise ValueError(f"{prefix} eps={group['eps']!r} must be > 0")
    if not group["clip_threshold"] > 0:
        raise ValueError(f"{prefix} clip_threshold={group['clip_threshold']!r} must be > 0")
    if not group["weight_decay"] >= 0:
        raise ValueError(f"{prefix} weight_decay={group['weight_decay']!r} must be >= 0")


class _Grid(NamedTuple):
    """A group's lr grid: ``lr = min(min_lr + (index - _INDEX_MIN) * spacing, max_lr)``."""

    min_lr: float
    max_lr: float
    spacing: float
    bump_steps: int  # lr_bump in index steps
    top_index: int  # the index of max_lr


def _grid(group: Mapping[str, Any]) -> _Grid:
    min_lr, max_lr, lr_bump = group["min_lr"], group["max_lr"], group["lr_bump"]
    span = max_lr - min_lr
    if span == 0:
        return _Grid(min_lr, max_lr, 0.0, 0, _INDEX_MIN)
    if lr_bump >= span:  # every bump saturates at a bound
        return _Grid(min_lr, max_lr, span / (_GRID_POINTS - 1), _GRID_POINTS, _INDEX_MAX)
    steps_per_bump = math.floor((_GRID_POINTS - 1) * lr_bump / span)
    spacing = lr_bump / steps_per_bump
    num_steps = min(math.ceil(span / spacing - 1e-6), _GRID_POINTS - 1)
    return _Grid(min_lr, max_lr, spacing, steps_per_bump, _INDEX_MIN + num_steps)


class Automagic(torch.optim.Optimizer):
    """Adafactor-normalised steps with a self-adjusting per-element learning rate (see the module docstring).

    ``params`` may be groups carrying ``name`` (in error messages) and any option; ``lr`` is the initial
    per-element lr within ``0 < min_lr <= max_lr``; ``lr_bump`` is added while an element's update keeps its
    sign, subtracted when it flips; ``eps`` is Adafactor's eps1 (no eps2: the step is the per-element lr);
    ``clip_threshold`` bounds the update's RMS; ``weight_decay`` is decoupled; ``stochastic_rounding`` (seeded
    by ``seed``) for bf16 parameters. An LR scheduler scales each lr by ``group["lr"] / group["initial_lr"]``,
    after the bounds. ``load_state_dict`` restores the saved groups' options: saved lr indices only mean
    something on the saved bounds' grid.
    """

    def __init__(  # noqa: PLR0913
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-6,
        min_lr: float = 1e-7,
        max_lr: float = 1e-3,
        lr_bump: float = 1e-6,
        beta2: float = 0.999,
        eps: float = 1e-30,
        clip_threshold: float = 1.0,
        weight_decay: float = 0.0,
        stochastic_rounding: bool = True,
        seed: int = 0,
    ) -> None:
        defaults = dict(
            lr=lr,
            min_lr=min_lr,
            max_lr=max_lr,
            lr_bump=lr_bump,
            beta2=beta2,
            eps=eps,
            clip_threshold=clip_threshold,
            weight_decay=weight_decay,
            stochastic_rounding=stochastic_rounding,
        )
        self._rounding = RoundingGenerators(seed)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Validate the group's bounds (ValueError naming the group), then add it."""
        merged = {**self.defaults, **param_group}
        _validate_group(merged, _group_label(merged, len(self.param_groups)))
        param_group.setdefault("initial_lr", merged["lr"])
        super().add_param_group(param_group)

    # -- the step ---------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr_scale = group["lr"] / group["initial_lr"]
            for p in group["params"]:
                if p.grad is None or p.numel() == 0:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("Automagic does not support sparse gradients")
                self._update(p, p.grad, group, lr_scale)
        return loss

    def _init_state(self, p: torch.Tensor, group: Mapping[str, Any]) -> dict[str, Any]:
        # The memory estimator counts these bytes (simpletuner.memory.estimator.automagic_state_bytes).
        state = self.state[p]
        grid = _grid(group)
        offset = 0 if grid.spacing == 0 else round((group["initial_lr"] - grid.min_lr) / grid.spacing)
        index = min(_INDEX_MIN + offset, grid.top_index)
        state["step"] = 0
        state["lr_index"] = torch.full_like(p, index, dtype=torch.int16, memory_format=torch.contiguous_format)
        state["sign"] = torch.zeros_like(p, dtype=torch.int8, memory_format=torch.contiguous_format)
        if p.dim() >= 2:
            state["row_var"] = torch.zeros(p.shape[0], dtype=torch.float32, device=p.device)
            state["col_var"] = torch.zeros(p.numel() // p.shape[0], dtype=torch.float32, device=p.device)
        else:
            state["var"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        return state

    def _update(self, p: torch.Tensor, grad: torch.Tensor, group: Mapping[str, Any], lr_scale: float) -> None:
        state = self.state[p] or self._init_state(p, group)
        state["step"] += 1
        beta2 = group["beta2"]
        bias_correction = 1.0 - beta2 ** state["step"]

        grad = grad.detach().to(torch.float32)
        sq = grad.square().add_(group["eps"])
        if "row_var" in state:
            row_var, col_var = state["row_var"], state["col_var"]
            sq = sq.reshape(p.shape[0], -1)
            row_var.mul_(beta2).add_(sq.mean(dim=1), alpha=1.0 - beta2)
            col_var.mul_(beta2).add_(sq.mean(dim=0), alpha=1.0 - beta2)
            row_factor = (row_var / row_var.mean()).rsqrt_()
            col_factor = (col_var / bias_correction).rsqrt_()
            update = grad.reshape(p.shape[0], -1) * row_factor[:, None] * col_factor[None, :]
            update = update.reshape(p.shape)
        else:
            var = state["var"]
            var.mul_(beta2).add_(sq, alpha=1.0 - beta2)
            update = grad / (var / bias_correction).sqrt_()
        rms = update.square().mean().sqrt()
        update.div_((rms / group["clip_threshold"]).clamp_(min=1.0))

        # Per-element lr: +bump where the sign held, -bump where it flipped, then clamp.
        grid = _grid(group)
        sign = torch.sign(update).to(torch.int8)
        agreement = (sign * state["sign"]).to(torch.int32)
        lr_index = state["lr_index"]
        lr_index.copy_(agreement.mul_(grid.bump_steps).add_(lr_index).clamp_(_INDEX_MIN, grid.top_index))
        state["sign"].copy_(sign)
        lr = self._lr_from_index(lr_index, grid)
        if lr_scale != 1.0:
            lr.mul_(lr_scale)

        param = p.detach()
        work = param if param.dtype == torch.float32 else param.to(torch.float32)
        if group["weight_decay"] != 0:
            work.addcmul_(work, lr, value=-group["weight_decay"])
        work.addcmul_(lr, update, value=-1.0)
        if work is param:
            return
        if param.dtype == torch.bfloat16 and group["stochastic_rounding"]:
            stochastic_round_to_bf16(work, param, self._rounding.get(param.device))
        else:
            param.copy_(work)

    @staticmethod
    def _lr_from_index(lr_index: torch.Tensor, grid: _Grid) -> torch.Tensor:
        lr = (lr_index.to(torch.float32) - _INDEX_MIN).mul_(grid.spacing).add_(grid.min_lr)
        return lr.clamp_(max=grid.max_lr)

    def lr_of(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 per-element lr of ``p`` (before any schedule factor); the initial lr before its first step."""
        for group in self.param_groups:
            if any(p is q for q in group["params"]):
                state = self.state.get(p)
                if not state:
                    return torch.full_like(p, group["initial_lr"], dtype=torch.float32)
                return self._lr_from_index(state["lr_index"], _grid(group))
        raise ValueError("the tensor is not a parameter of this optimizer")

    def mean_lr(self) -> list[float]:
        """Mean per-element lr of each group, for logging (one host sync per group)."""
        means = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.numel()]
            total = sum(self.lr_of(p).double().sum() for p in params)
            means.append(float(total) / max(1, sum(p.numel() for p in params)))
        return means

    # -- checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict plus the stochastic-rounding generators (weights_only-loadable)."""
        state_dict = super().state_dict()
        state_dict[_RNG_KEY] = self._rounding.state_dict()
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore everything exactly: torch's loader casts float state to the parameter
        dtype (fp32 moments of a bf16 parameter would come back bf16), so the per-parameter
        state is re-copied from the saved tensors afterwards, keeping their dtypes."""
        state_dict = dict(state_dict)
        rng = state_dict.pop(_RNG_KEY, None)
        super().load_state_dict(state_dict)
        saved_ids = (i for g in state_dict["param_groups"] for i in g["params"])
        params = (p for g in self.param_groups for p in g["params"])
        for saved_id, p in zip(saved_ids, params, strict=True):
            saved = state_dict["state"].get(saved_id)
            if saved is not None:
                self.state[p] = {
                    k: v.to(device=p.device, copy=True) if isinstance(v, torch.Tensor) else v for k, v in saved.items()
                }
        if rng is not None:
            self._rounding.load_state_dict(rng)


def automagic_param_groups(
    named_groups: Mapping[str, Iterable[torch.nn.Parameter]],
    bounds: Mapping[str, Any],
) -> list[dict[str, Any]]:
    """Param groups with per-stage Automagic bounds.

    ``named_groups`` maps a stage (``"high_noise"``, ``"low_noise"``) to its parameters.
    For each of ``lr``, ``lr_bump``, ``min_lr``, ``max_lr`` a group takes
    ``bounds[f"{stage}_{key}"]``, falling back to ``bounds[key]`` when that is missing or
    None; a key absent from both leaves the optimizer's default. Other keys in ``bounds``
    (a whole config dict) are ignored. The groups are validated when the optimizer is built.
    """
    groups = []
    for stage, params in named_groups.items():
        group: dict[str, Any] = {"name": stage, "params": list(params)}
        for key in ("lr", "lr_bump", "min_lr", "max_lr"):
            value = bounds.get(f"{stage}_{key}")
            if value is None:
                value = bounds.get(key)
            if value is not None:
                group[key] = value
        groups.append(group)
    return groups
