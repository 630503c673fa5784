"""SimpleTuner meanings that span several keys, or that its code decides whatever the config says: the
learning-rate schedule, the optimizer's own defaults, settings forced per family and flavour, the validation
cadence and the seed. Each function reads the whole config (``t.bare``) after the key-by-key pass of
:func:`simpletuner.configuration.dialect.translate` and writes what SimpleTuner would run.

Where SimpleTuner's code replaces a value the config sets (a flavour's flow shift, a family's bucket
alignment), the translation does the same and says so at WARNING (``Report.overridden``): the run means what
it meant there, and the user sees that their value was not what SimpleTuner trained with either.
"""

from __future__ import annotations

from typing import Any, Mapping

from simpletuner.configuration.dialect_read import Problem, Translation, as_number, is_inert, plain
from simpletuner.configuration.dialect_values import (
    FAMILY_FORCED,
    FLAVOUR_FORCED,
    FLAVOUR_FORCED_UNSUPPORTED,
    LR_SCHEDULERS,
    SIMPLETUNER_DEFAULTS,
    SIMPLETUNER_OPTIMIZER_DEFAULTS,
)
from simpletuner.configuration.schedules import LR_END_DEFAULTS, LR_POWER_DEFAULTS, SIMPLETUNER_LR_END

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
NEVER_CLIPPED = ("prodigy",)

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
    if (family, flavour) in FLAVOUR_FORCED_UNSUPPORTED:
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
