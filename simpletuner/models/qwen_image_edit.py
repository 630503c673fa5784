"""Qwen-Image-Edit: Qwen-Image (:mod:`simpletuner.models.qwen_image`) edited from a source image, as
``QwenImageEditPipeline`` does it; the ``qwen_image`` variant for a ``QwenImageEditPipeline`` folder.

The source enters the prompt (the edit template, :data:`EDIT_PROMPT_TEMPLATE`, with the image's tokens;
cached at :func:`edit_prompt_length` per image size) and the latents (``cat([target, source])`` on the
channel axis, the source never noised; the loss is on the target's tokens). :func:`load_edit_processor`
builds the processor without torchvision. Details: documentation/MODEL_FAMILIES.md, "Qwen-Image-Edit".
"""

from __future__ import annotations

import functools
from collections import defaultdict

import torch

from simpletuner.caching.fingerprint import fingerprint
from simpletuner.configuration import TrainingConfig
from simpletuner.models.edit_pairs import PairedLatents
from simpletuner.models.packed import pack_latents
from simpletuner.models.qwen_image import QWEN_MAX_LENGTH, QwenImageSpec, _validation_pipeline_class
from simpletuner.models.spec import save_transformer_lora

#: The chat template QwenImageEditPipeline wraps an instruction in (its ``prompt_template_encode``).
EDIT_PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
#: Tokens of the template's start (its system prompt) the pipeline drops (``prompt_template_encode_start_idx``).
EDIT_TEMPLATE_DROP = 64
#: Template tokens kept besides the image and caption tokens: ``<|vision_start|>``, ``<|vision_end|>`` and
#: the end ``<|im_end|>``, ``\n``, ``<|im_start|>``, ``assistant``, ``\n``.
EDIT_TEMPLATE_KEPT = 7
#: What the cached latents of an edit folder hold (part of their cache key).
EDIT_LATENT_LAYOUT = "qwen-image-edit: target latents + source latents on the channel axis"
#: What the cached prompt embeddings of an edit folder depend on besides the encoders (part of their key).
EDIT_PROMPT_LAYOUT = "qwen-image-edit: edit template, source image tokens, drop 64, cut to image + 7 + 512"
#: The processor's defaults when its preprocessor_config.json leaves one out (transformers' Qwen2VLImageProcessor).
PROCESSOR_DEFAULTS = dict(patch_size=14, merge_size=2, min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
PROCESSOR_CLASS = "Qwen2VLProcessor"
#: The conditioning key training passes the source latents to :meth:`QwenImageEditSpec.predict` under.
SOURCE_KEY = "edit_source_latents"


def edit_prompt_length(num_image_tokens: int) -> int:
    """The cached prompt length for a source of ``num_image_tokens`` image tokens: those, the template's
    other kept tokens (:data:`EDIT_TEMPLATE_KEPT`) and ``QWEN_MAX_LENGTH`` (512) caption tokens."""
    return num_image_tokens + EDIT_TEMPLATE_KEPT + QWEN_MAX_LENGTH


def processor_settings(preprocessor_config: dict | None) -> dict[str, int]:
    """``patch_size``, ``merge_size``, ``min_pixels``, ``max_pixels`` from a ``preprocessor_config.json``
    (``min_pixels`` / ``max_pixels`` keys first, then ``size.shortest_edge`` / ``longest_edge``, as
    transformers reads them; :data:`PROCESSOR_DEFAULTS` for what it leaves out)."""
    cfg = preprocessor_config or {}
    size = cfg.get("size")
    size = size if isinstance(size, dict) else {}
    return {
        "patch_size": int(cfg.get("patch_size") or PROCESSOR_DEFAULTS["patch_size"]),
        "merge_size": int(cfg.get("merge_size") or PROCESSOR_DEFAULTS["merge_size"]),
        "min_pixels": int(cfg.get("min_pixels") or size.get("shortest_edge") or PROCESSOR_DEFAULTS["min_pixels"]),
        "max_pixels": int(cfg.get("max_pixels") or size.get("longest_edge") or PROCESSOR_DEFAULTS["max_pixels"]),
    }


def num_image_tokens(height: int, width: int, settings: dict[str, int]) -> int:
    """Image tokens the processor gives a ``height`` x ``width`` image: ``smart_resize`` to a multiple of
    ``patch_size * merge_size`` within the pixel limits, one token per ``merge_size``² patches."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    patch, merge = settings["patch_size"], settings["merge_size"]
    h, w = smart_resize(height, width, patch * merge, settings["min_pixels"], settings["max_pixels"])
    return (h // patch) * (w // patch) // (merge * merge)


@functools.cache
def _processor_class():
    from transformers import Qwen2VLProcessor

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        """Qwen2VLProcessor that may lack its video processor (transformers 5 insists on one, and builds
        it only with torchvision); everything else is Qwen2VLProcessor's."""

        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return ImageOnlyQwen2VLProcessor


def load_edit_processor(model_path, **kwargs):
    """The folder's ``processor`` as a ``Qwen2VLProcessor`` for images: its tokenizer and the PIL
    Qwen2VLImageProcessor read from ``processor/`` (see the module docstring for why it is not
    ``Qwen2VLProcessor.from_pretrained``). ``kwargs``: ``revision`` and the like."""
    from transformers import Qwen2Tokenizer
    from transformers import Qwen2VLImageProcessorPil as PilImageProcessor  # JSON only, no weights

    tokenizer = Qwen2Tokenizer.from_pretrained(model_path, subfolder="processor", **kwargs)
    image_processor = PilImageProcessor.from_pretrained(model_path, subfolder="processor", **kwargs)
    return _processor_class()(image_processor=image_processor, tokenizer=tokenizer, video_processor=None)


@functools.cache
def _edit_validation_pipeline_class():
    """QwenImageEditPipeline with Qwen-Image's validation guidance (``guidance_scale`` is
    ``true_cfg_scale``), called ``(prompt, image=PIL, ...)``; ``image`` is required."""
    from diffusers import QwenImageEditPipeline

    class QwenImageEditValidationPipeline(_validation_pipeline_class(QwenImageEditPipeline)):
        def __call__(self, prompt=None, image=None, **kwargs):
            if image is None:
                raise ValueError(
                    "Qwen-Image-Edit renders from a source image: pass image= (a PIL image; in a training config, "
                    "set `validation_image` to the source image the validation prompts edit)"
                )
            return super().__call__(image=image, prompt=prompt, **kwargs)

    return QwenImageEditValidationPipeline


class QwenImageEditSpec(PairedLatents, QwenImageSpec):
    """Qwen-Image-Edit: edit pairs (target, source, instruction); see the module docstring. Latents are encoded
    and split as :class:`~simpletuner.models.edit_pairs.PairedLatents` says (each half as the pipeline's
    ``_encode_vae_image``: :meth:`QwenImageSpec.encode_images`)."""

    edit_model_name = "Qwen-Image-Edit"
    components = {
        **QwenImageSpec.components,
        "processor": ("processor", "transformers", frozenset({PROCESSOR_CLASS})),
    }

    def __init__(self, config: TrainingConfig):
        super().__init__(config)
        self.z_dim = int((self._component_config("vae") or {}).get("z_dim", 16))

    # --- folder checks -------------------------------------------------------------------
    def check_model_folder(self) -> None:
        """Also the processor, before the parent's checks: named in ``model_index.json`` and its
        ``preprocessor_config.json`` present."""
        root = self.local_root
        if root is not None:
            entry = (self.model_index or {}).get("processor")
            config = root / "processor" / "preprocessor_config.json"
            problem = None
            if not (isinstance(entry, list) and len(entry) == 2 and entry[0] is not None):
                problem = f"{root / 'model_index.json'} names no processor"
            elif not config.is_file():
                problem = f"{config} does not exist"
            if problem:
                raise ValueError(
                    f"{problem}: a Qwen-Image-Edit folder needs its processor ({PROCESSOR_CLASS}: the edit prompt "
                    "is encoded with the source image through it). Copy the `processor` folder of "
                    "Qwen/Qwen-Image-Edit into the model folder and name it in model_index.json "
                    f'("processor": ["transformers", "{PROCESSOR_CLASS}"])'
                )
        super().check_model_folder()

    def processor_settings(self) -> dict[str, int]:
        """The folder's processor settings (:func:`processor_settings`), read without loading it."""
        return processor_settings(self.read_component_config("processor", "preprocessor_config.json"))

    # --- identities ----------------------------------------------------------------------
    def image_encoder_identity(self) -> str:
        # Cached latents carry the source too: never shared with a text-to-image run on the same VAE.
        return fingerprint(vae=super().image_encoder_identity(), layout=EDIT_LATENT_LAYOUT)

    def text_encoder_identity(self) -> str:
        return fingerprint(parts=self._identity("tokenizer", "text_encoder", "processor"), layout=EDIT_PROMPT_LAYOUT)

    # --- loading -------------------------------------------------------------------------
    def load_text_encoders(self, device, dtype):
        """Qwen-Image's tokenizer and text encoder, and the ``processor`` (:func:`load_edit_processor`)."""
        encoders = super().load_text_encoders(device, dtype)
        encoders["processor"] = load_edit_processor(self.model_path, **self._kwargs())
        return encoders

    # --- encoding ------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, text_encoders, captions, images=None):
        """One entry per caption, as ``QwenImageEditPipeline._get_qwen_prompt_embeds`` with its source
        image (``images``: one PIL RGB image per caption), padded to :func:`edit_prompt_length` of its
        image tokens (see the module docstring). Captions are encoded in batches of same-size images."""
        if images is None:
            raise ValueError(
                "Qwen-Image-Edit encodes each caption with its source image: encode_prompts needs images= (one PIL "
                "image per caption); the dataset has no source images"
            )
        if len(images) != len(captions):
            raise ValueError(f"encode_prompts got {len(captions)} captions but {len(images)} source images")
        processor, encoder = text_encoders["processor"], text_encoders["text_encoder"]
        merge = processor.image_processor.merge_size
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i, image in enumerate(images):
            groups[image.size].append(i)
        out: list[dict[str, torch.Tensor] | None] = [None] * len(captions)
        for indices in groups.values():
            inputs = processor(
                text=[EDIT_PROMPT_TEMPLATE.format(captions[i]) for i in indices],
                images=[images[i] for i in indices],
                padding=True,
                return_tensors="pt",
            ).to(encoder.device)
            hidden = encoder(
                input_ids=inputs["input_ids"],
                attention_mask=inputs["attention_mask"],
                pixel_values=inputs["pixel_values"],
                image_grid_thw=inputs["image_grid_thw"],
                output_hidden_states=True,
            ).hidden_states[-1]
            for row, i in enumerate(indices):
                length = edit_prompt_length(int(inputs["image_grid_thw"][row].prod()) // (merge * merge))
                kept = hidden[row][inputs["attention_mask"][row].bool()][EDIT_TEMPLATE_DROP:][:length]
                embeds = kept.new_zeros(length, kept.shape[-1])
                embeds[: kept.shape[0]] = kept
                mask = torch.zeros(length, dtype=torch.int64, device=kept.device)
                mask[: kept.shape[0]] = 1
                out[i] = {"prompt_embeds": embeds, "prompt_embeds_mask": mask}
        return out

    # --- training ------------------------------------------------------------------------
    def training_loss(self, denoiser, latents, conditioning, generator, is_regularisation_data=False):
        """Qwen-Image's packed flow loss on the target latents; the transformer also sees the source
        latents, never noised (:meth:`predict`)."""
        target, source = self.split_pair(latents, self.z_dim)
        return super().training_loss(
            denoiser,
            target,
            {**conditioning, SOURCE_KEY: source},
            generator,
            is_regularisation_data=is_regularisation_data,
        )

    def predict(self, denoiser, noisy, timesteps, conditioning, latent_size):
        """The transformer's prediction for the packed target tokens ``noisy``, given the source tokens
        after them on the sequence axis (as the pipeline's denoising loop)."""
        source = conditioning[SOURCE_KEY]
        embeds, mask = self.text_inputs(conditioning)
        h, w = latent_size
        hidden = torch.cat([noisy, pack_latents(source).to(noisy.dtype)], dim=1)
        guidance = None
        if denoiser.config.guidance_embeds:  # as QwenImageSpec.predict
            guidance = torch.ones(noisy.shape[0], device=noisy.device, dtype=torch.float32)
        shapes = [(1, h // 2, w // 2), (1, source.shape[2] // 2, source.shape[3] // 2)]
        out = denoiser(
            hidden_states=hidden,
            encoder_hidden_states=embeds.to(noisy.dtype),
            encoder_hidden_states_mask=mask,
            timestep=timesteps.to(noisy.dtype),
            img_shapes=[shapes] * noisy.shape[0],
            guidance=guidance,
            return_dict=False,
        )[0]
        return out[:, : noisy.shape[1]]

    # --- memory estimate -----------------------------------------------------------------
    def batch_shapes(self, batch_size):
        """The prompt at :func:`edit_prompt_length` for a ``resolution``-square source (its image tokens
        through the folder's processor settings): the most a caption takes at that size."""
        latents, conditioning = super().batch_shapes(batch_size)
        side = self.config.resolution
        length = edit_prompt_length(num_image_tokens(side, side, self.processor_settings()))
        hidden = conditioning["prompt_embeds"][-1]
        return latents, {
            "prompt_embeds": (batch_size, length, hidden),
            "prompt_embeds_mask": (batch_size, length),
        }

    # --- output --------------------------------------------------------------------------
    def save_lora(self, output_dir, denoiser):
        from diffusers import QwenImageEditPipeline

        return save_transformer_lora(QwenImageEditPipeline, output_dir, denoiser)

    def build_pipeline(self, denoiser, vae, text_encoders):
        """A QwenImageEditPipeline called ``(prompt, image=PIL, ...)`` whose ``guidance_scale`` is the
        true-CFG scale, with :meth:`QwenImageSpec.sampling_scheduler`. The pipeline resizes the source to
        about 1 megapixel (``calculate_dimensions``) whatever the requested size."""
        return _edit_validation_pipeline_class()(
            scheduler=self.sampling_scheduler(),
            vae=vae,
            text_encoder=text_encoders["text_encoder"],
            tokenizer=text_encoders["tokenizer"],
            processor=text_encoders["processor"],
            transformer=denoiser,
        )
