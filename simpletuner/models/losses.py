"""The per-sample loss every family takes (``loss_type``), its Huber threshold schedule, and the
regularisation ("parent-student") target: the frozen base model's own prediction.

``l2`` is the mean squared error; ``huber`` the pseudo-Huber ``2 c (sqrt(d^2 + c^2) - c)``; ``smooth_l1``
the same curve without the factor ``c`` (SimpleTuner's formula, not ``torch.nn.functional.smooth_l1_loss``).
Each is taken element-wise and averaged over every dimension but the batch: the result is [B]. ``c`` follows
``huber_schedule`` over the noise level. See documentation/MODEL_FAMILIES.md, "Timesteps and loss types".
Masked loss multiplies each element by its latent pixel's mask weight before the average (which still divides
by every element, as SimpleTuner's ``loss * mask`` then ``mean``): :func:`mask_weights`, "Masked loss" there.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from simpletuner.configuration import TrainingConfig

LOSS_TYPES = ("l2", "huber", "smooth_l1")
HUBER_SCHEDULES = ("snr", "exponential", "constant")


def per_sample_loss(
    pred: torch.Tensor,
    target: torch.Tensor,
    loss_type: str = "l2",
    huber_c: float | torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """The [B] loss of ``pred`` against ``target`` (float32): ``loss_type`` element-wise, times ``weight``
    (broadcast to ``pred``'s shape: a masked loss, :func:`mask_weights`; None: 1), averaged over all but the
    first dimension. ``huber_c`` (``huber`` / ``smooth_l1`` only): a number, or one per sample ([B])."""
    dims = tuple(range(1, pred.ndim))
    if loss_type == "l2":
        elements = F.mse_loss(pred.float(), target.float(), reduction="none")
    elif loss_type in ("huber", "smooth_l1"):
        assert huber_c is not None, "huber / smooth_l1 need a threshold"
        if isinstance(huber_c, torch.Tensor):
            huber_c = huber_c.to(device=pred.device, dtype=torch.float32).view(-1, *([1] * (pred.ndim - 1)))
        diff = pred.float() - target.float()
        curve = torch.sqrt(diff**2 + huber_c**2) - huber_c
        elements = (2 * huber_c if loss_type == "huber" else 2.0) * curve
    else:
        raise ValueError(f"loss_type {loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
    if weight is not None:
        elements = elements * weight.to(device=elements.device, dtype=torch.float32)
    return elements.mean(dim=dims)


def mask_weights(loss_mask: torch.Tensor | None, shape: torch.Size | tuple[int, ...]) -> torch.Tensor | None:
    """The cached masks of a batch (``[B, 1, h, w]``, :data:`~simpletuner.data_backend.masks.MASK_KEY`) as an
    element weight of latents shaped ``shape`` (``[B, C, h, w]``, or ``[B, C, F, h, w]``: every channel and
    frame of a latent pixel weighs alike), contiguous so a family can lay it out as its latents (flux's
    packing); None for a batch without masks.

    Raises:
        ValueError: the masks are not on the latents' grid (a cache written for another model).
    """
    if loss_mask is None:
        return None
    batch, height, width = shape[0], shape[-2], shape[-1]
    if loss_mask.shape[0] != batch or tuple(loss_mask.shape[-2:]) != (height, width):
        raise ValueError(
            f"the batch's loss masks are {tuple(loss_mask.shape)}, its latents {tuple(shape)}: they do not share "
            "the latent grid (a latent cache written for another model?); clear cache_dir_vae and cache again"
        )
    view = loss_mask.float().reshape(batch, 1, *([1] * (len(shape) - 4)), height, width)
    return view.expand(*shape).contiguous()


def ddpm_huber_c(timesteps: torch.Tensor, scheduler, schedule: str, huber_c: float) -> float | torch.Tensor:
    """The Huber threshold for integer DDPM ``timesteps`` ([B]): a number for ``constant``, else [B]
    (float32, CPU). ``exponential``: ``exp(-a t)`` with ``a = -ln(huber_c) / T``; ``snr``:
    ``(1 - huber_c) / (1 + s)^2 + huber_c`` with ``s = sqrt((1 - abar_t) / abar_t)``."""
    if schedule == "constant":
        return huber_c
    t = timesteps.detach().cpu()
    if schedule == "exponential":
        rate = -math.log(huber_c) / scheduler.config.num_train_timesteps
        return torch.exp(-rate * t.float())
    if schedule == "snr":
        alphas = scheduler.alphas_cumprod.to(torch.float32)[t]
        sigma = ((1 - alphas) / alphas) ** 0.5
        return (1 - huber_c) / (1 + sigma) ** 2 + huber_c
    raise ValueError(f"huber_schedule {schedule!r} is not one of {', '.join(HUBER_SCHEDULES)}")


def flow_huber_c(sigmas: torch.Tensor, schedule: str, huber_c: float) -> float | torch.Tensor:
    """The Huber threshold for flow-matching noise levels ``sigmas`` in (0, 1) ([B]): a number for
    ``constant``, else [B] (float32, CPU). ``exponential``: ``huber_c ** sigma``; ``snr``:
    ``(1 - huber_c) / (1 + r)^2 + huber_c`` with ``r = sqrt((1 - sigma) / (sigma + 1e-4))``."""
    if schedule == "constant":
        return huber_c
    s = sigmas.detach().cpu().float()
    if schedule == "exponential":
        return torch.exp(math.log(huber_c) * s)
    if schedule == "snr":
        ratio = ((1 - s) / (s + 1e-4)) ** 0.5
        return (1 - huber_c) / (1 + ratio) ** 2 + huber_c
    raise ValueError(f"huber_schedule {schedule!r} is not one of {', '.join(HUBER_SCHEDULES)}")


def uses_parent_target(config: TrainingConfig, is_regularisation_data: bool) -> bool:
    """Whether a batch trains towards the base model's prediction: regularisation data in an adapter
    run (``training_type: lora``). A full fine-tune has no base model left to ask: it trains such
    batches on the usual target, as SimpleTuner does."""
    return is_regularisation_data and config.training_type == "lora"


@runtime_checkable
class _Network(Protocol):
    """A LyCORIS network (duck-typed: lycoris is an optional dependency)."""

    loras: list[nn.Module]
    multiplier: float

    def set_multiplier(self, multiplier: float) -> None: ...


@contextlib.contextmanager
def adapters_disabled(denoiser: nn.Module) -> Iterator[None]:
    """Run ``denoiser`` as its frozen base: every peft LoRA layer off (restored after, with the
    adapters' ``requires_grad`` as it was), every LyCORIS network at multiplier 0 (restored).
    Works through wrappers (DDP, torch.compile, Wan 2.2's experts): it walks the modules.

    Raises:
        ValueError: the denoiser carries no adapter (nothing to disable: the target would be the
            model's own prediction).
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    modules = list(denoiser.modules())
    peft_layers = [m for m in modules if isinstance(m, BaseTunerLayer) and not m.disable_adapters]
    networks = [m for m in modules if isinstance(m, _Network)]
    if not peft_layers and not networks:
        raise ValueError(
            f"{type(denoiser).__name__} has no active LoRA/LyCORIS adapter: regularisation data needs the base "
            "model's prediction with the adapter off"
        )
    grads = {id(p): p.requires_grad for m in peft_layers for p in m.parameters()}
    multipliers = [(n, n.multiplier) for n in networks]
    for layer in peft_layers:
        layer.enable_adapters(False)
    for network, _ in multipliers:
        network.set_multiplier(0.0)
    try:
        yield
    finally:
        for layer in peft_layers:
            layer.enable_adapters(True)
            for p in layer.parameters():  # enable_adapters(True) makes every adapter tensor trainable
                p.requires_grad_(grads[id(p)])
        for network, multiplier in multipliers:
            network.set_multiplier(multiplier)


def parent_prediction(denoiser: nn.Module, predict) -> torch.Tensor:
    """``predict()``'s output with the adapters off (:func:`adapters_disabled`), without gradients,
    as float32: the regularisation target."""
    with torch.no_grad(), adapters_disabled(denoiser):
        return predict().float()
