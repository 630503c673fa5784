"""SimpleTuner meanings that span several keys, or that its code decides whatever the config says (the
schedule, optimizer defaults, forced settings, validation, seed, sampling). Each function reads the whole
config (``t.bare``) after the key-by-key pass and writes what SimpleTuner would run; a config value SimpleTuner
replaces is replaced here too, and said at WARNING (``Report.overridden``).
"""

from __future__ import annotations

from typing import Any, Mapping

from simpletuner.configuration.families import FLOW_MATCHING_FAMILIES
from simpletuner.configuration.schedules import LR_END_DEFAULTS, LR_POWER_DEFAULTS, SIMPLETUNER_LR_END
from simpletuner.configuration.simpletuner.facts import (
    FAMILY_FORCED,
    FLAVOUR_FORCED,
    FLAVOUR_FORCED_UNSUPPORTED,
    FLUX_LORA_TARGETS,
    LR_SCHEDULERS,
    SIMPLETUNER_DEFAULTS,
    SIMPLETUNER_OPTIMIZER_DEFAULTS,
)
from simpletuner.configuration.simpletuner.reading import Problem, Translation, as_bool, as_number, is_inert, plain

#: SimpleTuner's `lr_power` default (its field registry, training.py:781-787).
SIMPLETUNER_LR_POWER = 0.8

#: SimpleTuner's `validation_step_interval` default (its field registry, validation.py:18-27).
SIMPLETUNER_VALIDATION_INTERVAL = 100

#: Keys these functions read themselves (the key-by-key pass leaves them alone).
READ_HERE = (
    "lr_scheduler",
    "lr_warmup_steps",
    "lr_end",
    "lr_power",
    "optimizer_beta1",
    "optimizer_beta2",
    "seed",
    "tokenizer_max_length",
)

#: Optimizers whose gradients SimpleTuner never clips, whatever `max_grad_norm` says (trainer.py:7138-7142).
NEVER_CLIPPED = ("prodigy", "optimi-stableadamw")

#: SimpleTuner's SD3 T5 length: its default and its ceiling (helpers/models/sd3/model.py:853-859).
SIMPLETUNER_SD3_T5_LENGTH = 154


def _number(t: Translation, bare: Mapping[str, Any], key: str, default: Any) -> Any:
    try:
        return as_number(bare[key], key) if key in bare and not is_inert(bare[key]) else default
    except Problem as exc:
        t.problems.append(str(exc))
        return default


