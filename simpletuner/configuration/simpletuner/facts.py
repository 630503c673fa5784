"""Facts about SimpleTuner read from its code at ``SIMPLETUNER_COMMIT``: its families and flavours, its
spellings of values, its defaults where ours differ, the settings its code forces. Data only.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from simpletuner.configuration.families import FAMILIES
from simpletuner.configuration.optimizer_settings import NAMED_OPTIMIZER_DEFAULTS

#: The SimpleTuner commit whose documentation, examples and defaults this table was written from.
SIMPLETUNER_COMMIT = "bc8e6ab7738ce457a2ed8eb2d26cadd91c6442cb"


#: SimpleTuner's model families -> ours (every SimpleTuner name of the family table).
SIMPLETUNER_FAMILIES: dict[str, str] = {
    name: family.name for family in FAMILIES.values() for name in family.simpletuner_names
}


#: SimpleTuner's model_flavour -> the hub model it stands for, per family (its HUGGINGFACE_PATHS).
FLAVOURS: dict[str, dict[str, str]] = {
    "sd1x": {
        "1.5": "stable-diffusion-v1-5/stable-diffusion-v1-5",
        "1.4": "CompVis/stable-diffusion-v1-4",
        "dreamshaper": "Lykon/dreamshaper-8",
        "realvis": "SG161222/RealVisXL_V5.0",
    },
    "sd2x": {
        "digitaldiffusion": "Junglerally/Digital-Diffusion",
        "pseudoflex-v2": "bghira/pseudo-flex-v2",
        "pseudojourney": "bghira/pseudo-journey-v2",
        "2.1": "stabilityai/stable-diffusion-2-1",
        "2.0": "stabilityai/stable-diffusion-2-0",
    },
    "sdxl": {
        "base-1.0": "stabilityai/stable-diffusion-xl-base-1.0",
        "refiner-1.0": "stabilityai/stable-diffusion-xl-refiner-1.0",
        "base-0.9": "stabilityai/stable-diffusion-xl-base-0.9",
        "refiner-0.9": "stabilityai/stable-diffusion-xl-refiner-0.9",
    },
    "sd3": {"medium": "stabilityai/stable-diffusion-3.5-medium", "large": "stabilityai/stable-diffusion-3.5-large"},
    "flux": {
        "dev": "black-forest-labs/flux.1-dev",
        "krea": "black-forest-labs/flux.1-krea-dev",
        "schnell": "black-forest-labs/flux.1-schnell",
        "kontext": "black-forest-labs/flux.1-kontext-dev",
        "fluxbooru": "terminusresearch/fluxbooru-v0.3",
        "libreflux": "jimmycarter/LibreFlux-SimpleTuner",
    },
    "wan": {
        "t2v-480p-1.3b-2.1": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
        "t2v-480p-14b-2.1": "Wan-AI/Wan2.1-T2V-14B-Diffusers",
        "i2v-14b-2.1": "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
        "i2v-14b-2.1-720p": "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers",
        "i2v-14b-2.2-high": "Wan-AI/Wan2.2-I2V-A14B-Diffusers",
        "i2v-14b-2.2-low": "Wan-AI/Wan2.2-I2V-A14B-Diffusers",
        "animegen-t2v-high": "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
        "animegen-t2v-low": "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
        "flf2v-14b-2.1": "Wan-AI/Wan2.1-FLF2V-14B-720P-diffusers",
        "vace-1.3b-2.1": "Wan-AI/Wan2.1-VACE-1.3B-diffusers",
        "vace-14b-2.1": "Wan-AI/Wan2.1-VACE-14B-diffusers",
        "ti2v-5b-2.2": "Wan-AI/Wan2.2-TI2V-5B-Diffusers",
    },
    "qwen_image": {
        "v1.0": "Qwen/Qwen-Image",
        "v2.0": "Qwen/Qwen-Image-2512",
        "edit-v1": "Qwen/Qwen-Image-Edit",
        "edit-v2": "Qwen/Qwen-Image-Edit-2509",
        "edit-v2+": "Qwen/Qwen-Image-Edit-2509",
        "edit-v3": "Qwen/Qwen-Image-Edit-2511",
    },
}


#: Each family's flavour when the config names none (SimpleTuner's DEFAULT_MODEL_FLAVOUR).
DEFAULT_FLAVOURS = {
    "sd1x": "dreamshaper",
    "sd2x": "pseudoflex-v2",
    "sdxl": "base-1.0",
    "sd3": "medium",
    "flux": "krea",
    "wan": "t2v-480p-1.3b-2.1",
    "qwen_image": "v2.0",
}


#: Flavours of a kind this trainer does not train yet, and why.
FLAVOUR_UNSUPPORTED = {
    # Prefixes: Wan 2.1 I2V (and its 720p flavour) needs the CLIP image encoder path; Wan 2.2 I2V A14B
    # (i2v-14b-2.2-*) and TI2V-5B (ti2v-5b-2.2) train.
    "i2v-14b-2.1": "Wan 2.1 image-to-video (with its CLIP image encoder) is not supported (Wan 2.2 I2V A14B is)",
    "flf2v": "first-last-frame-to-video training is not supported",
    "vace": "Wan VACE training is not supported",
    "refiner": "the SDXL refiner is not supported (it has one text encoder and an aesthetic-score input)",
    "animegen": "AnimeGen expert weights are downloaded from URLs, which this trainer does not do",
    "edit-v2": "Qwen-Image-Edit-2509 is an Edit Plus model (several source images per sample), which is not "
    "supported; `edit-v1` (Qwen-Image-Edit, one source image) is",
    "edit-v3": "Qwen-Image-Edit-2511 is an Edit Plus model (several source images per sample), which is not "
    "supported; `edit-v1` (Qwen-Image-Edit, one source image) is",
}


#: A LyCORIS JSON file's keys -> ours (rank and alpha are `lora_rank` / `lora_alpha` here).
LYCORIS_KEYS = {
    "algo": "lycoris.algo",
    "factor": "lycoris.factor",
    "full_matrix": "lycoris.full_matrix",
    "apply_preset": "lycoris.apply_preset",
    "multiplier": "lycoris.multiplier",
    "bypass_mode": "lycoris.bypass_mode",
    "linear_dim": "lora_rank",
    "linear_alpha": "lora_alpha",
    "conv_dim": "lycoris.conv_dim",
    "conv_alpha": "lycoris.conv_alpha",
}


#: SimpleTuner's values -> ours; None: a value of SimpleTuner's that does not run here.
OPTIMIZERS: dict[str, Optional[str]] = {
    "adamw_bf16": "adamw_bf16",
    "prodigy": "prodigy",
    "torch-adamw": "adamw",
    "torch-adam": "adam",
    "torch-sgd": "sgd",
    # Named here as there: the same classes (optimi's, bitsandbytes', torch's Adafactor) with the same defaults.
    **{name: name for name in NAMED_OPTIMIZER_DEFAULTS},
    **dict.fromkeys(
        (
            "ao-adamw8bit",
            "ao-adamw4bit",
            "ao-adamfp8",
            "ao-adamwfp8",
            "adamw_schedulefree",
            "adamw_schedulefree+aggressive",
            "adamw_schedulefree+no_kahan",
            "soap",
        )
    ),
}

#: Optimizer names SimpleTuner itself stops on, with its message (optimizer_param.py:878-882, cmd_args.py:959).
SIMPLETUNER_REMOVED_OPTIMIZERS = {
    "adafactor": "'Adafactor optimiser has been removed in favour of optimi-stableadamw'; its torch Adafactor is "
    "`torch-adafactor`, there and here",
    "adamw8bit": "'AdamW8Bit has been removed in favour of optimi-adamw optimiser'; bitsandbytes' 8-bit AdamW is "
    "`bnb-adamw8bit`, there and here",
    "dadaptation": "'D-adaptation optimiser has been removed due to issues with precision levels and convergence'",
}


#: SimpleTuner's schedule names -> ours, with its meaning (helpers/training/custom_schedule.py get_lr_scheduler and
#: helpers/configuration/cli_utils.py normalize_lr_scheduler_value): its `cosine` (and the alias
#: `cosine_with_warmup`) is its own class, `simpletuner_cosine` here; `constant` with a warm-up becomes
#: `constant_with_warmup` (see semantics.lr_schedule). `cosine_with_restarts` never leaves the peak there.
LR_SCHEDULERS: dict[str, Optional[str]] = {
    "constant": "constant",
    "constant_with_warmup": "constant_with_warmup",
    "linear": "linear",
    "cosine": "simpletuner_cosine",
    "cosine_with_warmup": "simpletuner_cosine",
    "polynomial": "polynomial",
    "cosine_with_restarts": None,
    "sine": None,
}


#: SimpleTuner's `crop_style` values -> ours (helpers/image_manipulation/cropping.py:280-286).
CROP_STYLES: dict[str, Optional[str]] = {
    "random": "random",
    "center": "center",
    "centre": "center",
    "corner": "corner",
    "face": None,
}


PRECISIONS: dict[str, Optional[str]] = {
    "no_change": "no_change",
    "int8-quanto": "qint8",
    "fp8-quanto": "qfloat8",
    "int4-quanto": "qint4",
    "int2-quanto": "qint2",
    "int8-torchao": "int8_torchao",
    "fp8-torchao": "fp8_torchao",
    "fp8wo-torchao": "fp8_torchao",
    **dict.fromkeys(
        (
            "int8dq-torchao",
            "int8dq-int4-torchao",
            "nf4-bnb",
            "int4-torchao",
            "fp8uz-quanto",
            "fp8-native",
            "fp8-int4-torchao",
            "fp8-transformerengine",
        )
    ),
}


#: SimpleTuner's quantisation kinds that map onto a different kernel here: what differs (its
#: helpers/training/quantisation/__init__.py:697-725; ours are weight-only torchao configs).
APPROXIMATED_PRECISIONS = {
    "fp8-torchao": "SimpleTuner quantises the activations to fp8 too (Float8DynamicActivationFloat8WeightConfig); "
    "here the frozen weights only (its `fp8wo-torchao`)",
    "int8-torchao": "SimpleTuner uses torchao's int8 quantized-training weights (int8_weight_only_quantized_training); "
    "here torchao's int8 weight-only config",
}


MIXED: dict[str, Optional[str]] = {"bf16": "bf16", "fp16": "fp16", "no": "no", "fp8": None}


CAPTION_STRATEGIES: dict[str, Optional[str]] = {
    "textfile": "textfile",
    "filename": "filename",
    "instanceprompt": "instance_prompt",
    "instance_prompt": "instance_prompt",
    "parquet": "parquet",
    "huggingface": "textfile",  # a `type: huggingface` entry's caption column (refused on other types)
    "webshart": None,
    "csv": None,  # SimpleTuner's `csv` downloads images from a URL list; ours reads local captions
}


#: Top-level keys SimpleTuner gives each dataset that does not set its own.
DATASET_DEFAULTS_FROM_TOP = (
    "resolution_type",
    "minimum_image_size",
    "maximum_image_size",
    "target_downsample_size",
    "caption_strategy",
    "instance_prompt",
    "prepend_instance_prompt",
    "only_instance_prompt",
    "cache_dir_vae",
)


#: SimpleTuner's defaults (its field registry at SIMPLETUNER_COMMIT) where ours differ, for keys a
#: config leaves out: written into the translation so the run means what it meant there.
SIMPLETUNER_DEFAULTS: dict[str, Any] = {
    "model_type": "full",
    "train_batch_size": 4,
    "learning_rate": 4e-7,
    "lr_scheduler": "constant_with_warmup",
    "optimizer": "adamw_bf16",
    "max_grad_norm": 2.0,
    "grad_clip_method": "value",
    "lora_dropout": 0.1,
    "gradient_checkpointing": True,
    "mixed_precision": "bf16",
    "resolution": 1024,
    "resolution_type": "pixel_area",
    "caption_strategy": "filename",
    "flow_schedule_shift": 3.0,
    "vae_batch_size": 4,
    "checkpoint_step_interval": 500,
    "checkpoints_total_limit": 5,
    "resume_from_checkpoint": "latest",
    "output_dir": "simpletuner-results",
    "validation_guidance": 7.5,
    "validation_num_inference_steps": 30,
    "num_train_epochs": 1,
    "caption_dropout_probability": 0.1,
    # the field registry's default (sections/model.py:1126); the dialect row keeps it for sdxl only, as
    # cmd_args.py:985-995 drops an sdxl VAE for every other family
    "pretrained_vae_model_name_or_path": "madebyollin/sdxl-vae-fp16-fix",
}


#: SimpleTuner's defaults of upload settings where ours differ, written only into a config that uploads
#: (`push_to_hub` on): `push_to_hub_background` false, training waits for each checkpoint upload
#: (field_registry/sections/publishing.py:115, trainer.py:2214-2226).
SIMPLETUNER_UPLOAD_DEFAULTS: dict[str, Any] = {"push_to_hub_background": False}

#: Keys whose SimpleTuner default is true, where ours is the same (not in SIMPLETUNER_DEFAULTS): a string "false"
#: leaves them true there (publishing.py:151), which a translation must say.
SIMPLETUNER_TRUE_ALSO_HERE: frozenset[str] = frozenset({"model_card_private"})


#: Each dataset's defaults in SimpleTuner's loader where ours differ.
SIMPLETUNER_DATASET_DEFAULTS: dict[str, Any] = {
    "crop": False,
    "crop_aspect": "square",
    "crop_style": "random",
    "allow_upscale": True,  # SimpleTuner upscales small images whatever the factor (`max_upscale_threshold` unset)
}


#: Every value spelling the translation reads, by key (for documentation/MIGRATING_FROM_SIMPLETUNER.md).
VALUE_TABLES: dict[str, Mapping[str, Optional[str]]] = {
    "model_family": SIMPLETUNER_FAMILIES,
    "base_model_precision": PRECISIONS,
    "optimizer": OPTIMIZERS,
    "lr_scheduler": LR_SCHEDULERS,
    "mixed_precision": MIXED,
    "caption_strategy": CAPTION_STRATEGIES,
    "crop_style": CROP_STYLES,
}


#: SimpleTuner features whose settings share a prefix and are turned on by one switch: with the
#: switch off (or absent), the other keys of the feature do nothing.
FEATURE_SWITCHES: dict[str, str] = {
    "crepa_": "crepa_enabled",
    "layersync_": "layersync_enabled",
    "urepa_": "urepa_enabled",
    "irepa_": "irepa_enabled",
    "nextlat_": "nextlat_enabled",
    "xm_": "xm_enabled",
    "mixflow_": "mixflow_enabled",
    "diff2flow_": "diff2flow_enabled",
    "internal_guidance_": "internal_guidance_enabled",
    "hidream_": "hidream_use_load_balancing_loss",
    "distillation_": "distillation_method",
    "controlnet_": "controlnet",
}


_FLUX_ATTENTION = ["to_k", "to_q", "to_v", "to_qkv", "add_qkv_proj", "add_k_proj", "add_q_proj", "add_v_proj"]


_FLUX_FFS = ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp", "proj_out"]


_FLUX_CONTEXT = ["add_k_proj", "add_q_proj", "add_v_proj", "add_qkv_proj", "to_add_out"]


#: SimpleTuner's named Flux LoRA layer sets (its flux model's target-module lists).
FLUX_LORA_TARGETS: dict[str, list[str]] = {
    "all": [*_FLUX_ATTENTION, "to_out.0", "to_add_out"],
    "all+ffs": [*_FLUX_ATTENTION, "to_out.0", "to_add_out", *_FLUX_FFS],
    "all+ffs+embedder": ["x_embedder", *_FLUX_ATTENTION, "to_out.0", "to_add_out", *_FLUX_FFS],
    "context": _FLUX_CONTEXT,
    "context+ffs": [*_FLUX_CONTEXT, "ff_context.net.0.proj", "ff_context.net.2"],
}


#: optimizer_config settings that are keys of their own here.
LIFTED_OPTIMIZER_SETTINGS = {"weight_decay": "weight_decay", "eps": "adam_epsilon"}


UNSUPPORTED_DATASET_TYPES = {
    "image_embeds": "image-embedding caches are not used here",
    "audio": "audio datasets are not supported",
    "caption": "caption-only datasets are not supported",
}


#: A `dataset_type: conditioning` entry's `conditioning_type` -> the warning for a source dataset read with an
#: approximated meaning (None: the same meaning). Edit pairs (Qwen-Image-Edit `edit-v1`) are read here.
REFERENCE_CONDITIONING: dict[str, Optional[str]] = {
    "reference_strict": None,  # SimpleTuner copies the training dataset's crops to the source, as here
    "reference_loose": (
        "SimpleTuner sizes and crops a loose reference on its own (its aspect may differ from the edited image's); "
        "here the source is resized to the edited image's size and given the same crop, and a source whose aspect "
        "ratio is more than 2% off the edited image's stops the run, naming it"
    ),
}


#: `conditioning_type` values of a mask dataset (masked loss): its folder becomes the training dataset's
#: `mask_data_dir` and the value its `mask_type` (training/collate.py:28, models/common.py:6409-6424).
MASK_CONDITIONING = ("mask", "segmentation")

#: What differs where a mask dataset is read (`t.approx`): how the mask is resized.
MASK_RESAMPLING = (
    "the mask is resized with area averaging (Pillow BOX) where SimpleTuner resizes it with Lanczos "
    "(image_manipulation/training_sample.py:745): weights differ only in latent pixels a mask edge crosses, "
    "without Lanczos' overshoot; a mask whose aspect ratio is more than 2% off its image's stops the run, naming it"
)

#: The `conditioning_type` of a ControlNet's conditioning images (with `controlnet: true`; SimpleTuner's CONTROLNET.md
#: example leaves it unset): each follows its image's crop and size, as `reference_strict`.
CONTROLNET_CONDITIONING = "controlnet"

#: Other `conditioning_type` values SimpleTuner knows, and why they do not train here.
UNSUPPORTED_CONDITIONING_TYPES: dict[str, str] = {}


#: Each SimpleTuner optimizer's own defaults (its `default_settings`, helpers/training/optimizer_param.py at
#: SIMPLETUNER_COMMIT), as our keys: SimpleTuner builds the optimizer from these, updated by `optimizer_config`
#: and `optimizer_beta1` + `optimizer_beta2` (optimizer_param.py:885-918); `adam_*` keys are not read.
#: (value, where SimpleTuner sets it). Only the settings whose default differs from ours are written.
SIMPLETUNER_OPTIMIZER_DEFAULTS: dict[str, dict[str, tuple[Any, str]]] = {
    "adamw_bf16": {
        "adam_beta1": (0.9, "optimizer_param.py:194"),
        "adam_beta2": (0.999, "optimizer_param.py:194"),
        "weight_decay": (1e-2, "optimizer_param.py:195"),
        "adam_epsilon": (1e-6, "optimizer_param.py:196"),
    },
    "torch-adam": {"weight_decay": (0.0, "optimizer_param.py:81")},
    "torch-sgd": {
        "optimizer_config.momentum": (0.0, "optimizer_param.py:100"),
        "weight_decay": (0.0, "optimizer_param.py:101"),
    },
    # optimi-*, bnb-*, torch-adafactor: the same defaults as those names have in our own dialect.
    **NAMED_OPTIMIZER_DEFAULTS,
    "prodigy": {
        "adam_beta1": (0.9, "optimizer_param.py:735"),
        "adam_beta2": (0.99, "optimizer_param.py:735"),
        "weight_decay": (0.0, "optimizer_param.py:737"),
        "adam_epsilon": (1e-8, "optimizer_param.py:744"),
    },
}


#: Settings SimpleTuner's model classes force for a family whatever the config says (their `check_user_config`,
#: helpers/models/<family>/model.py at SIMPLETUNER_COMMIT): SimpleTuner key -> (our key, value, where).
FAMILY_FORCED: dict[str, dict[str, tuple[str, Any, str]]] = {
    "sd1x": {"aspect_bucket_alignment": ("aspect_bucket_alignment", 64, "sd1x/model.py:317-321")},
    "legacy": {"aspect_bucket_alignment": ("aspect_bucket_alignment", 64, "sd1x/model.py:317-321")},
    "sd2x": {
        "aspect_bucket_alignment": ("aspect_bucket_alignment", 64, "sd1x/model.py:389-393"),
        "rescale_betas_zero_snr": ("rescale_betas_zero_snr", True, "sd1x/model.py:395-400"),
    },
    "sdxl": {"aspect_bucket_alignment": ("aspect_bucket_alignment", 64, "sdxl/model.py:648-652")},
    "sd3": {"aspect_bucket_alignment": ("aspect_bucket_alignment", 64, "sd3/model.py:869-871")},
    "flux": {"aspect_bucket_alignment": ("aspect_bucket_alignment", 64, "flux/model.py:1125-1129")},
    "wan": {"aspect_bucket_alignment": ("aspect_bucket_alignment", 32, "wan/model.py:1529-1535")},
    "qwen_image": {"aspect_bucket_alignment": ("aspect_bucket_alignment", 32, "qwen_image/model.py:1841-1850")},
}


_WAN_A14B_I2V = {
    "flow_schedule_shift": ("flow_shift", 5.0, "wan/model.py:369-386, 988"),
    "validation_num_inference_steps": ("validation_num_inference_steps", 40, "wan/model.py:369-386, 989"),
    "validation_guidance": ("validation_guidance_scale", 3.5, "wan/model.py:369-386, 990"),
}


#: Settings SimpleTuner forces for a flavour whatever the config says: (family, flavour) -> as FAMILY_FORCED.
FLAVOUR_FORCED: dict[tuple[str, str], dict[str, tuple[str, Any, str]]] = {
    ("wan", "i2v-14b-2.2-high"): _WAN_A14B_I2V,
    ("wan", "i2v-14b-2.2-low"): _WAN_A14B_I2V,
    ("wan", "ti2v-5b-2.2"): {"aspect_bucket_alignment": ("aspect_bucket_alignment", 64, "wan/model.py:1529-1535")},
    ("flux", "fluxbooru"): {"flux_guidance_value": ("flux_guidance_value", 3.5, "flux/model.py:1197-1199")},
}


#: What a flavour trained here does differently from SimpleTuner (its code at SIMPLETUNER_COMMIT): flavour -> why.
FLAVOUR_APPROXIMATED = {
    "kontext": "the reference tokens share the target's timestep, as FluxKontextPipeline (diffusers' and "
    "SimpleTuner's own, flux/pipeline.py:2448) samples; SimpleTuner trains them at timestep 0 (tokenwise: "
    "flux/model.py:602-618, 773-781) through its own transformer, whose text stream then takes the mean of the "
    "tokens' embeddings (flux/transformer.py:1068-1080), which diffusers' FluxTransformer2DModel has no form of",
}


#: Flavours whose forced settings include one not trained here, and why.
FLAVOUR_FORCED_UNSUPPORTED = {
    ("flux", "schnell"): "SimpleTuner trains Schnell with a 256-token T5 and its `flux_fast_schedule` "
    "(flux/model.py:1137-1149), neither of which is supported here",
    ("flux", "libreflux"): "SimpleTuner trains LibreFlux with attention-masked T5 tokens (flux/model.py:1183-1184), "
    "which is not supported here",
}
