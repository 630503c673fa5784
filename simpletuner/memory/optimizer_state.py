"""Optimizer-state bytes of the optimizers named as SimpleTuner names them (``optimi-*``, ``bnb-*``,
``torch-adafactor``): what each library allocates per trainable parameter, and an allowance for its step's
temporaries. ``tests/test_optimizers_more.py`` checks the state against the real optimizers'.

The rules (``p``: a parameter of ``n`` elements, ``s``: its element size):

- optimi: full-size tensors in ``p``'s dtype: Lion and SGD with momentum 1, AdamW / Adam / StableAdamW / RAdam 2,
  Ranger 3 (its Lookahead copy), Adan 4; one more (the Kahan compensation) for a bf16 / fp16 ``p`` unless
  ``kahan_sum`` is false; StableAdamW adds a scalar. SGD without momentum keeps none.
- bitsandbytes 8-bit (``n >= min_8bit_size``): per state (AdamW 2, Lion 1) ``n`` uint8 codes, an fp32 absmax per
  block of 256 and a 256-entry fp32 code map; smaller parameters keep fp32 states (4 bytes an element each).
- torch's Adafactor: a ``p`` of 2+ dims keeps row and column averages (``n / last dim`` + ``n / second-last dim``
  elements), a 1-D one a full second moment, in ``p``'s dtype (its step counter is a CPU scalar, not counted).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig

#: Full-size state tensors optimi keeps per parameter (before the Kahan compensation).
OPTIMI_STATES = {
    "optimi-lion": 1,
    "optimi-sgd": 1,
    "optimi-adamw": 2,
    "optimi-adam": 2,
    "optimi-stableadamw": 2,
    "optimi-radam": 2,
    "optimi-ranger": 3,
    "optimi-adan": 4,
}
#: States each bitsandbytes 8-bit optimizer keeps per parameter.
BNB_STATES = {"bnb-adamw8bit": 2, "bnb-adamw8bit-paged": 2, "bnb-lion8bit": 1}
#: bitsandbytes: elements sharing one fp32 absmax, entries of each state's fp32 code map, its default min_8bit_size.
BNB_BLOCK = 256
BNB_CODE_ENTRIES = 256
BNB_MIN_8BIT_SIZE = 4096


def optimi_state_bytes(p: torch.Tensor, name: str, settings: dict) -> int:
    """State bytes optimi's optimizer ``name`` keeps for ``p`` with ``settings`` (its ``optimizer_config``)."""
    states = OPTIMI_STATES[name]
    if name == "optimi-sgd" and not settings.get("momentum", 0):
        states = 0
    if p.dtype in (torch.bfloat16, torch.float16) and settings.get("kahan_sum", True) is not False:
        states += 1
    scalar = p.element_size() if name == "optimi-stableadamw" else 0
    return states * p.nbytes + scalar


def bnb_state_bytes(p: torch.Tensor, name: str, min_8bit_size: int = BNB_MIN_8BIT_SIZE) -> int:
    """State bytes bitsandbytes' 8-bit optimizer ``name`` keeps for ``p``."""
    n = p.numel()
    if n < min_8bit_size:
        return BNB_STATES[name] * n * 4
    return BNB_STATES[name] * (n + 4 * -(-n // BNB_BLOCK) + 4 * BNB_CODE_ENTRIES)


def adafactor_state_bytes(p: torch.Tensor) -> int:
    """State bytes torch's Adafactor keeps for ``p`` on its device."""
    n = p.numel()
    if p.dim() < 2:
        return n * p.element_size()
    return (n // p.shape[-1] + n // p.shape[-2]) * p.element_size()


def named_optimizer_bytes(
    config: "TrainingConfig", trainable: list[nn.Parameter], device_kind: str = "cuda"
) -> tuple[int, int] | None:
    """``(persistent state, step temporaries)`` of ``config.optimizer`` over ``trainable`` when it is one of this
    module's optimizers; None for another. Temporaries, as the estimator's torch rule: a multi-tensor step on CUDA
    makes full-size lists of all trainable elements (optimi: one, two for Adan; Adafactor: two), a CPU step one
    parameter's at a time; bitsandbytes updates its 8-bit state in place, block by block (none)."""
    name = config.optimizer
    settings = dict(config.optimizer_config)
    if name in OPTIMI_STATES:
        state = sum(optimi_state_bytes(p, name, settings) for p in trainable)
        lists = 0 if name == "optimi-sgd" else 2 if name == "optimi-adan" else 1
    elif name in BNB_STATES:
        min_size = settings.get("min_8bit_size", BNB_MIN_8BIT_SIZE)
        assert isinstance(min_size, int)  # checked with the config: a whole number >= 1
        return sum(bnb_state_bytes(p, name, min_size) for p in trainable), 0
    elif name == "torch-adafactor":
        state = sum(adafactor_state_bytes(p) for p in trainable)
        lists = 2
    else:
        return None
    total = sum(p.nbytes for p in trainable)
    scope = total if device_kind == "cuda" else max((p.nbytes for p in trainable), default=0)
    return state, lists * scope
