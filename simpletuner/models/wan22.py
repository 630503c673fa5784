"""Wan 2.2 two-expert training: a high-noise and a low-noise transformer, one adapter each.

Each sample goes to the expert that owns its timestep (``t >= boundary_ratio * 1000``: ``transformer``,
as ``WanPipeline`` denoises); ``train_stages`` ``high`` / ``low`` train one expert and draw timesteps on its
side only. Both experts live in one :class:`WanExperts` module, so the trainer, DDP, checkpoints and the
optimizer see one model, with a parameter group and a saved file per expert.
See documentation/MODEL_FAMILIES.md, "Wan 2.2: both experts in one run".
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from simpletuner.configuration import TrainingConfig
from simpletuner.data_backend.masks import MASK_KEY
from simpletuner.file_modes import ordinary_permissions
from simpletuner.models.adapters import prepare_for_training, quantize_base
from simpletuner.models.spec import save_transformer_lora
from simpletuner.models.wan import WanImageSampler, WanSpec, boundary_ratio_of

if TYPE_CHECKING:
    from diffusers.models.modeling_utils import ModelMixin

logger = logging.getLogger(__name__)

#: Stages (``train_stages`` values) and the pipeline component each trains.
EXPERTS = {"high": "transformer", "low": "transformer_2"}
#: Optimizer parameter-group names, also the prefixes of the per-stage config keys.
GROUP_NAMES = {"high": "high_noise", "low": "low_noise"}
#: The saved adapter of each stage, in the output folder.
LORA_FILES = {
    "high": "pytorch_lora_weights_high_noise.safetensors",
    "low": "pytorch_lora_weights_low_noise.safetensors",
}


class WanExperts(nn.Module):
    """Both Wan 2.2 experts behind one forward: each sample runs through the expert its timestep
    belongs to (``t >= boundary_timestep``: ``transformer``, else ``transformer_2``).

    ``route`` (a tuple of bools, True = high-noise expert) lets the caller pass the decision it
    already made on the CPU, so routing costs no device sync; a plain tuple also passes through
    DDP untouched. Without it the mask is read from ``timestep`` (one sync).
    """

    def __init__(self, transformer: ModelMixin, transformer_2: ModelMixin, boundary_timestep: float):
        super().__init__()
        self.transformer = transformer
        self.transformer_2 = transformer_2
        self.boundary_timestep = float(boundary_timestep)
        #: Experts taken out of the module tree by :meth:`park` (plain dict: not registered, so
        #: ``.to()``, DDP and ``parameters()`` leave them where they are).
        self.parked: dict[str, ModelMixin] = {}

    @property
    def config(self) -> dict[str, Any]:
        """Both experts' configs and the boundary (what a checkpoint's identity records)."""
        return {name: dict(self.expert(stage).config) for stage, name in EXPERTS.items()} | {
            "boundary_timestep": self.boundary_timestep
        }

    @property
    def dtype(self) -> torch.dtype:
        return self.expert("high").dtype

    def expert(self, stage: str) -> ModelMixin:
        from diffusers.models.modeling_utils import ModelMixin

        name = EXPERTS[stage]
        expert = self.parked[name] if name in self.parked else self.get_submodule(name)
        assert isinstance(expert, ModelMixin)  # what __init__ took (adapters are added in place)
        return expert

    def compile_parts(self) -> None:
        """``torch.compile`` each expert on the module tree in place. Compiling this module instead
        would guard on the route (a new graph for every pattern of experts in a batch)."""
        for expert in self.children():
            expert.compile()

    def park(self, stage: str) -> ModelMixin:
        """Move a frozen expert to CPU RAM, outside the module tree; returns it."""
        name = EXPERTS[stage]
        expert = self.expert(stage)
        if any(p.requires_grad for p in expert.parameters()):
            raise ValueError(f"the {stage}-noise expert is being trained; only an idle expert can be parked")
        del self._modules[name]
        if not any(p.is_meta for p in expert.parameters()):  # the estimator's meta model stays where it is
            expert.to("cpu")  # type: ignore[arg-type]  # diffusers' @wraps(Module.to) drops `self` from its type
        self.parked[name] = expert
        return expert

    def forward(
        self,
        hidden_states,
        timestep,
        encoder_hidden_states,
        route: tuple[bool, ...] | None = None,
        return_dict: bool = False,
        **kwargs,
    ):
        if route is None:
            route = tuple(bool(x) for x in (timestep >= self.boundary_timestep).tolist())
        high = [i for i, r in enumerate(route) if r]
        low = [i for i, r in enumerate(route) if not r]

        def run(expert, idx):
            if len(idx) == len(route):  # the whole batch: no gather
                return expert(
                    hidden_states=hidden_states,
                    timestep=timestep,
                    encoder_hidden_states=encoder_hidden_states,
                    return_dict=False,
                    **kwargs,
                )[0]
            sel = _device_index(idx, hidden_states.device)
            return expert(
                hidden_states=hidden_states.index_select(0, sel),
                timestep=timestep.index_select(0, sel),
                encoder_hidden_states=encoder_hidden_states.index_select(0, sel),
                return_dict=False,
                **kwargs,
            )[0]

        parts = []
        if high:
            parts.append(run(self.expert("high"), high))
        if low:
            parts.append(run(self.expert("low"), low))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        if len(parts) > 1:  # back to the batch order
            order = _device_index(torch.tensor(high + low).argsort().tolist(), out.device)
            out = out.index_select(0, order)
        return (out,)


def _device_index(idx: list[int], device: torch.device) -> torch.Tensor:
    """An index tensor on ``device`` without a host sync: ``torch.tensor(..., device=cuda)`` copies
    from pageable memory, which waits for the GPU; a pinned copy is queued instead."""
    index = torch.tensor(idx, dtype=torch.long)
    if device.type == "cuda":
        return index.pin_memory().to(device, non_blocking=True)
    return index.to(device)


class Wan22Spec(WanSpec):
    """Wan 2.2 T2V A14B: two experts split at ``boundary_ratio``; ``train_stages`` picks which train."""

    has_experts = True

    def __init__(self, config: TrainingConfig):
        super().__init__(config)
        ratio = boundary_ratio_of(self.model_index, Path(self.model_path).expanduser() / "model_index.json")
        if ratio is None:
            raise ValueError(
                f"{self.model_path} is not a two-expert Wan 2.2 folder (no transformer_2 / boundary_ratio)"
            )
        self.boundary_ratio = ratio
        self.stages = ("high", "low") if config.train_stages == "both" else (config.train_stages,)

    @property
    def boundary_timestep(self) -> float:
        return self.boundary_ratio * self.load_noise_scheduler().config.num_train_timesteps

    # --- loading -------------------------------------------------------------------------
    def load_denoiser(self, dtype=torch.float32):
        from diffusers import WanTransformer3DModel

        high, low = (
            WanTransformer3DModel.from_pretrained(
                self.model_path, subfolder=name, torch_dtype=dtype, use_safetensors=True, **self._kwargs()
            )
            for name in EXPERTS.values()
        )
        return WanExperts(high, low, self.boundary_timestep)

    def denoiser_from_config(self) -> nn.Module:
        from diffusers import WanTransformer3DModel

        high, low = (
            WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(self.model_path, subfolder=name))
            for name in EXPERTS.values()
        )
        return WanExperts(high, low, self.boundary_timestep)

    def prepare_denoiser(self, denoiser: nn.Module, weight_dtype: torch.dtype) -> nn.Module:
        """An adapter (or full training) on each expert in ``train_stages``; the other one frozen in
        ``weight_dtype``."""
        assert isinstance(denoiser, WanExperts)  # what load_denoiser / denoiser_from_config make
        for stage in EXPERTS:
            expert = denoiser.expert(stage)
            if stage in self.stages:
                setattr(
                    denoiser, EXPERTS[stage], prepare_for_training(expert, self.lora_targets, self.config, weight_dtype)
                )
            else:  # frozen, stored as the trained expert's base is
                expert.requires_grad_(False).to(dtype=weight_dtype).eval()  # type: ignore[call-arg]  # as in park()
                if self.config.training_type == "lora":
                    quantize_base(expert, self.config.base_model_precision)
        return denoiser

    def named_parameter_groups(self, denoiser: nn.Module) -> dict[str, list[nn.Parameter]]:
        assert isinstance(denoiser, WanExperts)
        return {
            GROUP_NAMES[stage]: [p for p in denoiser.expert(stage).parameters() if p.requires_grad]
            for stage in self.stages
        }

    def apply_low_vram(self, denoiser: nn.Module) -> None:
        """With one ``train_stages`` expert, the frozen other one waits in CPU RAM (validation only)."""
        assert isinstance(denoiser, WanExperts)
        for stage in EXPERTS:
            if stage not in self.stages:
                denoiser.park(stage)
                logger.info("low_vram: the %s-noise expert (frozen) waits in CPU RAM", stage)
        if len(self.stages) > 1:
            logger.warning(
                "low_vram: with train_stages 'both' both experts train and stay on the GPU; for less GPU "
                "memory train them in two runs (train_stages 'high', then 'low')"
            )

    def idle_modules(self, denoiser: nn.Module) -> list[nn.Module]:
        assert isinstance(denoiser, WanExperts)
        return list(denoiser.parked.values())

    @property
    def needs_unused_parameter_detection(self) -> bool:
        # A micro-batch whose samples all fall on one side leaves the other expert without gradients.
        return len(self.stages) > 1

    # --- training ------------------------------------------------------------------------
    def training_loss(self, denoiser, latents, conditioning, generator, is_regularisation_data=False):
        """The flow-matching loss (:meth:`flow_loss`), each sample through the expert its sigma
        belongs to: the route is decided on the CPU from the drawn sigmas (:meth:`route`) and passed
        to the experts, so routing costs no device sync."""

        def predict(noisy, sigmas):
            timesteps = self.timesteps_of(sigmas, latents.device)
            return self.predict(denoiser, noisy, timesteps, conditioning, route=self.route(sigmas))

        return self.flow_loss(
            latents,
            generator,
            predict,
            denoiser=denoiser,
            is_regularisation_data=is_regularisation_data,
            loss_mask=conditioning.get(MASK_KEY),
        )

    def sample_sigmas(self, batch_size: int, generator: torch.Generator) -> torch.Tensor:
        """As Wan 2.1, restricted to the trained expert's side of the boundary when one stage trains:
        draws are repeated (from the same generator) until ``batch_size`` land on that side, which is
        the Wan 2.1 distribution conditioned on the side."""
        sigmas = super().sample_sigmas(batch_size, generator)
        if len(self.stages) == 1 and not is_fake(sigmas):  # fake: the memory estimator's step, shapes only
            sigmas = self._one_side(sigmas, batch_size, generator)
        return sigmas

    def route(self, sigmas: torch.Tensor) -> tuple[bool, ...]:
        """Which expert each sample goes to (True: the high-noise one). With one stage every sigma is
        on its side (:meth:`sample_sigmas`); the memory estimator's fake sigmas hold no values, and
        with both stages its step runs every sample through the high-noise expert."""
        if len(self.stages) == 1:
            return (self.stages[0] == "high",) * sigmas.shape[0]
        if is_fake(sigmas):
            return (True,) * sigmas.shape[0]
        return tuple(bool(x) for x in self._is_high(sigmas).tolist())

    def _is_high(self, sigmas: torch.Tensor) -> torch.Tensor:
        """Which sigmas the high-noise expert owns: the same float32 product the loss moves to the
        device as the timestep, against the boundary (so the side chosen and the route agree)."""
        return sigmas * self.load_noise_scheduler().config.num_train_timesteps >= self.boundary_timestep

    def _one_side(self, sigmas: torch.Tensor, batch_size: int, generator: torch.Generator) -> torch.Tensor:
        want_high = self.stages[0] == "high"
        kept, num_kept = [], 0
        for _ in range(10_000):
            high = self._is_high(sigmas)
            chosen = sigmas[high if want_high else ~high]
            kept.append(chosen)
            num_kept += chosen.numel()
            if num_kept >= batch_size:
                return torch.cat(kept)[:batch_size]
            sigmas = super().sample_sigmas(batch_size, generator)
        raise ValueError(
            f"timestep sampling almost never reaches the {self.stages[0]}-noise side of the boundary "
            f"({self.boundary_ratio}): check timestep_sampling / logit_mean / flow_shift for train_stages "
            f"{self.stages[0]!r}"
        )

    def predict(self, denoiser, noisy, timesteps, conditioning, route: tuple[bool, ...] | None = None):
        """Both experts' prediction; ``route`` (see :meth:`route`) says which expert takes each
        sample, None: the experts read it from ``timesteps`` (one device sync)."""
        return denoiser(
            hidden_states=noisy,
            timestep=timesteps,
            encoder_hidden_states=conditioning["prompt_embeds"],
            route=route,
            return_dict=False,
        )[0]

    # --- output --------------------------------------------------------------------------
    def save_adapter(self, output_dir, denoiser):
        """One file per trained expert (``LORA_FILES``): diffusers format, or LyCORIS' own with
        ``lora_type: lycoris``; returns the first."""
        if self.config.lora_type != "lycoris":
            return self.save_lora(output_dir, denoiser)
        from simpletuner.models.adapters.lycoris import save_lycoris

        paths = [
            save_lycoris(denoiser.expert(stage), Path(output_dir) / LORA_FILES[stage], self.config)
            for stage in self.stages
        ]
        return paths[0]

    def save_lora(self, output_dir, denoiser):
        """One diffusers-loadable file per trained expert (``LORA_FILES``); returns the first."""
        from diffusers import WanPipeline

        paths = []
        for stage in self.stages:
            path = save_transformer_lora(WanPipeline, output_dir, denoiser.expert(stage), weight_name=LORA_FILES[stage])
            logger.info("saved the %s-noise expert's adapter to %s", stage, path)
            paths.append(path)
        return paths[0]

    def save_full(self, output_dir, denoiser):
        """Both experts as ``transformer`` / ``transformer_2`` folders of a Wan 2.2 pipeline."""
        for stage, name in EXPERTS.items():
            denoiser.expert(stage).save_pretrained(Path(output_dir) / name, safe_serialization=True)
        ordinary_permissions(*(Path(output_dir) / name for name in EXPERTS.values()))
        return Path(output_dir)

    def build_pipeline(self, denoiser, vae, text_encoders):
        """A 1-frame WanPipeline sampler with both experts and the folder's boundary."""
        sampler = super().build_pipeline(denoiser.expert("high"), vae, text_encoders)
        pipe = sampler.pipe
        pipe.register_modules(transformer_2=denoiser.expert("low"))
        pipe.register_to_config(boundary_ratio=self.boundary_ratio)
        return WanImageSampler(pipe, self.max_sequence_length)