def lr_schedule(t: Translation, bare: Mapping[str, Any]) -> None:
    """SimpleTuner's schedule: `cosine` / `cosine_with_warmup` are its own cosine (`simpletuner_cosine` here, its
    floor `lr_end`, 4e-7 unless set); `constant` with a warm-up is `constant_with_warmup` (cli_utils.py:48-65);
    `polynomial` decays with its `lr_end` 4e-7 and `lr_power` 0.8 (custom_schedule.py:535-543); `lr_end` /
    `lr_power` are ignored by the schedules that do not read them."""
    given = "lr_scheduler" in bare
    name = str(bare.get("lr_scheduler", SIMPLETUNER_DEFAULTS["lr_scheduler"])).strip()
    source = "lr_scheduler" if given else "SimpleTuner's default lr_scheduler"
    warmup = _number(t, bare, "lr_warmup_steps", 0)
    if "lr_warmup_steps" in bare:
        t.put("lr_warmup_steps", warmup, "lr_warmup_steps")
    if name == "cosine_with_restarts":
        t.problems.append(
            "`lr_scheduler: cosine_with_restarts`: SimpleTuner's cosine_with_restarts never leaves the peak learning "
            "rate (its own log warns it misbehaves: its trainer steps it with arguments its class does not take), so "
            "it trains at a constant rate. Use `constant` for what it did, or `cosine` for SimpleTuner's cosine, which "
            "falls to `lr_end` and rises again every `lr_warmup_steps` steps"
        )
        return
    ours = LR_SCHEDULERS.get(name)
    if ours is None:
        known = ", ".join(k for k, v in LR_SCHEDULERS.items() if v is not None)
        t.problems.append(f"`lr_scheduler`: {name!r} is not supported here; SimpleTuner values that work here: {known}")
        return
    if ours == "constant" and warmup > 0:
        ours = "constant_with_warmup"
        t.report.mapped.append(
            f"`lr_scheduler: constant` with `lr_warmup_steps: {warmup}` -> `constant_with_warmup` (SimpleTuner's "
            "argument parsing turns it so, cli_utils.py:64-65)"
        )
    elif ours == "simpletuner_cosine":
        half = f"{warmup} optimizer steps" if warmup > 0 else "1000 / processes optimizer steps (`lr_warmup_steps` 0)"
        t.report.mapped.append(
            f"`lr_scheduler: {name}` -> `simpletuner_cosine` (SimpleTuner's own cosine: no warm-up ramp, from "
            f"`learning_rate` down to `lr_end` and back, a half-period of {half})"
        )
    elif given:
        t.report.mapped.append(f"`lr_scheduler: {name}` -> `{ours}`")
    t.put("lr_scheduler", ours, source)
    for key, default, readers in (
        ("lr_end", SIMPLETUNER_LR_END, LR_END_DEFAULTS),
        ("lr_power", SIMPLETUNER_LR_POWER, LR_POWER_DEFAULTS),
    ):
        if ours not in readers:
            if key in bare:
                t.ignore(key, f"not read by SimpleTuner's `{name}` schedule")
            continue
        value = _number(t, bare, key, default)
        t.put(key, value, key if key in bare else f"SimpleTuner's default {key}")
        if key in bare:
            t.report.mapped.append(f"`{key}`")
        else:
            t.report.defaults.append(f"`{key}: {value!r}` (SimpleTuner's default, read by its `{name}` schedule)")


def optimizer_settings(t: Translation, bare: Mapping[str, Any]) -> None:
    """The optimizer as SimpleTuner builds it: its own defaults (betas, eps, weight decay, SGD momentum) where the
    config's `optimizer_config` does not set them, and `optimizer_beta1` + `optimizer_beta2` over both (given
    together or not at all: SimpleTuner stops on one alone, cmd_args.py:1079-1082)."""
    beta1, beta2 = bare.get("optimizer_beta1"), bare.get("optimizer_beta2")
    if (beta1 is None) != (beta2 is None):
        t.problems.append(
            "`optimizer_beta1` and `optimizer_beta2` are read together (SimpleTuner stops when only one is set): set "
            "both, or neither"
        )
    elif beta1 is not None:
        for ours, value in (("adam_beta1", beta1), ("adam_beta2", beta2)):
            if t.sources.get(ours) == "optimizer_config:betas":
                t.ignore("optimizer_config: betas", "`optimizer_beta1` / `optimizer_beta2` win, as in SimpleTuner")
                del t.sources[ours]
            t.put(ours, plain(value), f"optimizer_beta{ours[-1]}")
        t.report.mapped.append("`optimizer_beta1`, `optimizer_beta2` -> `adam_beta1`, `adam_beta2`")
    name = str(bare.get("optimizer", SIMPLETUNER_DEFAULTS["optimizer"])).strip()
    if name in NEVER_CLIPPED and t.out.get("max_grad_norm") is not None:
        if "max_grad_norm" in bare:
            t.report.overridden.append(
                f"`max_grad_norm: {bare['max_grad_norm']!r}` -> none: SimpleTuner never clips gradients for "
                f"`{name}` (trainer.py:7138-7142), so this run does not either"
            )
        else:
            t.report.defaults.append(f"`max_grad_norm`: none (SimpleTuner never clips `{name}`, trainer.py:7138-7142)")
        t.out["max_grad_norm"] = None
        t.sources["max_grad_norm"] = f"SimpleTuner's {name}"
    for ours, (value, where) in SIMPLETUNER_OPTIMIZER_DEFAULTS.get(name, {}).items():
        if ours.startswith("optimizer_config."):
            setting = ours.split(".", 1)[1]
            current = t.out.get("optimizer_config", {})
            if setting not in current:
                t.out["optimizer_config"] = {**current, setting: value}
                t.report.defaults.append(f"`{ours}: {value!r}` (SimpleTuner's {name} default, {where})")
            continue
        if not t.is_set(ours):
            t.put(ours, value, f"SimpleTuner's {name} default")
            t.report.defaults.append(f"`{ours}: {value!r}` (SimpleTuner's {name} default, {where})")


