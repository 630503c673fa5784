"""bitsandbytes' 8-bit optimizers under SimpleTuner's names: ``bnb-adamw8bit`` (``AdamW8bit``),
``bnb-adamw8bit-paged`` (``PagedAdamW8bit``: the state in CUDA managed memory, which the driver pages out to CPU
memory under pressure) and ``bnb-lion8bit`` (``Lion8bit``), as SimpleTuner builds them
(helpers/training/optimizer_param.py:589-632).

A parameter of at least ``min_8bit_size`` elements (default 4096) keeps each state (AdamW: two, Lion: one) as uint8
codes into a 256-value dynamic map, with an fp32 absmax per block of 256 elements: about 1 byte per state element
instead of 4. Smaller parameters keep fp32 states. bitsandbytes 0.45+ runs these on CPU too.

Refused with the reason where bitsandbytes cannot run: not installed (the pip line), or one 8-bit step on each
device the parameters are on fails (no native library for this CUDA version, a GPU its build does not support):
bitsandbytes' own message is kept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import torch

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig

#: Our optimizer name -> bitsandbytes' class.
BNB_CLASSES = {"bnb-adamw8bit": "AdamW8bit", "bnb-adamw8bit-paged": "PagedAdamW8bit", "bnb-lion8bit": "Lion8bit"}
#: bitsandbytes' block of elements sharing one absmax in its blockwise 8-bit optimizer state.
STATE_BLOCK = 256
#: Elements of the probe parameter: one step of it runs the 8-bit kernels.
_PROBE_ELEMENTS = 4096


def bnb_class(name: str) -> type:
    """bitsandbytes' class for ``name`` (a key of :data:`BNB_CLASSES`); ValueError naming the extra when
    bitsandbytes is not installed."""
    try:
        import bitsandbytes.optim
    except ImportError as exc:
        raise ValueError(
            f'optimizer {name!r} needs bitsandbytes: pip install -e ".[bitsandbytes]" in the simpletuner checkout '
            "(or pip install bitsandbytes), or choose another optimizer (optimi-adamw, adamw)"
        ) from exc
    return getattr(bitsandbytes.optim, BNB_CLASSES[name])


def check_runs(name: str, devices: Iterable[torch.device]) -> None:
    """One 8-bit step of ``name`` on a probe parameter on each of ``devices``.

    Raises:
        ValueError: bitsandbytes cannot run there, with its reason.
    """
    cls = bnb_class(name)
    for device in set(devices):
        probe = torch.nn.Parameter(torch.zeros(_PROBE_ELEMENTS, device=device))
        probe.grad = torch.ones_like(probe)
        try:
            cls([probe], lr=1e-3, min_8bit_size=1).step()
        except (RuntimeError, NotImplementedError) as exc:
            import bitsandbytes

            reason = str(exc).strip() or type(exc).__name__
            raise ValueError(
                f"optimizer {name!r}: bitsandbytes {bitsandbytes.__version__} cannot run on {device}: {reason}\n"
                "Install a bitsandbytes build for this machine's CUDA (pip install -U bitsandbytes), or choose "
                "another optimizer (optimi-adamw, adamw)"
            ) from exc


def build_bnb(
    config: TrainingConfig, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]]
) -> torch.optim.Optimizer:
    """bitsandbytes' optimizer ``config.optimizer`` over ``params`` (parameters or param groups), after
    :func:`check_runs` on their devices; ``config.optimizer_config``: ``min_8bit_size`` (checked with the config).
    Lion takes no ``eps``."""
    name = config.optimizer
    groups = list(params)
    members = (p for g in groups for p in (g["params"] if isinstance(g, dict) else [g]))
    check_runs(name, (p.device for p in members if isinstance(p, torch.Tensor)))
    kwargs: dict[str, Any] = dict(config.optimizer_config, betas=(config.adam_beta1, config.adam_beta2))
    if name != "bnb-lion8bit":
        kwargs["eps"] = config.adam_epsilon
    return bnb_class(name)(groups, lr=config.learning_rate, weight_decay=config.weight_decay, **kwargs)
