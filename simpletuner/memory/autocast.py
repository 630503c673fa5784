"""The forward of a model under autocast with fp32 outputs, on the model itself.

What ``Accelerator.prepare`` does to a model for mixed precision, for the estimator's fake step:
the forward is replaced on the instance (not wrapped in another module), so code that reads the
model's attributes (Flux's ``denoiser.config``) sees the model it sees in training.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn


@contextmanager
def autocast_forward(model: nn.Module, device_type: str, dtype: torch.dtype) -> Iterator[nn.Module]:
    """``model`` itself with its forward run under autocast and fp16/bf16 outputs cast to fp32,
    for the duration of the block: what ``Accelerator.prepare`` does for mixed precision.

    Like Accelerate, this replaces ``forward`` on the instance rather than wrapping the module,
    so the model specs see the model they would see in training (its ``config``, ``dtype``,
    submodules): a wrapper module hides them. The class's own forward is restored on exit.
    """
    from accelerate.utils import convert_to_fp32

    own_forward = vars(model).get("forward")  # None: the class's forward
    inner = model.forward

    def forward(*args, **kwargs):
        with torch.autocast(device_type=device_type, dtype=dtype):
            out = inner(*args, **kwargs)
        return convert_to_fp32(out)  # the loss around the model runs outside autocast, in fp32

    model.forward = forward
    try:
        yield model
    finally:
        if own_forward is not None:
            model.forward = own_forward
        else:
            del model.forward
