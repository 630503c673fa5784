"""Flux.1 ControlNet (``controlnet: true``): a ``FluxControlNetModel`` trained beside the frozen Flux transformer, as
diffusers' ``train_controlnet_flux.py`` trains one and ``FluxControlNetPipeline`` runs it.

Each training image is paired by file name with its conditioning image (:mod:`simpletuner.data_backend.pairs`). The
conditioning image is VAE-encoded as the image is and cached with it (``cat([image, conditioning])`` on the channel
axis: :class:`~simpletuner.models.edit_pairs.PairedLatents`), packed 2x2 like the noisy latents and given to the
ControlNet as ``controlnet_cond``; its double- and single-block residuals go into the frozen transformer. A fresh
ControlNet is ``FluxControlNetModel.from_transformer`` with SimpleTuner's (and diffusers') defaults: 4 double and 10
single blocks (fewer where the transformer has fewer) of the transformer's width. Where SimpleTuner differs:
documentation/MODEL_FAMILIES.md, "ControlNet".
"""

from __future__ import annotations

import functools
from typing import ClassVar

import torch

from simpletuner.caching.fingerprint import fingerprint
from simpletuner.models.controlnet import ControlledDenoiser, ControlNetTraining, seeded
from simpletuner.models.edit_pairs import PairedLatents
from simpletuner.models.flux import FluxSpec
from simpletuner.models.packed import pack_latents
from simpletuner.models.sdxl_controlnet import controlnet_folder_args

#: What the cached latents of a Flux ControlNet run hold (part of their cache key).
CONTROLNET_LATENT_LAYOUT = "flux-controlnet: image latents + conditioning image latents on the channel axis"
#: The conditioning key training passes the conditioning latents to the controlled prediction under.
CONTROL_LATENTS_KEY = "controlnet_latents"
#: ``FluxControlNetModel.from_transformer``'s defaults (diffusers; SimpleTuner calls it with them,
#: simpletuner/helpers/models/flux/model.py:286): double and single blocks of a fresh ControlNet.
NUM_DOUBLE_BLOCKS, NUM_SINGLE_BLOCKS = 4, 10
#: SimpleTuner's ``flux_lora_target: controlnet`` (flux/model.py:1302-1320), which a ControlNet LoRA run always uses
#: (flux/model.py:1242-1247): the ControlNet's input projection and its zero-initialised output linears.
CONTROLNET_LORA_TARGETS = [
    "controlnet_x_embedder",
    *(f"controlnet_blocks.{i}" for i in range(NUM_DOUBLE_BLOCKS)),
    *(f"controlnet_single_blocks.{i}" for i in range(NUM_SINGLE_BLOCKS)),
]


@functools.cache
def _validation_pipeline_class():
    """FluxControlNetPipeline called as validation calls a sampler, ``(prompt, image=PIL control image, ...)``;
    ``image`` is required."""
    from diffusers import FluxControlNetPipeline

    class FluxControlNetValidationPipeline(FluxControlNetPipeline):
        def __call__(self, prompt=None, image=None, **kwargs):
            if image is None:
                raise ValueError(
                    "a Flux ControlNet renders from a control image: pass image= (a PIL image; in a training config, "
                    "set `validation_image`)"
                )
            return super().__call__(prompt=prompt, control_image=image, **kwargs)

    return FluxControlNetValidationPipeline


