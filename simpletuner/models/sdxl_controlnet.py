"""SDXL ControlNet (``controlnet: true``): a ``ControlNetModel`` trained beside the frozen SDXL UNet, as diffusers'
``train_controlnet_sdxl.py`` trains one and ``StableDiffusionXLControlNetPipeline`` runs it.

Each training image is paired by file name with its conditioning image (:mod:`simpletuner.data_backend.pairs`, a
dataset's ``conditioning_data_dir``). The conditioning image is pixels, never VAE-encoded: it is cached with the
image's latent, at the image's pixel geometry (same bucket and crop), as uint8 (:data:`CONTROL_PIXELS`, 3 bytes a
pixel), and reaches the ControlNet in [0, 1], as the pipeline's ``control_image_processor`` (``do_normalize=False``)
and diffusers' script feed it. The ControlNet's down and mid residuals go into the frozen UNet. Where SimpleTuner
differs: documentation/MODEL_FAMILIES.md, "ControlNet".
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch

from simpletuner.caching.fingerprint import fingerprint
from simpletuner.caching.size_crop import SIZE_CROP
from simpletuner.models.controlnet import CONTROLNET_FOLDER, ControlledDenoiser, ControlNetTraining, seeded
from simpletuner.models.sdxl import StableDiffusionXLSpec

#: The latent entry's conditioning image: ``[3, H, W]`` uint8 at the image's pixel size (then the batch's
#: conditioning under this name).
CONTROL_PIXELS = "controlnet_pixels"
#: What the cached latents of a ControlNet run hold (part of their cache key).
CONTROLNET_LATENT_LAYOUT = "sdxl-controlnet: image latents + conditioning image as uint8 pixels"

#: SimpleTuner's ``DEFAULT_CONTROLNET_LORA_TARGET`` (simpletuner/helpers/models/common.py:465-500): the ControlNet's
#: attention, feed-forward, resnet convolutions, time embedding, conditioning embedding and zero convolutions.
CONTROLNET_LORA_TARGETS = [
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "ff.net.0.proj",
    "ff.net.2",
    "proj_in",
    "proj_out",
    "conv",
    "conv1",
    "conv2",
    "conv_in",
    "conv_shortcut",
    "linear_1",
    "linear_2",
    "time_emb_proj",
    "controlnet_cond_embedding.conv_in",
    *(f"controlnet_cond_embedding.blocks.{i}" for i in range(6)),
    "controlnet_cond_embedding.conv_out",
    *(f"controlnet_down_blocks.{i}" for i in range(9)),
    "controlnet_mid_block",
]


def controlnet_folder_args(path: str) -> dict[str, str]:
    """``from_pretrained`` arguments of ``controlnet_model_name_or_path``: the path itself (a folder or a hub id, as
    SimpleTuner's ``from_pretrained(path)``), or its ``controlnet/`` subfolder when the folder has no ``config.json``
    of its own but that subfolder has one (a run's output folder, a checkpoint)."""
    root = Path(path).expanduser()
    if not (root / "config.json").is_file() and (root / CONTROLNET_FOLDER / "config.json").is_file():
        return {"pretrained_model_name_or_path": str(root), "subfolder": CONTROLNET_FOLDER}
    return {"pretrained_model_name_or_path": str(root) if root.is_dir() else path}


class StableDiffusionXLControlNetSpec(ControlNetTraining, StableDiffusionXLSpec):
    """SDXL with a ControlNet trained on conditioning images (see the module docstring)."""

    default_lora_targets: ClassVar[list[str]] = CONTROLNET_LORA_TARGETS

    # --- loading -------------------------------------------------------------------------
    def load_denoiser(self, dtype=torch.float32):
        """The frozen UNet and the ControlNet (``controlnet_model_name_or_path``, else ``from_unet`` under
        ``seed``) in one :class:`~simpletuner.models.controlnet.ControlledDenoiser`."""
        unet = super().load_denoiser(dtype)
        return ControlledDenoiser(unet, self.load_controlnet(unet, dtype), self.controlled_predict)

    def load_controlnet(self, unet: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
        from diffusers import ControlNetModel

        path = self.config.controlnet_model_name_or_path
        if path is not None:
            controlnet = ControlNetModel.from_pretrained(
                **controlnet_folder_args(path), torch_dtype=dtype, use_safetensors=True
            )
        else:
            controlnet = seeded(self.config.seed, lambda: ControlNetModel.from_unet(unet))
        return controlnet if controlnet.dtype == dtype else controlnet.to(dtype=dtype)

    def denoiser_from_config(self) -> torch.nn.Module:
        """:meth:`load_denoiser`'s model built from configs (no weights; the memory estimate)."""
        from diffusers import ControlNetModel
        from diffusers.models.modeling_utils import ModelMixin

        unet = super().denoiser_from_config()
        assert isinstance(unet, ModelMixin)  # a UNet2DConditionModel: the folder check allows nothing else
        path = self.config.controlnet_model_name_or_path
        if path is not None:
            controlnet = ControlNetModel.from_config(ControlNetModel.load_config(**controlnet_folder_args(path)))
        else:
            controlnet = ControlNetModel.from_unet(unet, load_weights_from_unet=False)
        return ControlledDenoiser(unet, controlnet, self.controlled_predict)

    # --- identities ----------------------------------------------------------------------
    def image_encoder_identity(self) -> str:
        # The entries hold the conditioning pixels too: never shared with a text-to-image run on the same VAE.
        return fingerprint(vae=super().image_encoder_identity(), layout=CONTROLNET_LATENT_LAYOUT)

    # --- encoding ------------------------------------------------------------------------
    @torch.no_grad()
    def encode_images(self, vae, pixels):
        """``[B, 6, H, W]`` (image, then its conditioning image, in [-1, 1]) -> the image's latents; the
        conditioning image is kept as pixels (:meth:`pixel_entries`).

        Raises:
            ValueError: pixels of one image (the dataset names no conditioning images).
        """
        return super().encode_images(vae, self._split(pixels)[0])

    def pixel_entries(self, pixels):
        """The conditioning image as uint8 ``[B, 3, H, W]`` (exact: the loader's pixels are ``uint8 / 127.5 - 1``)."""
        control = self._split(pixels)[1]
        return {CONTROL_PIXELS: control.add(1.0).mul(127.5).round().clamp(0, 255).to(torch.uint8).cpu()}

    def pixel_entry_bytes(self, width, height):
        return 3 * width * height + 100  # uint8 pixels and the tensor's header

    @staticmethod
    def _split(pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if pixels.ndim != 4 or pixels.shape[1] != 6:
            raise ValueError(
                f"a ControlNet trains on image pairs [B, 6, H, W] (image, then conditioning image), got "
                f"{tuple(pixels.shape)}: the dataset has no conditioning images. Give each dataset its "
                "`conditioning_data_dir`"
            )
        return pixels[:, :3], pixels[:, 3:]

    # --- training ------------------------------------------------------------------------
    def predict(self, denoiser, noisy, timesteps, conditioning):
        """Through the :class:`~simpletuner.models.controlnet.ControlledDenoiser`'s forward (perhaps inside DDP):
        :meth:`controlled_predict`."""
        return denoiser(noisy, timesteps, conditioning)

    def controlled_predict(self, unet, controlnet, noisy, timesteps, conditioning):
        """The UNet's prediction given the ControlNet's residuals of the batch's conditioning image in [0, 1]
        (``StableDiffusionXLControlNetPipeline.__call__``'s two calls, at conditioning scale 1)."""
        time_ids = self.time_ids(noisy, conditioning.get(SIZE_CROP))
        added = {"text_embeds": conditioning["pooled_prompt_embeds"], "time_ids": time_ids}
        embeds = conditioning["prompt_embeds"]
        control = conditioning[CONTROL_PIXELS].to(device=noisy.device, dtype=noisy.dtype) / 255.0
        down, mid = controlnet(
            noisy,
            timesteps,
            encoder_hidden_states=embeds,
            added_cond_kwargs=added,
            controlnet_cond=control,
            return_dict=False,
        )
        return unet(
            noisy,
            timesteps,
            embeds,
            added_cond_kwargs=added,
            down_block_additional_residuals=down,
            mid_block_additional_residual=mid,
            return_dict=False,
        )[0]

    # --- memory estimate -----------------------------------------------------------------
    def pixel_entry_shapes(self, batch_size):
        side = self.config.resolution
        return {CONTROL_PIXELS: ((batch_size, 3, side, side), torch.uint8)}

    # --- output --------------------------------------------------------------------------
    def build_pipeline(self, denoiser, vae, text_encoders):
        """A ``StableDiffusionXLControlNetPipeline`` with the frozen UNet and the ControlNet being trained, called
        ``(prompt, image=PIL control image, ...)``; the scheduler as :meth:`StableDiffusionXLSpec.build_pipeline`'s."""
        from diffusers import StableDiffusionXLControlNetPipeline

        assert isinstance(denoiser, ControlledDenoiser)  # what load_denoiser makes
        parts = super().build_pipeline(denoiser.base, vae, text_encoders).components
        return StableDiffusionXLControlNetPipeline(
            **{k: v for k, v in parts.items() if k not in ("image_encoder", "feature_extractor")},
            controlnet=denoiser.controlnet,
            add_watermarker=False,
        )
