"""``low_vram``: what is idle waits in CPU RAM and visits the GPU only while it is needed.

Idle here means the text encoders and VAE kept for validation (the caches already hold what
training reads) and, for Wan 2.2 with one ``train_stages`` expert, the frozen other expert.
Each costs one host-to-device copy there and back per validation. On GH200 / GB10 the GPU
reads CPU RAM directly, so the copies buy little there: try ``low_vram`` off first.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn


def modules_of(obj: Any) -> Iterator[nn.Module]:
    """Every module in ``obj``: a module, or dicts / lists / tuples of them (other values skipped)."""
    if isinstance(obj, nn.Module):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from modules_of(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from modules_of(value)


def to_device(objs: Any, device: torch.device) -> None:
    """Move every module in ``objs`` (modules, or dicts / lists / tuples of them; tokenizers and
    other non-modules are skipped) to ``device``."""
    for module in modules_of(objs):
        module.to(device)


@contextmanager
def on_device_while(enabled: bool, device: torch.device, *groups: Any):
    """With ``enabled``, the modules in ``groups`` are on ``device`` inside the block and back in
    CPU RAM after it (also when the block raises); without, nothing moves."""
    if not enabled or device.type == "cpu":
        yield
        return
    to_device(groups, device)
    try:
        yield
    finally:
        to_device(groups, torch.device("cpu"))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