class FluxControlNetSpec(ControlNetTraining, PairedLatents, FluxSpec):
    """Flux.1 with a ControlNet trained on conditioning images (see the module docstring)."""

    edit_model_name = "Flux ControlNet"
    source_noun = "conditioning"
    default_lora_targets: ClassVar[list[str]] = CONTROLNET_LORA_TARGETS

    # --- loading -------------------------------------------------------------------------
    def load_denoiser(self, dtype=torch.float32):
        """The frozen transformer and the ControlNet (``controlnet_model_name_or_path``, else
        ``from_transformer`` under ``seed``) in one :class:`~simpletuner.models.controlnet.ControlledDenoiser`."""
        from diffusers import FluxControlNetModel

        transformer = super().load_denoiser(dtype)
        path = self.config.controlnet_model_name_or_path
        if path is not None:
            controlnet = FluxControlNetModel.from_pretrained(
                **controlnet_folder_args(path), torch_dtype=dtype, use_safetensors=True
            )
        else:
            controlnet = seeded(self.config.seed, lambda: self._from_transformer(transformer, True))
        if controlnet.dtype != dtype:
            controlnet = controlnet.to(dtype=dtype)
        return ControlledDenoiser(transformer, controlnet, self.controlled_predict)

    @staticmethod
    def _from_transformer(transformer, load_weights: bool):
        from diffusers import FluxControlNetModel

        config = transformer.config
        return FluxControlNetModel.from_transformer(
            transformer,
            num_layers=min(NUM_DOUBLE_BLOCKS, config.num_layers),
            num_single_layers=min(NUM_SINGLE_BLOCKS, config.num_single_layers),
            attention_head_dim=config.attention_head_dim,  # Flux.1's are the defaults, 128 x 24
            num_attention_heads=config.num_attention_heads,
            load_weights_from_transformer=load_weights,
        )

    def denoiser_from_config(self) -> torch.nn.Module:
        """:meth:`load_denoiser`'s model built from configs (no weights; the memory estimate)."""
        from diffusers import FluxControlNetModel
        from diffusers.models.modeling_utils import ModelMixin

        transformer = super().denoiser_from_config()
        assert isinstance(transformer, ModelMixin)  # a FluxTransformer2DModel: the folder check allows nothing else
        path = self.config.controlnet_model_name_or_path
        if path is not None:
            config = FluxControlNetModel.load_config(**controlnet_folder_args(path))
            controlnet = FluxControlNetModel.from_config(config)
        else:
            controlnet = self._from_transformer(transformer, False)
        return ControlledDenoiser(transformer, controlnet, self.controlled_predict)

    # --- identities ----------------------------------------------------------------------
    def image_encoder_identity(self) -> str:
        # Cached latents carry the conditioning image's too: never shared with a text-to-image run on the same VAE.
        return fingerprint(vae=super().image_encoder_identity(), layout=CONTROLNET_LATENT_LAYOUT)

    # --- training ------------------------------------------------------------------------
    def training_loss(self, denoiser, latents, conditioning, generator, is_regularisation_data=False):
        """Flux's packed flow loss (:meth:`FluxSpec.training_loss`) on the image's latents; the ControlNet sees the
        conditioning image's latents, never noised."""
        channels = denoiser.config.in_channels // (self.latent_patch * self.latent_patch)
        target, control = self.split_pair(latents, channels)
        return super().training_loss(
            denoiser, target, {**conditioning, CONTROL_LATENTS_KEY: control}, generator, is_regularisation_data
        )

    def predict(self, denoiser, noisy, timesteps, conditioning, latent_size):
        """Through the :class:`~simpletuner.models.controlnet.ControlledDenoiser`'s forward (perhaps inside DDP):
        :meth:`controlled_predict`."""
        return denoiser(noisy, timesteps, conditioning, latent_size)

    def controlled_predict(self, transformer, controlnet, noisy, timesteps, conditioning, latent_size):
        """The transformer's packed prediction given the ControlNet's residuals of the packed conditioning latents
        (``FluxControlNetPipeline.__call__``'s two calls, at conditioning scale 1: the same timestep, guidance,
        prompt and ids for both)."""
        inputs = self.transformer_inputs(transformer, noisy, timesteps, conditioning, latent_size)
        control = pack_latents(conditioning[CONTROL_LATENTS_KEY]).to(noisy.dtype)
        blocks, single_blocks = controlnet(controlnet_cond=control, conditioning_scale=1.0, **inputs)
        return transformer(controlnet_block_samples=blocks, controlnet_single_block_samples=single_blocks, **inputs)[0]

    # --- output --------------------------------------------------------------------------
    def build_pipeline(self, denoiser, vae, text_encoders):
        """Flux's sampling scheduler and components (:meth:`FluxSpec.build_pipeline`) with the ControlNet being
        trained, as a FluxControlNetPipeline called ``(prompt, image=PIL control image, ...)``."""
        assert isinstance(denoiser, ControlledDenoiser)  # what load_denoiser makes
        components = super().build_pipeline(denoiser.base, vae, text_encoders).components
        return _validation_pipeline_class()(**components, controlnet=denoiser.controlnet)
