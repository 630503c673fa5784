"""AdamW for bf16 weights: the update is computed in fp32 and rounded back stochastically.

A bf16 parameter keeps its weights and both moments in bf16 (4 bytes of state per weight, not 8). Rounding
to nearest would drop every update below half a bf16 ulp (near 1.0, any step below about 0.002: most steps
at usual learning rates), so torch's AdamW step runs in fp32 and the results are rounded back stochastically
(:mod:`simpletuner.training.optimizers.rounding`): each stored value's expectation is the fp32 value. Any
other dtype (this trainer's fp32 adapters and full fine-tunes) is updated with torch's own operations in
torch's order: bit for bit ``torch.optim.AdamW`` with ``amsgrad=False``.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from simpletuner.training.optimizers.rounding import RoundingGenerators, stochastic_round_to_bf16

#: Key of the stochastic-rounding generators in ``state_dict()``.
_RNG_KEY = "adamw_bf16_rng"


class AdamWBF16(torch.optim.Optimizer):
    """AdamW that keeps bf16 weights and moments, rounding each update stochastically.

    Args:
        params: parameters or param groups (a group may carry its own ``lr``).
        lr: learning rate.
        betas: decay of the first and second moment averages.
        eps: added to the bias-corrected ``sqrt(v)``.
        weight_decay: decoupled: ``p -= lr * weight_decay * p`` before the Adam step.
        seed: seed of the stochastic-rounding generators (the same on every rank).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        seed: int = 0,
    ) -> None:
        if not lr >= 0:
            raise ValueError(f"adamw_bf16: lr={lr!r} must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"adamw_bf16: betas={betas!r} must each be in [0, 1)")
        if not eps >= 0:
            raise ValueError(f"adamw_bf16: eps={eps!r} must be >= 0")
        if not weight_decay >= 0:
            raise ValueError(f"adamw_bf16: weight_decay={weight_decay!r} must be >= 0")
        self._rounding = RoundingGenerators(seed)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("adamw_bf16 does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    # The moments take the parameter's dtype (bf16 for a bf16 weight), as torch's AdamW.
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                # int(): torch's AdamW keeps a tensor here, so an `adamw` checkpoint resumes as `adamw_bf16`.
                state["step"] = int(state["step"]) + 1
                if p.dtype == torch.bfloat16:
                    self._bf16_update(p, p.grad, state, group)
                else:
                    _adamw_update(p.detach(), p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"], group)
        return loss

    def _bf16_update(self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        param = p.detach()
        work = param.float()
        exp_avg, exp_avg_sq = state["exp_avg"].float(), state["exp_avg_sq"].float()
        _adamw_update(work, grad.float(), exp_avg, exp_avg_sq, state["step"], group)
        generator = self._rounding.get(param.device)
        stochastic_round_to_bf16(exp_avg, state["exp_avg"], generator)
        stochastic_round_to_bf16(exp_avg_sq, state["exp_avg_sq"], generator)
        stochastic_round_to_bf16(work, param, generator)

    # -- checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict plus the stochastic-rounding generators (weights_only-loadable)."""
        state_dict = super().state_dict()
        state_dict[_RNG_KEY] = self._rounding.state_dict()
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the moments, step counts, groups and the rounding generators exactly."""
        state_dict = dict(state_dict)
        rng = state_dict.pop(_RNG_KEY, None)
        super().load_state_dict(state_dict)  # moments come back in their parameter's dtype, as saved
        if rng is not None:
            self._rounding.load_state_dict(rng)


def _adamw_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    group: dict[str, Any],
) -> None:
    """One AdamW step in place, with the operations of torch's single-tensor AdamW in its order
    (so an fp32 parameter ends bit for bit where ``torch.optim.AdamW`` puts it)."""
    lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
    beta1, beta2 = group["betas"]
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1**step)
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
