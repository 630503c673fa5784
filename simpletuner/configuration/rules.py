"""Cross-field rules of the config: each reads a model through attributes and yields one line per problem.

The models' validators (schema.py) run them on a valid object. The loader also runs them on a
partly valid one (``partial.py``), where reading a field that failed validation stops the rule,
so one run reports every problem without guessing from bad input. A rule therefore reads only
attributes, and yields each message as soon as the values behind it are read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterator

from simpletuner.configuration.export_formats import output_formats_problems
from simpletuner.configuration.families import (
    EXPERT_FAMILIES,
    FAMILY_LATENT_GRID,
    FAMILY_ONLY_KEYS,
    FLOW_MATCHING_FAMILIES,
    VIDEO_FAMILIES,
)
from simpletuner.configuration.model_folder import repo_id_problem
from simpletuner.configuration.optimizer_settings import (
    optimizer_config_problems,
    prodigy_learning_rate_problems,
)
from simpletuner.configuration.prompts import merged_prompts
from simpletuner.configuration.schedules import schedule_problems

Rule = Callable[[Any], Iterator[str]]


def _caption_prompt(ds) -> Iterator[str]:
    if ds.caption_strategy == "instance_prompt" and not ds.instance_prompt:
        yield "caption_strategy 'instance_prompt' needs `instance_prompt`: add the caption every image should get"


_CAPTION_TABLES = ("parquet", "csv", "jsonl")


def _caption_table(ds) -> Iterator[str]:
    strategy = ds.caption_strategy
    for name in _CAPTION_TABLES:
        table = getattr(ds, name)
        if name == strategy and table is None:
            yield (
                f"caption_strategy {name!r} needs a `{name}` table naming the file and its columns: "
                f'"{name}": {{"path": ..., "filename_column": ..., "caption_column": ...}}'
            )
        elif name != strategy and table is not None:
            yield (
                f"`{name}` is set but caption_strategy is {strategy!r}: set caption_strategy {name!r} "
                f"or remove `{name}`"
            )


def _prepend_needs_prompt(ds) -> Iterator[str]:
    if ds.prepend_instance_prompt and not ds.instance_prompt:
        yield "prepend_instance_prompt needs `instance_prompt`: add the words to put before every caption"


def _video_frames(ds) -> Iterator[str]:
    if ds.dataset_type == "video":
        if ds.num_frames is None:
            yield "dataset_type 'video' needs `num_frames` (4k+1: 1, 5, 9, 13, ..., 81)"
        elif ds.num_frames % 4 != 1:
            lower, upper = ds.num_frames - (ds.num_frames - 1) % 4, ds.num_frames + (5 - ds.num_frames % 4) % 4
            yield (
                f"num_frames {ds.num_frames} is not of the form 4k+1 (the video VAE packs 4 frames per "
                f"latent frame after the first): use {lower} or {upper}"
            )
    elif ds.num_frames is not None or ds.frame_stride != 1:
        yield (
            "`num_frames` / `frame_stride` apply to dataset_type 'video' only: remove them or set dataset_type 'video'"
        )


def _masks(ds) -> Iterator[str]:
    if ds.mask_data_dir is not None and ds.dataset_type == "video":
        yield (
            "`mask_data_dir` (masked loss) pairs masks with still images only; this dataset is `dataset_type: video`: "
            "remove the key, or use an image dataset"
        )
    if ds.mask_data_dir is None and ds.mask_type is not None:
        yield "`mask_type` says how the masks of `mask_data_dir` are read: set `mask_data_dir` too, or remove it"


def _generated_conditioning(ds) -> Iterator[str]:
    if ds.conditioning is None:
        return
    tables = [getattr(ds, name) for name in ("parquet", "csv", "jsonl")]
    if ds.conditioning_data_dir is not None or any(t is not None and t.conditioning_column for t in tables):
        yield (
            "`conditioning` generates each image's conditioning image, and `conditioning_data_dir` / "
            "`conditioning_column` name files for them too: keep one of the two"
        )
    if ds.dataset_type == "video":
        yield (
            "`conditioning` generates conditioning images from still images only; this dataset is `dataset_type: "
            "video`: remove the key, or use an image dataset"
        )


def _ramp_bounds(ramp) -> Iterator[str]:
    if not ramp.enable_batch_size_rampup:
        return
    missing = [k for k in ("initial_effective_batch_size", "target_effective_batch_size") if getattr(ramp, k) is None]
    if missing:
        yield f"enable_batch_size_rampup needs {' and '.join(missing)}: set them or turn the ramp off"
    elif ramp.initial_effective_batch_size > ramp.target_effective_batch_size:
        yield (
            f"initial_effective_batch_size {ramp.initial_effective_batch_size} is larger than "
            f"target_effective_batch_size {ramp.target_effective_batch_size}: the ramp only grows"
        )


def _managed_memory_keys(opts) -> Iterator[str]:
    if opts.oversubscription_ratio is not None and opts.managed_memory != "all":
        yield (
            f"oversubscription_ratio {opts.oversubscription_ratio:g} bounds the managed pool of managed_memory "
            f'"all", but managed_memory is {opts.managed_memory!r}: set managed_memory "all" or remove the ratio'
        )


def _stop_condition(cfg) -> Iterator[str]:
    if cfg.max_train_steps is None and cfg.num_train_epochs is None:
        yield "set `max_train_steps` or `num_train_epochs` so the run knows when to stop"


def _one_dataset_source(cfg) -> Iterator[str]:
    if (cfg.datasets is None) == (cfg.data_backend_config is None):
        yield "give exactly one of `datasets` (a list) or `data_backend_config` (a JSON file of them)"


def _datasets_listed(cfg) -> Iterator[str]:
    if cfg.datasets is not None and not cfg.datasets:
        yield "`datasets` is empty: add at least one dataset entry"


def _some_dataset_trained(cfg) -> Iterator[str]:
    datasets = cfg.datasets or []
    if datasets and all(ds.disabled or ds.probability == 0 for ds in datasets):
        listed = ", ".join(f"{ds.id!r} ({'disabled' if ds.disabled else 'probability 0'})" for ds in datasets)
        yield (
            f"every dataset is left out of training: {listed}. Enable one: remove `disabled: true` or give it a "
            "`probability` above 0"
        )


def _unique_dataset_ids(cfg) -> Iterator[str]:
    ids = [d.id for d in cfg.datasets or []]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        yield f"dataset ids must be unique, repeated: {', '.join(dupes)}; rename all but one"


def _resolution_aligned(cfg) -> Iterator[str]:
    if cfg.resolution % cfg.aspect_bucket_alignment:
        yield (
            f"`resolution` {cfg.resolution} is not a multiple of `aspect_bucket_alignment` "
            f"{cfg.aspect_bucket_alignment}"
        )


def _ramp_batch_multiple(cfg) -> Iterator[str]:
    ramp = cfg.gh200_optimizations
    if ramp.enable_batch_size_rampup:
        for key in ("initial_effective_batch_size", "target_effective_batch_size"):
            value = getattr(ramp, key)
            if value is not None and value % cfg.train_batch_size:
                yield f"gh200_optimizations.{key} {value} is not a multiple of train_batch_size {cfg.train_batch_size}"


def _automagic_lr_range(cfg) -> Iterator[str]:
    if cfg.optimizer != "automagic":
        return
    if cfg.min_lr > cfg.max_lr:
        yield f"min_lr {cfg.min_lr} is greater than max_lr {cfg.max_lr}: set min_lr <= max_lr"
    elif not cfg.min_lr <= cfg.learning_rate <= cfg.max_lr:
        yield (
            f"learning_rate {cfg.learning_rate} is outside [min_lr {cfg.min_lr}, max_lr {cfg.max_lr}]: with "
            "optimizer automagic it is each element's starting learning rate"
        )


def _optimizer_config_fits(cfg) -> Iterator[str]:
    yield from optimizer_config_problems(cfg.optimizer, cfg.optimizer_config)


def _prodigy_learning_rate(cfg) -> Iterator[str]:
    if cfg.optimizer != "prodigy":
        return
    for key in ("learning_rate", "high_noise_learning_rate", "low_noise_learning_rate", "text_encoder_lr"):
        yield from prodigy_learning_rate_problems({key: getattr(cfg, key)})


def _automagic_stage_ranges(cfg) -> Iterator[str]:
    if cfg.optimizer != "automagic":
        return
    for stage in ("high_noise", "low_noise"):
        lo = getattr(cfg, f"{stage}_min_lr") or cfg.min_lr
        hi = getattr(cfg, f"{stage}_max_lr") or cfg.max_lr
        if lo > hi:
            yield f"{stage}_min_lr {lo} is greater than {stage}_max_lr {hi}: set min <= max"


def _stages_need_experts(cfg) -> Iterator[str]:
    if cfg.train_stages != "both" and cfg.model_family not in EXPERT_FAMILIES:
        yield (
            f"train_stages {cfg.train_stages!r} picks one expert of a two-expert model (Wan 2.2), but model_family "
            f"{cfg.model_family!r} has one denoiser: remove train_stages"
        )


def _ti2v_needs_wan(cfg) -> Iterator[str]:
    if cfg.ti2v_first_frame and cfg.model_family != "wan":
        yield (
            f"ti2v_first_frame trains Wan 2.2 TI2V-5B's image-to-video mode, but model_family is "
            f"{cfg.model_family!r}: remove ti2v_first_frame, or use model_family 'wan' with a TI2V-5B folder"
        )


#: The families whose denoiser is a transformer TREAD routes (models/tread.py: LAYOUTS).
TREAD_FAMILIES = ("sd3", "flux", "wan", "qwen_image")


def _tread_needs_transformer(cfg) -> Iterator[str]:
    if cfg.tread_config is not None and cfg.model_family not in TREAD_FAMILIES:
        yield (
            f"tread_config routes the tokens of a transformer's blocks, but model_family {cfg.model_family!r} is a "
            f"UNet: remove tread_config (TREAD trains {', '.join(TREAD_FAMILIES)})"
        )


#: The families whose CLIP text encoders `train_text_encoder` trains a LoRA on (models/text_encoder_lora.py).
TEXT_ENCODER_FAMILIES = ("sd", "sdxl")


def _text_encoder_training_fits(cfg) -> Iterator[str]:
    if cfg.text_encoder_lr is not None and not cfg.train_text_encoder:
        yield (
            "text_encoder_lr is the learning rate of the text encoders' LoRA, read only with train_text_encoder "
            "true: remove it, or set train_text_encoder true"
        )
    if not cfg.train_text_encoder:
        return
    if cfg.model_family not in TEXT_ENCODER_FAMILIES:
        yield (
            f"train_text_encoder trains a LoRA on the CLIP text encoders of the UNet families "
            f"({', '.join(TEXT_ENCODER_FAMILIES)}), but model_family {cfg.model_family!r}'s text encoders are not "
            "trained here (their outputs are cached): remove train_text_encoder"
        )
    elif cfg.training_type != "lora":
        yield (
            "train_text_encoder adds a LoRA to the text encoders beside the UNet's; a full fine-tune of them is not "
            "supported: use training_type 'lora', or remove train_text_encoder"
        )
    elif cfg.lora_type != "standard":
        yield (
            "train_text_encoder trains a peft LoRA on the text encoders, which LyCORIS runs do not combine with (as "
            "in SimpleTuner): use lora_type 'standard', or remove train_text_encoder"
        )
    rate = cfg.text_encoder_lr
    if cfg.optimizer == "automagic" and rate is not None and not cfg.min_lr <= rate <= cfg.max_lr:
        yield (
            f"text_encoder_lr {rate} is outside [min_lr {cfg.min_lr}, max_lr {cfg.max_lr}]: with optimizer "
            "automagic it is each text-encoder element's starting learning rate"
        )


#: The families a ControlNet trains for (`controlnet`; models/sdxl_controlnet.py, models/flux_controlnet.py).
CONTROLNET_FAMILIES = ("sdxl", "flux")


def _controlnet_fits(cfg) -> Iterator[str]:
    if cfg.controlnet_model_name_or_path is not None and not cfg.controlnet:
        yield (
            "controlnet_model_name_or_path names the ControlNet a `controlnet: true` run trains: set controlnet true, "
            "or remove it"
        )
    if not cfg.controlnet:
        return
    if cfg.model_family not in CONTROLNET_FAMILIES:
        yield (
            f"controlnet trains a ControlNet for model families {', '.join(CONTROLNET_FAMILIES)} only, not "
            f"{cfg.model_family!r}: remove controlnet, or train an {' or '.join(CONTROLNET_FAMILIES)} model"
        )
    if cfg.train_text_encoder:
        yield (
            "controlnet trains the ControlNet alone (the model and its text encoders stay frozen): remove "
            "train_text_encoder"
        )
    if cfg.tread_config is not None:
        yield (
            "tread_config routes tokens past the trained transformer's blocks, which a ControlNet run does not train "
            "(its residuals enter every block): remove tread_config"
        )
    if cfg.training_type == "lora" and cfg.lora_type != "standard":
        yield (
            "controlnet with lora_type 'lycoris' is not supported: a ControlNet LoRA is a peft LoRA here "
            "(lora_type 'standard'), or train the whole ControlNet (training_type 'full')"
        )
    if any(fmt != "diffusers" for fmt in cfg.output_formats):
        yield (
            "output_formats kohya / comfyui have no key names for a ControlNet's adapter: a ControlNet run writes the "
            "diffusers ControlNet folder (and the adapter file): use output_formats ['diffusers']"
        )


def _full_not_quantised(cfg) -> Iterator[str]:
    if cfg.training_type == "full" and cfg.base_model_precision != "no_change":
        yield (
            f"base_model_precision {cfg.base_model_precision!r} quantises frozen base weights, but training_type "
            "'full' trains every weight: use training_type 'lora' or base_model_precision 'no_change'"
        )


def _lycoris_merge_needs_plain_base(cfg) -> Iterator[str]:
    if cfg.training_type != "lora" or cfg.lora_type != "lycoris" or cfg.lycoris.bypass_mode:
        return
    if cfg.base_model_precision != "no_change":
        yield (
            f"lycoris.bypass_mode false merges each adapter's delta into its layer's weight, which a "
            f"{cfg.base_model_precision!r} base cannot take: set lycoris.bypass_mode true or base_model_precision "
            "'no_change'"
        )


def _video_needs_video_family(cfg) -> Iterator[str]:
    if cfg.model_family not in VIDEO_FAMILIES and any(d.dataset_type == "video" for d in cfg.datasets or []):
        yield f"video datasets need a video model family ({', '.join(VIDEO_FAMILIES)}), not {cfg.model_family!r}"


def _loss_weighting_fits_family(cfg) -> Iterator[str]:
    flow_family = cfg.model_family in FLOW_MATCHING_FAMILIES
    if flow_family and cfg.loss_weighting == "min_snr":
        yield (
            f"loss_weighting min_snr is for DDPM schedules, but model_family {cfg.model_family!r} trains with "
            "flow matching: use none, sigma_sqrt, cosmap or sigma_squared"
        )
    if not flow_family and cfg.loss_weighting in ("sigma_sqrt", "cosmap", "sigma_squared"):
        yield (
            f"loss_weighting {cfg.loss_weighting} is a flow-matching weighting, but model_family "
            f"{cfg.model_family!r} uses a DDPM schedule: use none or min_snr"
        )


def _noise_offset_fits_family(cfg) -> Iterator[str]:
    if cfg.noise_offset > 0 and cfg.model_family in FLOW_MATCHING_FAMILIES:
        yield (
            f"noise_offset {cfg.noise_offset} is offset noise for DDPM schedules (sd, sdxl), but model_family "
            f"{cfg.model_family!r} trains with flow matching, which takes no offset noise (SimpleTuner ignores it "
            "there): remove noise_offset or set it to 0"
        )


def _zero_snr_fits_family(cfg) -> Iterator[str]:
    if cfg.rescale_betas_zero_snr and cfg.model_family in FLOW_MATCHING_FAMILIES:
        yield (
            f"rescale_betas_zero_snr rescales a DDPM schedule (sd, sdxl), but model_family {cfg.model_family!r} "
            "trains with flow matching, whose schedule already reaches pure noise: remove it"
        )


def _family_only_keys(cfg) -> Iterator[str]:
    for key, (family, default) in FAMILY_ONLY_KEYS.items():
        if cfg.model_family != family and getattr(cfg, key) != default:
            yield (
                f"{key} {getattr(cfg, key)!r} is read only by model_family {family!r}, but model_family is "
                f"{cfg.model_family!r}: remove {key}"
            )


def _flux_guidance_range(cfg) -> Iterator[str]:
    if cfg.flux_guidance_mode == "random-range" and cfg.flux_guidance_min > cfg.flux_guidance_max:
        yield (
            f"flux_guidance_min {cfg.flux_guidance_min} is greater than flux_guidance_max {cfg.flux_guidance_max}: "
            "set min <= max"
        )


def _t5_length_fits_family(cfg) -> Iterator[str]:
    if cfg.t5_max_length is not None and cfg.model_family != "sd3":
        yield (
            f"t5_max_length sets SD3's T5 prompt length, but model_family is {cfg.model_family!r} (its prompt length "
            "is the pipeline's): remove t5_max_length"
        )


def _validation_prompt_given(cfg) -> Iterator[str]:
    if cfg.validation_steps is not None and not cfg.validation_prompt and not cfg.validation_prompts:
        yield (
            "`validation_steps` is set but `validation_prompt` is not (nor `validation_prompts`): add a prompt "
            "or remove validation_steps"
        )


def _real_path(value: Any) -> Path | None:
    """``value`` as the absolute path the run uses (``~`` expanded, relative to the working directory
    as the loader leaves it, symlinks followed), or None when it is not a usable path."""
    try:
        return Path(os.path.realpath(os.path.expanduser(value)))
    except (TypeError, ValueError, OSError):  # not a string, or an embedded NUL: another rule reports it
        return None


# Why a run's folder may not overlap a dataset folder, each way round.
_PLACE_INSIDE_DATA = {
    "output_dir": "the run writes validation images and weights there, and the next run would train on them "
    "(captioned from their file names)",
    "cache_config.cache_dir": "the dataset scan would walk the cache files, and `simpletuner cache clear` would "
    "delete inside the dataset folder",
}
_DATA_INSIDE_PLACE = {
    "output_dir": "the run's results and `--overwrite` (which removes them) would share a folder with the "
    "training images",
    "cache_config.cache_dir": "`simpletuner cache clear` removes folders there",
}


def _places_apart(cfg) -> Iterator[str]:
    """output_dir and cache_dir are neither a dataset folder, nor inside one, nor around one."""
    from simpletuner.configuration.dataset_sections import url_protocol  # that module imports this one

    places = {"output_dir": cfg.output_dir, "cache_config.cache_dir": cfg.cache_config.cache_dir}
    for index, ds in enumerate(cfg.datasets or []):
        if isinstance(ds.instance_data_dir, str) and url_protocol(ds.instance_data_dir) is not None:
            continue  # s3://, hf://...: not a folder of this machine, so no run folder can overlap it
        data = _real_path(ds.instance_data_dir)
        for key, value in places.items():
            place = _real_path(value)
            if data is None or place is None:
                continue
            where = f"datasets[{index}].instance_data_dir {data}"
            if place == data:
                yield (
                    f"{key} {place} is the dataset folder {where}: {_PLACE_INSIDE_DATA[key]}. Give {key} a folder "
                    "outside the dataset"
                )
            elif data in place.parents:
                yield (
                    f"{key} {place} is inside {where}: {_PLACE_INSIDE_DATA[key]}. Move {key} out of the dataset folder"
                )
            elif place in data.parents:
                yield f"{where} is inside {key} {place}: {_DATA_INSIDE_PLACE[key]}. Keep the dataset outside {key}"


# --- latent grid: bucket sides the family's VAE and denoiser divide exactly (families.FAMILY_LATENT_GRID) ---


def alignment_problem(family: str, alignment: int, vae_factor: int, patch: int, where: str = "") -> str | None:
    """Why ``aspect_bucket_alignment`` does not fit a latent grid of ``vae_factor`` x ``patch``, or None.

    The message names the requirement and the nearest valid values (``where``: e.g. " in /models/x").
    """
    step = vae_factor * patch
    if alignment % step == 0:
        return None
    lower, upper = max(step, alignment - alignment % step), alignment - alignment % step + step
    if patch > 1:
        why = (
            f"the VAE{where} encodes {vae_factor}x{vae_factor} pixels per latent and the {family} denoiser takes "
            f"{patch}x{patch} latents per token"
        )
    else:
        why = f"the VAE{where} encodes {vae_factor}x{vae_factor} pixels per latent"
    valid = ", ".join(str(step * k) for k in range(1, 5))
    return (
        f"aspect_bucket_alignment {alignment} does not fit model_family {family!r}: {why}, so bucket sides must be "
        f"multiples of {step} ({valid}, ...); use {lower}" + (f" or {upper}" if upper != lower else "")
    )


def _alignment_fits_family(cfg) -> Iterator[str]:
    grid = FAMILY_LATENT_GRID.get(cfg.model_family)
    if grid is not None:
        problem = alignment_problem(cfg.model_family, cfg.aspect_bucket_alignment, *grid)
        if problem:
            yield problem


def _dataset_resolution_aligned(cfg) -> Iterator[str]:
    """A dataset's own ``resolution`` gets the top-level value's check: buckets are multiples of the
    alignment, so a smaller or unaligned resolution would silently train at another size."""
    alignment = cfg.aspect_bucket_alignment
    for index, ds in enumerate(cfg.datasets or []):
        resolution = ds.resolution
        if ds.resolution_type == "area" or not isinstance(resolution, int):
            continue  # megapixels, or a fraction (refused by the dataset's own rules)
        if resolution % alignment:
            below = resolution - resolution % alignment
            lower, upper = max(alignment, below), below + alignment
            yield (
                f"datasets[{index}].resolution {resolution} is not a multiple of `aspect_bucket_alignment` "
                f"{alignment} (bucket sides are, so it would train at another size): use {lower}"
                + (f" or {upper}" if upper != lower else "")
            )


# --- validation options: what the family's pipeline accepts ---------------------------------------------

#: Families whose diffusers pipeline takes ``guidance_rescale`` (StableDiffusion / StableDiffusionXL);
#: SD3's, Flux's and Wan's do not (tests/test_validation_options.py checks the installed diffusers).
GUIDANCE_RESCALE_FAMILIES = frozenset({"sd", "sdxl"})


def validation_sizes(value: int | str) -> list[tuple[int, int]]:
    """``validation_resolution`` as (width, height) pairs: a number (square), ``"WxH"``, or several of
    those separated by commas (SimpleTuner's spellings; ``x`` or ``X``). Raises ValueError naming the
    piece that is neither."""
    pieces = [value] if isinstance(value, int) else str(value).split(",")
    sizes = []
    for piece in pieces:
        text = str(piece).strip().lower()
        sides = text.split("x") if "x" in text else [text, text]
        if len(sides) != 2 or not all(side.strip().isdigit() for side in sides):
            raise ValueError(
                f"{str(piece).strip()!r} is not a size: give a number (1024, a square), WIDTHxHEIGHT (832x480), or "
                'several separated by commas ("1024, 832x480")'
            )
        width, height = (int(side) for side in sides)
        if not 0 < width <= 16384 or not 0 < height <= 16384:
            raise ValueError(f"{str(piece).strip()!r}: each side must be between 1 and 16384 pixels")
        sizes.append((width, height))
    return sizes


def _validation_sizes_fit_family(cfg) -> Iterator[str]:
    value = cfg.validation_resolution
    grid = FAMILY_LATENT_GRID.get(cfg.model_family)
    if value is None or grid is None:
        return
    step = grid[0] * grid[1]
    for width, height in validation_sizes(value):
        bad = [side for side in (width, height) if side % step]
        if bad:
            lower = "x".join(str(max(step, side - side % step)) for side in (width, height))
            upper = "x".join(str(side + (-side) % step) for side in (width, height))
            fixed = lower if lower == upper else f"{lower} or {upper}"
            yield (
                f"validation_resolution {width}x{height}: model_family {cfg.model_family!r} renders sides that are "
                f"multiples of {step} (the VAE's {grid[0]} pixels per latent"
                + (f" times {grid[1]} latents per token" if grid[1] > 1 else "")
                + f"), and {', '.join(map(str, bad))} is not: use {fixed}"
            )


def _guidance_rescale_fits_family(cfg) -> Iterator[str]:
    if cfg.validation_guidance_rescale and cfg.model_family not in GUIDANCE_RESCALE_FAMILIES:
        yield (
            f"validation_guidance_rescale {cfg.validation_guidance_rescale} needs a pipeline with guidance rescale "
            f"({', '.join(sorted(GUIDANCE_RESCALE_FAMILIES))}); the {cfg.model_family} pipeline has none: set it "
            "to 0 or remove it"
        )


def _validation_frames_fit_family(cfg) -> Iterator[str]:
    frames = cfg.validation_num_video_frames
    if frames is None:
        return
    if cfg.model_family not in VIDEO_FAMILIES:
        if frames != 1:
            yield (
                f"validation_num_video_frames {frames} is for video families ({', '.join(VIDEO_FAMILIES)}); "
                f"model_family {cfg.model_family!r} renders single images: remove it"
            )
    elif frames % 4 != 1:
        lower, upper = frames - (frames - 1) % 4, frames + (5 - frames % 4) % 4
        yield (
            f"validation_num_video_frames {frames} is not of the form 4k+1 (the video VAE decodes 4 frames per "
            f"latent frame after the first): use {lower} or {upper}"
        )


# --- dataset geometry: crop, resolution units, size and aspect limits (data_backend/geometry.py) -----------

#: Megapixel values above this are refused with ``resolution_type: area``: they read as pixels.
MAX_AREA_MEGAPIXELS = 64
_SIZE_KEYS = ("minimum_image_size", "maximum_image_size", "target_downsample_size")


def _resolution_units(ds) -> Iterator[str]:
    """``area`` takes megapixels (and the dataset's own ``resolution``); other units take whole pixels."""
    if ds.resolution_type == "area":
        if ds.resolution is None:
            yield (
                "resolution_type 'area' needs this dataset's `resolution` in megapixels (1.0 gives buckets around "
                "1024x1024): set it, or use resolution_type 'pixel_area' to keep the top-level `resolution` in pixels"
            )
        for key in ("resolution", *_SIZE_KEYS):
            value = getattr(ds, key)
            if value is not None and value > MAX_AREA_MEGAPIXELS:
                yield (
                    f"{key} {value} is megapixels with resolution_type 'area', and more than {MAX_AREA_MEGAPIXELS} "
                    f"megapixels reads as pixels: give megapixels (a {value} px side is about "
                    f"{value * value / 1e6:.2f} megapixels), or use resolution_type 'pixel_area' for a side in pixels"
                )
        return
    for key in ("resolution", *_SIZE_KEYS):
        value = getattr(ds, key)
        if isinstance(value, float):  # a whole number was made an int by the field
            yield (
                f"{key} {value} is not a whole number of pixels: a fraction is megapixels, which needs "
                "resolution_type 'area'; give pixels (e.g. 1024) or set resolution_type 'area'"
            )


def _crop_settings(ds) -> Iterator[str]:
    """crop_aspect, its buckets and the downsample pair apply only with ``crop: true``, and fit together."""
    if ds.crop is not True:
        given = [
            key
            for key in ("crop_aspect", "crop_aspect_buckets", "maximum_image_size", "target_downsample_size")
            if getattr(ds, key) is not None
        ]
        if given and ds.crop is None:  # `crop: false` ignores them, as SimpleTuner does
            yield (
                f"{', '.join(given)} appl{'y' if len(given) > 1 else 'ies'} only with `crop: true`, and crop is "
                f"unset: set `crop: true`, or remove {'them' if len(given) > 1 else 'it'}"
            )
        return
    aspect, buckets = ds.crop_aspect or "square", ds.crop_aspect_buckets
    if aspect in ("closest", "random") and not buckets:
        yield (
            f"crop_aspect {aspect!r} needs `crop_aspect_buckets`, the aspect ratios (width / height) to choose "
            "from, e.g. [0.75, 1.0, 1.5]"
        )
    elif aspect not in ("closest", "random") and buckets is not None:
        yield (
            f"crop_aspect_buckets is used by crop_aspect 'closest' or 'random' only, and crop_aspect is {aspect!r}: "
            "remove it or change crop_aspect"
        )
    elif buckets:
        weighted = [not isinstance(b, (int, float)) for b in buckets]
        if any(weighted) and not all(weighted):
            yield (
                "crop_aspect_buckets mixes numbers and {aspect, weight} objects: give all numbers (equal chances) "
                "or all objects"
            )
        elif all(weighted) and aspect == "random" and abs(sum(b.weight for b in buckets) - 1.0) > 1e-6:
            total = sum(b.weight for b in buckets)
            yield f"the weights of crop_aspect_buckets add up to {total:g}; they must add up to 1"
    maximum, target = ds.maximum_image_size, ds.target_downsample_size
    if (maximum is None) != (target is None):
        missing = "target_downsample_size" if target is None else "maximum_image_size"
        yield (
            f"maximum_image_size and target_downsample_size work together (images larger than the maximum are "
            f"resized to the target before the crop): set {missing} too, or remove both"
        )
    elif maximum is not None and target > maximum:
        yield (
            f"target_downsample_size {target} is larger than maximum_image_size {maximum}: images above the "
            "maximum would be enlarged before the crop; use a target at most the maximum"
        )


def _aspect_range(ds) -> Iterator[str]:
    low, high = ds.minimum_aspect_ratio, ds.maximum_aspect_ratio
    if low is not None and high is not None and low > high:
        yield (
            f"minimum_aspect_ratio {low} is above maximum_aspect_ratio {high}: every image would be skipped; swap them"
        )


#: Rules of a dataset entry, of ``gh200_optimizations`` and of the whole config (each model names its
#: tuple as ``cross_field_rules``). Add a rule to its tuple to have it checked both in validation and
#: in the loader's one-pass report.
DATASET_RULES: tuple[Rule, ...] = (
    _caption_prompt,
    _caption_table,
    _prepend_needs_prompt,
    _video_frames,
    _masks,
    _generated_conditioning,
    _resolution_units,
    _crop_settings,
    _aspect_range,
)
RAMP_RULES: tuple[Rule, ...] = (_ramp_bounds, _managed_memory_keys)


def _validation_images_match_prompts(cfg) -> Iterator[str]:
    images = cfg.validation_image
    if not isinstance(images, list):
        return
    several = cfg.validation_prompts if isinstance(cfg.validation_prompts, list) else None
    prompts = len(merged_prompts(cfg.validation_prompt, several))
    if not images:
        yield "validation_image is an empty list: give an image file, a list of them, or remove the key"
    elif len(images) not in (1, prompts):
        yield (
            f"validation_image lists {len(images)} images for {prompts} validation prompt(s): give one image for "
            "every prompt, or one per prompt in the order of validation_prompt then validation_prompts"
        )


def _hub_upload_settings(cfg) -> Iterator[str]:
    if cfg.push_checkpoints_to_hub and not cfg.push_to_hub:
        yield "push_checkpoints_to_hub needs push_to_hub: true (the repo is the one the final weights go to)"
    if cfg.push_to_hub and cfg.hub_model_id is None and (problem := repo_id_problem(cfg.hub_repo_id)):
        yield f"push_to_hub without hub_model_id uploads to tracker_project_name, and {problem}: set hub_model_id"


TRAINING_RULES: tuple[Rule, ...] = (
    _stop_condition,
    _one_dataset_source,
    _datasets_listed,
    _some_dataset_trained,
    _unique_dataset_ids,
    _resolution_aligned,
    _ramp_batch_multiple,
    _automagic_lr_range,
    _automagic_stage_ranges,
    _optimizer_config_fits,
    _prodigy_learning_rate,
    schedule_problems,
    _stages_need_experts,
    _ti2v_needs_wan,
    _tread_needs_transformer,
    _text_encoder_training_fits,
    _controlnet_fits,
    _full_not_quantised,
    _lycoris_merge_needs_plain_base,
    _video_needs_video_family,
    _loss_weighting_fits_family,
    _noise_offset_fits_family,
    _family_only_keys,
    _flux_guidance_range,
    _zero_snr_fits_family,
    _t5_length_fits_family,
    _validation_prompt_given,
    _places_apart,
    _alignment_fits_family,
    _dataset_resolution_aligned,
    _validation_sizes_fit_family,
    _guidance_rescale_fits_family,
    _validation_frames_fit_family,
    _validation_images_match_prompts,
    _hub_upload_settings,
    output_formats_problems,
)


def rules_for(model: type) -> tuple[Rule, ...]:
    """The cross-field rules of a config model: its ``cross_field_rules`` (a subclass inherits its base's)."""
    return getattr(model, "cross_field_rules", ())


def check_rules(obj):
    """Model-validator body: every rule of ``obj``'s model runs, and one ValueError with a line per
    problem is raised; ``obj`` is returned when there is none."""
    problems = [message for rule in rules_for(type(obj)) for message in rule(obj)]
    if problems:
        raise ValueError("\n".join(problems))
    return obj
