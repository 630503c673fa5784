"""The model families, in one table: every fact about a family that more than one place needs.

The schema's ``model_family`` values, the folder check (``model_folder.PIPELINE_FAMILIES``), the
SimpleTuner translation (its family names, which families are flow-matching), the config rules and
validation's negative prompt are all derived from :data:`FAMILIES`. The model layer
(``simpletuner.models.MODEL_FAMILIES``) has one spec per family named here; a test keeps the two in
step. Adding a family: a row here, its spec there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

#: The values ``model_family`` may take: the names of :data:`FAMILIES`' rows, in order (a test keeps them equal).
FamilyName = Literal["sd", "sdxl", "sd3", "flux", "wan", "qwen_image"]


@dataclass(frozen=True)
class Family:
    """What the configuration knows about one model family."""

    name: FamilyName
    #: What the configuration reference says the family is.
    summary: str
    #: diffusers ``model_index.json`` ``_class_name`` values a folder of this family carries.
    pipeline_classes: tuple[str, ...]
    #: SimpleTuner's ``model_family`` values that mean this family.
    simpletuner_names: tuple[str, ...]
    #: Trained with flow matching (sigma in (0, 1)) rather than a DDPM schedule.
    flow_matching: bool
    #: Takes video datasets (``dataset_type: video``).
    video: bool
    #: Has two experts (Wan 2.2), of which ``train_stages`` may pick one.
    experts: bool
    #: Its validation pipeline takes a negative prompt (Flux's guidance-distilled sampling does not).
    negative_prompt: bool
    #: Pixels per latent along a side (the VAE's down factor) and latents per denoiser token along a side, as
    #: in every released checkpoint of the family; a bucket side must be a multiple of their product
    #: (documentation/CONFIG.md, "Model families").
    latent_grid: tuple[int, int]
    #: The pipeline folders a run of the family loads (training and validation): what a hub download fetches
    #: the weights of (a test keeps them equal to the union of the family's specs' components).
    components: tuple[str, ...]


#: Every family, in the order the schema and the messages list them.
FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family(
            "sd",
            "Stable Diffusion 1.x/2.x UNet",
            pipeline_classes=("StableDiffusionPipeline",),
            simpletuner_names=("sd1x", "sd2x", "legacy"),
            flow_matching=False,
            video=False,
            experts=False,
            negative_prompt=True,
            latent_grid=(8, 1),
            components=("unet", "vae", "text_encoder", "tokenizer", "scheduler"),
        ),
        Family(
            "sdxl",
            "Stable Diffusion XL: two CLIP text encoders, pooled embeds",
            pipeline_classes=("StableDiffusionXLPipeline",),
            simpletuner_names=("sdxl",),
            flow_matching=False,
            video=False,
            experts=False,
            negative_prompt=True,
            latent_grid=(8, 1),
            components=("unet", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler"),
        ),
        Family(
            "sd3",
            "Stable Diffusion 3 MMDiT: two CLIP encoders and T5 where present",
            pipeline_classes=("StableDiffusion3Pipeline",),
            simpletuner_names=("sd3",),
            flow_matching=True,
            video=False,
            experts=False,
            negative_prompt=True,
            latent_grid=(8, 2),
            components=(
                "transformer",
                "vae",
                "text_encoder",
                "text_encoder_2",
                "text_encoder_3",
                "tokenizer",
                "tokenizer_2",
                "tokenizer_3",
                "scheduler",
            ),
        ),
        Family(
            "flux",
            "Flux.1 transformer (and Flux.1 Kontext), guidance embedding and packed latents: CLIP-L pooled + T5",
            pipeline_classes=("FluxPipeline", "FluxKontextPipeline"),
            simpletuner_names=("flux",),
            flow_matching=True,
            video=False,
            experts=False,
            negative_prompt=False,
            latent_grid=(8, 2),
            components=(
                "transformer",
                "vae",
                "text_encoder",
                "text_encoder_2",
                "tokenizer",
                "tokenizer_2",
                "scheduler",
            ),
        ),
        Family(
            "wan",
            "Wan 2.1 / 2.2 text-to-video transformer, UMT5 text encoder",
            pipeline_classes=("WanPipeline", "WanImageToVideoPipeline"),
            simpletuner_names=("wan",),
            flow_matching=True,
            video=True,
            experts=True,
            negative_prompt=True,
            latent_grid=(8, 2),
            components=("transformer", "transformer_2", "vae", "text_encoder", "tokenizer", "scheduler"),
        ),
        Family(
            "qwen_image",
            "Qwen-Image MMDiT text-to-image (and Qwen-Image-Edit), 2x2 packed latents, Qwen2.5-VL text encoder",
            # QwenImageEditPlusPipeline: the family refuses it, saying why (several source images)
            pipeline_classes=("QwenImagePipeline", "QwenImageEditPipeline", "QwenImageEditPlusPipeline"),
            simpletuner_names=("qwen_image",),
            flow_matching=True,
            video=False,
            experts=False,
            negative_prompt=True,
            latent_grid=(8, 2),
            components=("transformer", "vae", "text_encoder", "tokenizer", "scheduler", "processor"),
        ),
    )
}

#: The values ``model_family`` may take, in the order the schema and the messages list them.
FAMILY_NAMES: tuple[FamilyName, ...] = get_args(FamilyName)
#: Model families trained with flow matching (sigma in (0, 1)) rather than a DDPM schedule.
FLOW_MATCHING_FAMILIES = frozenset(name for name, f in FAMILIES.items() if f.flow_matching)
#: Families that take video datasets.
VIDEO_FAMILIES = tuple(name for name, f in FAMILIES.items() if f.video)
#: Families with experts ``train_stages`` can choose between.
EXPERT_FAMILIES = tuple(name for name, f in FAMILIES.items() if f.experts)
#: Families whose validation sampling takes no negative prompt.
NO_NEGATIVE_PROMPT_FAMILIES = frozenset(name for name, f in FAMILIES.items() if not f.negative_prompt)
#: Per family: (pixels per latent, latents per token) along a side; see :attr:`Family.latent_grid`.
FAMILY_LATENT_GRID: dict[str, tuple[int, int]] = {name: f.latent_grid for name, f in FAMILIES.items()}

#: Keys only one family reads, and their defaults (the schema takes its defaults from here): a config
#: of another family that sets one to anything else is refused, naming the key (rules.py), and a
#: family's spec may refuse them for a folder that cannot use them (flux: a transformer without a
#: guidance embedding). The Flux guidance keys and defaults are SimpleTuner's (its field registry).
FAMILY_ONLY_KEYS: dict[str, tuple[str, Any]] = {
    "flux_guidance_mode": ("flux", "constant"),
    "flux_guidance_value": ("flux", 1.0),
    "flux_guidance_min": ("flux", 0.0),
    "flux_guidance_max": ("flux", 4.0),
}


def family_keys_changed(config: Any, family: str) -> list[str]:
    """The keys only ``family`` reads (``FAMILY_ONLY_KEYS``) that ``config`` sets to another value than
    their default, as ``key value`` (for messages), in the table's order."""
    changed = []
    for key, (owner, default) in FAMILY_ONLY_KEYS.items():
        if owner == family and getattr(config, key) != default:
            changed.append(f"{key} {getattr(config, key)!r}")
    return changed