def _force(t: Translation, bare: Mapping[str, Any], forced: Mapping[str, tuple[str, Any, str]], why: str) -> None:
    for key, (ours, value, where) in forced.items():
        given = bare.get(key)
        if given is not None and plain(given) != value:
            t.report.overridden.append(
                f"`{key}: {given!r}` -> {value!r}: SimpleTuner forces it for {why} ({where}) whatever the config "
                "says, so this run uses it too"
            )
        elif given is None:
            t.report.defaults.append(f"`{key}: {value!r}` (SimpleTuner forces it for {why}, {where})")
        t.out[ours] = value
        t.sources[ours] = f"SimpleTuner's setting for {why}"


def forced_settings(t: Translation, bare: Mapping[str, Any]) -> None:
    """What SimpleTuner's model class sets for the family and flavour whatever the config says (`check_user_config`,
    `setup_model_flavour`): bucket alignment, SD 2.x's zero-terminal-SNR betas, Wan 2.2 I2V A14B's flow shift 5.0
    and its validation steps and guidance, FluxBooru's guidance 3.5."""
    family = t.family or ""
    flavour = bare.get("model_flavour")
    flavour = str(flavour).strip() if isinstance(flavour, str) and flavour else None
    if flavour is not None and (family, flavour) in FLAVOUR_FORCED_UNSUPPORTED:
        t.problems.append(f"`model_flavour`: {flavour!r}: {FLAVOUR_FORCED_UNSUPPORTED[(family, flavour)]}")
        return
    forced = dict(FAMILY_FORCED.get(family, {}))
    if family == "qwen_image" and not is_inert(bare.get("i_know_what_i_am_doing")):
        forced.pop("aspect_bucket_alignment")  # qwen_image/model.py:1841-1856: the switch lifts it there
    forced.update(FLAVOUR_FORCED.get((family, flavour or ""), {}))
    if "validation_num_inference_steps" in forced or "validation_guidance" in forced:
        if not t.out.get("validation_prompt"):  # validation settings without validation: nothing to force
            forced.pop("validation_num_inference_steps", None)
            forced.pop("validation_guidance", None)
    label = f"model_family {family}" + (f", model_flavour {flavour}" if flavour else "")
    _force(t, bare, forced, label)


def validation_cadence(t: Translation, bare: Mapping[str, Any]) -> None:
    """SimpleTuner validates every `validation_step_interval` steps, 100 when unset (validation.py:18-27)."""
    if not t.out.get("validation_prompt") or t.is_set("validation_steps"):
        return
    t.put("validation_steps", SIMPLETUNER_VALIDATION_INTERVAL, "SimpleTuner's default validation_step_interval")
    t.report.defaults.append(
        f"`validation_step_interval: {SIMPLETUNER_VALIDATION_INTERVAL}` (SimpleTuner's default: validation every "
        f"{SIMPLETUNER_VALIDATION_INTERVAL} steps)"
    )


