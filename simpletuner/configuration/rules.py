"""Cross-field rules of the config: each reads a model through attributes and yields one line per problem.

The models' validators (schema.py) run them on a valid object. The loader also runs them on a
partly valid one (``partial.py``), where reading a field that failed validation stops the rule,
so one run reports every problem without guessing from bad input. A rule therefore reads only
attributes, and yields each message as soon as the values behind it are read.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

Rule = Callable[[Any], Iterator[str]]

#: Model families trained with flow matching (sigma in (0, 1)) rather than a DDPM schedule.
FLOW_MATCHING_FAMILIES = frozenset({"wan", "sd3", "flux"})


def _caption_prompt(ds) -> Iterator[str]:
    if ds.caption_strategy == "instance_prompt" and not ds.instance_prompt:
        yield "caption_strategy 'instance_prompt' needs `instance_prompt`: add the caption every image should get"


def _video_frames(ds) -> Iterator[str]:
    if ds.dataset_type == "video":
        if ds.num_frames is None:
            yield "dataset_type 'video' needs `num_frames` (4k+1: 1, 5, 9, 13, ..., 81)"
        elif ds.num_frames % 4 != 1:
            lower, upper = ds.num_frames - (ds.num_frames - 1) % 4, ds.num_frames + (5 - ds.num_frames % 4) % 4
            yield (f"num_frames {ds.num_frames} is not of the form 4k+1 (the video VAE packs 4 frames per "
                   f"latent frame after the first): use {lower} or {upper}")
    elif ds.num_frames is not None or ds.frame_stride != 1:
        yield "`num_frames` / `frame_stride` apply to dataset_type 'video' only: remove them or set dataset_type 'video'"


def _ramp_bounds(ramp) -> Iterator[str]:
    if not ramp.enable_batch_size_rampup:
        return
    missing = [k for k in ("initial_effective_batch_size", "target_effective_batch_size") if getattr(ramp, k) is None]
    if missing:
        yield f"enable_batch_size_rampup needs {' and '.join(missing)}: set them or turn the ramp off"
    elif ramp.initial_effective_batch_size > ramp.target_effective_batch_size:
        yield (f"initial_effective_batch_size {ramp.initial_effective_batch_size} is larger than "
               f"target_effective_batch_size {ramp.target_effective_batch_size}: the ramp only grows")


def _stop_condition(cfg) -> Iterator[str]:
    if cfg.max_train_steps is None and cfg.num_train_epochs is None:
        yield "set `max_train_steps` or `num_train_epochs` so the run knows when to stop"


def _one_dataset_source(cfg) -> Iterator[str]:
    if (cfg.datasets is None) == (cfg.data_backend_config is None):
        yield "give exactly one of `datasets` (a list) or `data_backend_config` (a JSON file of them)"


def _datasets_listed(cfg) -> Iterator[str]:
    if cfg.datasets is not None and not cfg.datasets:
        yield "`datasets` is empty: add at least one dataset entry"


def _unique_dataset_ids(cfg) -> Iterator[str]:
    ids = [d.id for d in cfg.datasets or []]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        yield f"dataset ids must be unique, repeated: {', '.join(dupes)}; rename all but one"


def _resolution_aligned(cfg) -> Iterator[str]:
    if cfg.resolution % cfg.aspect_bucket_alignment:
        yield f"`resolution` {cfg.resolution} is not a multiple of `aspect_bucket_alignment` {cfg.aspect_bucket_alignment}"


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
        yield (f"learning_rate {cfg.learning_rate} is outside [min_lr {cfg.min_lr}, max_lr {cfg.max_lr}]: with "
               "optimizer automagic it is each element's starting learning rate")


def _automagic_stage_ranges(cfg) -> Iterator[str]:
    if cfg.optimizer != "automagic":
        return
    for stage in ("high_noise", "low_noise"):
        lo = getattr(cfg, f"{stage}_min_lr") or cfg.min_lr
        hi = getattr(cfg, f"{stage}_max_lr") or cfg.max_lr
        if lo > hi:
            yield f"{stage}_min_lr {lo} is greater than {stage}_max_lr {hi}: set min <= max"


def _stages_need_wan(cfg) -> Iterator[str]:
    if cfg.train_stages != "both" and cfg.model_family != "wan":
        yield (f"train_stages {cfg.train_stages!r} picks one expert of a two-expert model (Wan 2.2), but model_family "
               f"{cfg.model_family!r} has one denoiser: remove train_stages")


def _full_not_quantised(cfg) -> Iterator[str]:
    if cfg.training_type == "full" and cfg.base_model_precision != "no_change":
        yield (f"base_model_precision {cfg.base_model_precision!r} quantises frozen base weights, but training_type "
               "'full' trains every weight: use training_type 'lora' or base_model_precision 'no_change'")


def _video_needs_wan(cfg) -> Iterator[str]:
    if cfg.model_family != "wan" and any(d.dataset_type == "video" for d in cfg.datasets or []):
        yield f"video datasets need a video model family (wan), not {cfg.model_family!r}"


def _loss_weighting_fits_family(cfg) -> Iterator[str]:
    flow_family = cfg.model_family in FLOW_MATCHING_FAMILIES
    if flow_family and cfg.loss_weighting == "min_snr":
        yield (f"loss_weighting min_snr is for DDPM schedules, but model_family {cfg.model_family!r} trains with "
               "flow matching: use none, sigma_sqrt or cosmap")
    if not flow_family and cfg.loss_weighting in ("sigma_sqrt", "cosmap"):
        yield (f"loss_weighting {cfg.loss_weighting} is a flow-matching weighting, but model_family "
               f"{cfg.model_family!r} uses a DDPM schedule: use none or min_snr")


def _validation_prompt_given(cfg) -> Iterator[str]:
    if cfg.validation_steps is not None and not cfg.validation_prompt and not cfg.validation_prompts:
        yield ("`validation_steps` is set but `validation_prompt` is not (nor `validation_prompts`): add a prompt "
               "or remove validation_steps")


#: Rules of a dataset entry, of ``gh200_optimizations`` and of the whole config. Add a rule to its
#: tuple to have it checked both in validation and in the loader's one-pass report.
DATASET_RULES: tuple[Rule, ...] = (_caption_prompt, _video_frames)
RAMP_RULES: tuple[Rule, ...] = (_ramp_bounds,)
TRAINING_RULES: tuple[Rule, ...] = (
    _stop_condition, _one_dataset_source, _datasets_listed, _unique_dataset_ids, _resolution_aligned,
    _ramp_batch_multiple, _automagic_lr_range, _automagic_stage_ranges, _stages_need_wan, _full_not_quantised,
    _video_needs_wan, _loss_weighting_fits_family, _validation_prompt_given,
)
