"""What a cache fill asks of a model (:class:`CacheEncoders`; :class:`simpletuner.models.ModelSpec` has
it), and the model's encoders loaded only when there is something to encode (:class:`LazyEncoders`)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Protocol

import torch

from simpletuner.caching.keys import EncoderIdentities

#: ``(name, words) -> context`` around a named step of the fill, such as loading the VAE
#: (``simpletuner.training.reliability.run_step``: a stop during it names the step).
StepMarker = Callable[[str, str], AbstractContextManager[Any]]


def no_step(name: str, words: str) -> AbstractContextManager[Any]:
    """A :data:`StepMarker` that marks nothing."""
    return nullcontext()


class CacheEncoders(EncoderIdentities, Protocol):
    """What the cache fill calls on a model spec: its encoders, their identities and its latent shapes."""

    @property
    def family(self) -> str: ...

    def load_vae(self, device: torch.device, dtype: torch.dtype) -> Any: ...

    def load_text_encoders(self, device: torch.device, dtype: torch.dtype) -> Any: ...

    def encode_images(self, vae: Any, pixels: torch.Tensor) -> torch.Tensor: ...

    def encode_prompts(self, text_encoders: Any, captions: list[str]) -> list[dict[str, torch.Tensor]]: ...

    def batch_shapes(self, batch_size: int) -> tuple[tuple[int, ...], dict[str, tuple[int, ...]]]: ...

    def pixel_entries(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]: ...

    def pixel_entry_bytes(self, width: int, height: int) -> int: ...


class PairedPromptEncoder(Protocol):
    """An edit model's prompt encoder (``ModelSpec.conditions_on_image``): each prompt with its source image."""

    def encode_prompts(
        self, text_encoders: Any, captions: list[str], images: list[Any]
    ) -> list[dict[str, torch.Tensor]]: ...


class LazyEncoders:
    """The VAE and text encoders of ``spec``, each loaded on first use (the cache may hold everything);
    ``step`` marks each load. The validator keeps them."""

    def __init__(self, spec: CacheEncoders, device: torch.device, text_dtype: torch.dtype, step: StepMarker = no_step):
        self.spec, self.device, self.text_dtype, self._step = spec, device, text_dtype, step
        self.vae: Any = None
        self.text: Any = None

    def get_vae(self) -> Any:
        if self.vae is None:
            with self._step("load_vae", "loading the VAE"):  # a Ctrl-C here names it
                self.vae = self.spec.load_vae(self.device, torch.float32)
        return self.vae

    def get_text(self) -> Any:
        if self.text is None:
            with self._step("load_text_encoders", "loading the text encoders"):
                self.text = self.spec.load_text_encoders(self.device, self.text_dtype)
        return self.text