def seed(t: Translation, bare: Mapping[str, Any]) -> None:
    """`seed`: mapped when set. SimpleTuner's default is none (`set_seed` is not called, trainer.py:2555), so each
    run draws differently; here an unset seed is 42, said at start: a fixed seed is what keeps crops (drawn
    once per image from the seed, and part of the latent cache's key) and resumes exact."""
    value = bare.get("seed")
    if value is not None and str(value).strip().lower() not in ("", "none", "null"):
        t.put("seed", plain(value), "seed")
        t.report.mapped.append("`seed`")
        return
    t.report.notes.append(
        "`seed` is not set: SimpleTuner would not seed the run (each run draws its own noise, timesteps and random "
        "crops); here it is 42, so random crops, the latent cache built on them and a resumed run stay the same. "
        "Set `seed` to choose another"
    )


def prompt_length(t: Translation, bare: Mapping[str, Any]) -> None:
    """`tokenizer_max_length`: SimpleTuner reads it for SD3's T5 only, 154 when unset and capped at 154 (unless
    `i_know_what_i_am_doing`); the other families here ignore it or fix their own length."""
    value = bare.get("tokenizer_max_length")
    if t.family != "sd3":
        if value is not None:
            t.ignore("tokenizer_max_length", f"SimpleTuner ignores it for {t.family} (the family's own length)")
        return
    length = _number(t, bare, "tokenizer_max_length", SIMPLETUNER_SD3_T5_LENGTH)
    if length > SIMPLETUNER_SD3_T5_LENGTH and not is_inert(bare.get("i_know_what_i_am_doing")):
        t.report.mapped.append("`tokenizer_max_length` -> `t5_max_length` (`i_know_what_i_am_doing` lifts the cap)")
    elif length > SIMPLETUNER_SD3_T5_LENGTH:
        t.report.overridden.append(
            f"`tokenizer_max_length: {length}` -> {SIMPLETUNER_SD3_T5_LENGTH}: SimpleTuner caps SD3's T5 length "
            "(sd3/model.py:856-859) unless `i_know_what_i_am_doing`, so this run uses it too"
        )
        length = SIMPLETUNER_SD3_T5_LENGTH
    elif value is not None:
        t.report.mapped.append("`tokenizer_max_length` -> `t5_max_length`")
    else:
        t.report.defaults.append(f"`t5_max_length: {length}` (SimpleTuner's SD3 T5 length, sd3/model.py:853-855)")
    t.put("t5_max_length", int(length), "tokenizer_max_length")


#: SimpleTuner's SD3 LoRA targets when `peft_lora_target_modules` is unset (helpers/models/sd3/model.py:122, 841-842).
SIMPLETUNER_SD3_LORA_TARGETS = ["to_k", "to_q", "to_v", "to_out.0"]


def lora_targets(t: Translation, bare: Mapping[str, Any]) -> None:
    """A standard SD3 LoRA adapts SimpleTuner's four attention projections unless the config lists modules
    (its other families' defaults equal ours; Flux's come from `flux_lora_target`)."""
    if t.family != "sd3" or t.out.get("training_type") != "lora" or t.out.get("lora_type", "standard") != "standard":
        return
    if t.is_set("lora_target_modules"):
        return
    t.put("lora_target_modules", list(SIMPLETUNER_SD3_LORA_TARGETS), "SimpleTuner's SD3 LoRA targets")
    t.report.defaults.append(
        f"`lora_target_modules: {SIMPLETUNER_SD3_LORA_TARGETS}` (SimpleTuner's SD3 LoRA targets, sd3/model.py:122)"
    )


def flux_guidance_range(t: Translation, bare: Mapping[str, Any]) -> None:
    """SimpleTuner draws `random.uniform(flux_guidance_min, flux_guidance_max)` (flux/model.py:697-703), which for
    min > max draws from [max, min]: the same range, written in order here."""
    low, high = t.out.get("flux_guidance_min"), t.out.get("flux_guidance_max")
    if low is None or high is None or low <= high:
        return
    t.out["flux_guidance_min"], t.out["flux_guidance_max"] = high, low
    t.report.notes.append(
        f"`flux_guidance_min: {low}` > `flux_guidance_max: {high}`: written in order ({high} to {low}), the range "
        "SimpleTuner's uniform draw covers"
    )


def sdxl_conditioning(t: Translation, bare: Mapping[str, Any]) -> None:
    """SDXL's size and crop ids follow diffusers' training script here; where SimpleTuner's differ, say so."""
    if t.family != "sdxl":
        return
    dropout = t.out.get("caption_dropout_probability") or 0
    t.approx(
        "model_family: sdxl (size and crop ids)",
        "each image's size before resizing and its crop offset condition the UNet, as in diffusers' SDXL script; "
        "SimpleTuner passes the resized size before the crop as the original size (collate.py:501-523)"
        + (
            f", and zeroes all six ids of a sample whose caption is dropped (collate.py:518-519; here, at "
            f"`caption_dropout_probability` {dropout}, they are kept)"
            if dropout
            else ""
        ),
    )


def unreadable_files(t: Translation, bare: Mapping[str, Any]) -> None:
    """SimpleTuner skips any number of unreadable images, logging each (metadata/backends/discovery.py:545-556):
    here a dataset stops the run only when none of it can be read (`max_bad_image_fraction` 1.0)."""
    if "max_bad_image_fraction" in t.out:  # our own key, written in the config
        return
    t.put("max_bad_image_fraction", 1.0, "SimpleTuner skips unreadable images")
    t.report.defaults.append(
        "`max_bad_image_fraction: 1.0` (SimpleTuner skips unreadable images however many: the run stops only when "
        "a dataset has none it can read; each skipped file is listed at the end of the scan)"
    )


def flow_sampling(t: Translation, bare: dict[str, Any]) -> None:
    """SimpleTuner's sigma draw for flow families: sigmoid(N(0, 1) * flow_sigmoid_scale), unless
    ``flow_use_uniform_schedule`` (uniform) or ``flow_use_beta_schedule`` (not supported) is on."""
    if t.our_family not in FLOW_MATCHING_FAMILIES:
        return
    try:
        uniform = as_bool(bare.get("flow_use_uniform_schedule", False), "flow_use_uniform_schedule")
        beta = as_bool(bare.get("flow_use_beta_schedule", False), "flow_use_beta_schedule")
        scale = as_number(bare.get("flow_sigmoid_scale", 1.0), "flow_sigmoid_scale")
    except Problem as exc:
        t.problems.append(str(exc))
        return
    if beta:
        t.problems.append("`flow_use_beta_schedule`: the beta sigma schedule is not supported: remove it")
    elif uniform:
        t.put("timestep_sampling", "uniform", "flow_use_uniform_schedule")
    else:
        t.put("timestep_sampling", "logit_normal", "SimpleTuner's default sigmoid schedule")
        t.put("logit_mean", 0.0, "SimpleTuner's default sigmoid schedule")
        t.put("logit_std", float(scale), "flow_sigmoid_scale" if "flow_sigmoid_scale" in bare else "its default 1.0")
        t.report.defaults.append(
            "`timestep_sampling: logit_normal`, `logit_std: "
            f"{float(scale)}` (SimpleTuner's sigmoid sigma schedule for flow models)"
        )


def flux_lora_target(t: Translation, bare: Mapping[str, Any]) -> None:
    """SimpleTuner's Flux LoRA adapts the layers `flux_lora_target` names (default `all`), not our default."""
    if t.our_family != "flux" or t.out.get("training_type") != "lora":
        if "flux_lora_target" in bare:
            t.ignore("flux_lora_target", "not a Flux LoRA")
        return
    if t.out.get("lora_type", "standard") != "standard" or t.is_set("lora_target_modules"):
        if "flux_lora_target" in bare:
            t.ignore("flux_lora_target", "the LyCORIS preset or `peft_lora_target_modules` picks the layers")
        return
    if t.out.get("controlnet"):  # SimpleTuner sets `controlnet` whatever is given (flux/model.py:1242-1247)
        if "flux_lora_target" in bare:
            t.ignore("flux_lora_target", "a ControlNet LoRA adapts the ControlNet's layers, SimpleTuner's `controlnet`")
        return
    name = str(bare.get("flux_lora_target", "all"))
    if name not in FLUX_LORA_TARGETS:
        t.problems.append(
            f"`flux_lora_target` = {name!r} is not supported here (supported: {', '.join(FLUX_LORA_TARGETS)}); "
            "or list the layers in `peft_lora_target_modules`"
        )
        return
    t.put("lora_target_modules", FLUX_LORA_TARGETS[name], "flux_lora_target")
    if "flux_lora_target" in bare:
        t.report.mapped.append(f"`flux_lora_target: {name}` -> `lora_target_modules`")
    else:
        t.report.defaults.append("`flux_lora_target: 'all'` (SimpleTuner's default) -> `lora_target_modules`")


def validation_defaults(t: Translation, bare: Mapping[str, Any]) -> None:
    """SimpleTuner's validation defaults that depend on the family: Wan renders the pipeline's 81 frames;
    families with a negative prompt get SimpleTuner's default one (flux has none)."""
    if not t.out.get("validation_prompt"):
        return
    family = t.our_family
    if family == "wan" and "validation_num_video_frames" not in bare:
        t.put("validation_num_video_frames", 81, "SimpleTuner's default (the Wan pipeline's 81 frames)")
        t.report.defaults.append("`validation_num_video_frames: 81` (the Wan pipeline's default, as SimpleTuner)")
    if family != "flux" and "validation_negative_prompt" not in bare:
        t.put("validation_negative_prompt", "blurry, cropped, ugly", "SimpleTuner's default negative prompt")
        t.report.defaults.append("`validation_negative_prompt: 'blurry, cropped, ugly'` (SimpleTuner's default)")


def optimizer_meaning(t: Translation, bare: Mapping[str, Any]) -> None:
    """What differs for SimpleTuner's optimizers that map here."""
    optimizer = t.out.get("optimizer")
    if optimizer == "prodigy":
        given = t.out.get("learning_rate")
        t.out["learning_rate"] = 1.0
        t.sources["learning_rate"] = "optimizer: prodigy"
        t.approx(
            "optimizer: prodigy",
            "SimpleTuner's `prodigy` is prodigy-plus-schedule-free; here it is prodigyopt's Prodigy (no schedule-free "
            f"averaging), and its learning rate is 1.0 as SimpleTuner passes it (the config's {given!r} is not used)",
        )
    elif optimizer == "adamw_bf16":
        t.approx(
            "optimizer: adamw_bf16",
            "the trained weights are fp32 here (adapters, and full fine-tunes), so the update is exact AdamW; "
            "SimpleTuner keeps bf16 weights and rounds each update stochastically",
        )


def noise_offset(t: Translation, bare: Mapping[str, Any]) -> None:
    """SimpleTuner adds `noise_offset` (default 0.1, with `noise_offset_probability`, default 0.25) only
    when `offset_noise` is on, and never to flow-matching models."""
    given = [k for k in ("offset_noise", "noise_offset", "noise_offset_probability") if k in bare]
    if not given:
        return
    try:
        on = as_bool(bare.get("offset_noise", False), "offset_noise")
    except Problem as exc:
        t.problems.append(str(exc))
        return
    if not on:
        for key in given:
            t.ignore(key, "`offset_noise` is off: SimpleTuner adds no noise offset")
        return
    if t.our_family in FLOW_MATCHING_FAMILIES:
        for key in given:
            t.ignore(key, "SimpleTuner adds no noise offset to flow-matching models")
        return
    t.put("noise_offset", plain(bare.get("noise_offset", 0.1)), "noise_offset")
    t.put("noise_offset_probability", plain(bare.get("noise_offset_probability", 0.25)), "noise_offset_probability")
    t.report.mapped.append(
        "`offset_noise` + `noise_offset` + `noise_offset_probability` -> `noise_offset`, `noise_offset_probability`"
    )
