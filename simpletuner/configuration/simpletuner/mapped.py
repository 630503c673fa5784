"""What each top-level SimpleTuner key that has a counterpart here means (``CORE``), and how its value is
written into the native config.
"""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path
from typing import Any, Optional

from simpletuner.configuration.families import FLOW_MATCHING_FAMILIES
from simpletuner.configuration.model_folder import looks_like_hub_id, normalise_repo_id
from simpletuner.configuration.optimizer_settings import parse_optimizer_config
from simpletuner.configuration.simpletuner.facts import (
    APPROXIMATED_PRECISIONS,
    FLAVOUR_APPROXIMATED,
    FLAVOUR_UNSUPPORTED,
    FLAVOURS,
    LIFTED_OPTIMIZER_SETTINGS,
    LYCORIS_KEYS,
    MIXED,
    OPTIMIZERS,
    PRECISIONS,
    SIMPLETUNER_FAMILIES,
    SIMPLETUNER_REMOVED_OPTIMIZERS,
    SIMPLETUNER_UPLOAD_DEFAULTS,
)
from simpletuner.configuration.simpletuner.reading import (
    DialectKey,
    Problem,
    Translation,
    as_bool,
    as_number,
    is_inert,
    key_row,
    plain,
    read_json_file,
    rename,
    set_spelled,
)


def _model_family(t: Translation, value: Any, entry: DialectKey) -> None:
    text = str(value).strip()
    ours = SIMPLETUNER_FAMILIES.get(text)
    if ours is None:
        t.problems.append(
            f"`model_family`: {text!r} is not a family this trainer trains; the SimpleTuner families that work "
            f"here are {', '.join(SIMPLETUNER_FAMILIES)}"
        )
        return
    t.put("model_family", ours, entry.key)


def resolve_flavour(t: Translation, flavour: str, model_path: Any) -> None:
    """What ``model_flavour`` means here: Wan 2.2 ``-high`` / ``-low`` set ``train_stages`` and
    ``ti2v-5b-2.2`` sets ``ti2v_first_frame``; a flavour of a kind not trained here stops, one trained with a
    difference is approximated (``kontext``: the model folder's FluxKontextPipeline picks the Kontext spec); without
    ``pretrained_model_name_or_path`` the model is the flavour's hub id, as SimpleTuner loads it."""
    family = t.family or ""
    table = FLAVOURS.get(family, {})
    if flavour not in table:
        known = ", ".join(table) or "none"
        t.problems.append(f"`model_flavour`: {flavour!r} is not a SimpleTuner flavour of {family!r} (known: {known})")
        return
    for marker, why in FLAVOUR_UNSUPPORTED.items():
        if flavour.startswith(marker):
            t.problems.append(f"`model_flavour`: {flavour!r}: {why}")
            return
    if flavour in FLAVOUR_APPROXIMATED:
        t.approx("model_flavour", f"{flavour!r}: {FLAVOUR_APPROXIMATED[flavour]}")
    if flavour.endswith("-high") or flavour.endswith("-low"):
        t.put("train_stages", flavour.rsplit("-", 1)[1], "model_flavour")
    if flavour.startswith("ti2v"):  # SimpleTuner trains TI2V-5B with the first frame as the condition
        t.put("ti2v_first_frame", True, "model_flavour")
    if model_path is None and "pretrained_model_name_or_path" not in t.sources:
        t.put("pretrained_model_name_or_path", table[flavour], "model_flavour")


def _same_folder(t: Translation, value: Any, entry: DialectKey) -> None:
    """A component path that names the model folder itself (or nothing) asks for nothing extra."""
    model = t.bare.get("pretrained_model_name_or_path")
    if is_inert(value) or value == model:
        t.ignore(entry.key, "the model folder itself")
    else:
        t.problems.append(f"`{entry.key}` = {value!r}: {entry.note}")


def _model_path(t: Translation, value: Any, entry: DialectKey) -> None:
    """A local folder, relative ones from the working directory as SimpleTuner reads them (made absolute, so
    a missing one is reported there, not beside the config file); an ``org/name`` that is not a folder there is a
    hub id, loaded from the Hub as SimpleTuner loads it (simpletuner.hub). Unset (null, ""), a ``model_flavour``
    or the family's default flavour names the model, as in SimpleTuner."""
    if is_inert(value):
        return
    if isinstance(value, str) and value:
        local = os.path.normpath(os.path.join(t.cwd, os.path.expanduser(value)))
        if os.path.isdir(local) or not looks_like_hub_id(value):
            value = local
    t.put("pretrained_model_name_or_path", value, entry.key)


#: SimpleTuner's families that keep a VAE whose path names `sdxl` (cmd_args.py:985-995 drops it for the others).
_SDXL_VAE_FAMILIES = ("sdxl", "pixart_sigma", "kolors")
#: SimpleTuner's default for `pretrained_vae_model_name_or_path` (its field registry, sections/model.py:1126): the
#: SDXL fp16-fix VAE, which the rule above drops for every other family.
_ST_DEFAULT_VAE = "madebyollin/sdxl-vae-fp16-fix"


def _st_location(t: Translation, value: Any) -> Any:
    """A model path as SimpleTuner's ``from_pretrained`` reads it: a folder from the working directory, made
    absolute; an ``org/name`` that is not a folder there stays a hub id."""
    if not isinstance(value, str) or not value:
        return value
    local = os.path.normpath(os.path.join(t.cwd, os.path.expanduser(value)))
    return local if os.path.isdir(local) or not looks_like_hub_id(value) else value


def _vae_path(t: Translation, value: Any, entry: DialectKey) -> None:
    """SimpleTuner's ``vae_path`` (cmd_args.py:1070-1074): this key, else the model; load_vae (common.py:2690-2703)
    reads ``subfolder="vae"`` first, then the root, as here. null, "" and "''" are not passed to its parser
    (configuration/loader.py:139), so its default stands: :data:`_ST_DEFAULT_VAE`. A path naming `sdxl` with a family
    other than sdxl is dropped with a warning (cmd_args.py:985-995): the model's own VAE, as is the model folder
    itself. SimpleTuner passes `revision` to the VAE's repo too (common.py:2693); here `revision` is the model's and
    a hub VAE loads at its default branch."""
    is_default = is_inert(value) or value == "''"
    vae = _ST_DEFAULT_VAE if is_default else str(value)
    if "sdxl" in vae and t.family not in _SDXL_VAE_FAMILIES:
        t.ignore(entry.key, f"{vae!r} names `sdxl`: SimpleTuner drops it for {t.family} and loads the model's own VAE")
        return
    model = t.bare.get("pretrained_model_name_or_path")
    location = _st_location(t, vae)
    if vae == model or location == _st_location(t, model):
        t.ignore(entry.key, "the model folder itself: its own VAE")
        return
    revision = t.bare.get("revision")
    if location == vae and not is_inert(revision) and str(revision) != "main":
        t.approx(
            entry.key,
            f"the hub VAE {vae!r} loads at its default branch: SimpleTuner asks its repo for `revision` {revision!r} "
            "too, which only a repo with that branch, tag or commit has",
        )
    t.put("pretrained_vae_model_name_or_path", location, entry.key)
    if is_default:
        t.report.defaults.append(f"`{entry.key}: {_ST_DEFAULT_VAE!r}` (SimpleTuner's default, for {value!r})")


def _path_key(t: Translation, value: Any, entry: DialectKey) -> None:
    assert entry.ours is not None
    t.put(entry.ours, t.path(value, entry.key), entry.key)


def _resume(t: Translation, value: Any, entry: DialectKey) -> None:
    """`latest`, or the folder of that name inside `output_dir`: SimpleTuner keeps only the last part of the path
    (trainer.py:5022-5023) and looks for it in its output folder (5048-5049)."""
    if is_inert(value):
        return
    if value == "latest":
        t.put("resume_from_checkpoint", value, entry.key)
        return
    name = os.path.basename(str(value).rstrip("/"))
    output_dir = t.path(t.bare.get("output_dir", "simpletuner-results"), "output_dir")
    t.put("resume_from_checkpoint", os.path.join(output_dir, name), entry.key)
    if os.path.normpath(t.path(value, entry.key)) != os.path.join(output_dir, name):
        t.report.notes.append(f"`resume_from_checkpoint: {value}`: resumed from {name!r} inside `output_dir`, as there")


def _unset_at_zero(t: Translation, value: Any, entry: DialectKey) -> None:
    """A count where SimpleTuner reads 0 as "off" / "no limit" / "use the default": unset here too."""
    if is_inert(value):
        t.ignore(entry.key, "0: unset, as SimpleTuner reads it")
        return
    assert entry.ours is not None
    t.put(entry.ours, plain(value), entry.key)


def _guidance_embedded(t: Translation) -> Optional[bool]:
    """Whether the Flux folder's transformer takes embedded guidance (None: its config cannot be read here)."""
    model = t.out.get("pretrained_model_name_or_path", t.bare.get("pretrained_model_name_or_path"))
    try:
        config = json.loads((Path(str(model)) / "transformer" / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return bool(config.get("guidance_embeds", False))


def _flux_guidance(t: Translation, value: Any, entry: DialectKey) -> None:
    """SimpleTuner passes guidance only to Flux transformers that embed it (flux/model.py:728-731)."""
    if t.our_family != "flux":
        t.ignore(entry.key, "SimpleTuner reads it for Flux only")
        return
    if _guidance_embedded(t) is False:
        t.ignore(entry.key, "the model's transformer has no guidance embedding: SimpleTuner passes no guidance")
        return
    t.put(entry.key, value if entry.key == "flux_guidance_mode" else float(as_number(value, entry.key)), entry.key)


def _precision(t: Translation, value: Any, entry: DialectKey) -> None:
    set_spelled(PRECISIONS, "quanto int8 / fp8 / int4 / int2 and torchao int8 / fp8 kinds")(t, value, entry)
    if str(value).strip() in APPROXIMATED_PRECISIONS:
        t.approx(f"{entry.key}: {value}", APPROXIMATED_PRECISIONS[str(value).strip()])


def _ema_device(t: Translation, value: Any, entry: DialectKey) -> None:
    cpu_only = t.bare.get("ema_cpu_only")
    if cpu_only is not None and as_bool(cpu_only, "ema_cpu_only"):
        if str(value) != "cpu":
            t.report.overridden.append(
                f"`ema_device: {value!r}` -> 'cpu': `ema_cpu_only` wins in SimpleTuner (cmd_args.py:1076-1077)"
            )
        t.ignore(entry.key, "`ema_cpu_only` sets it")
        return
    rename(t, value, entry)


def _ema_cpu_only(t: Translation, value: Any, entry: DialectKey) -> None:
    """`ema_cpu_only` sets the EMA's device to the CPU whatever `ema_device` says (cmd_args.py:1076-1077)."""
    if not as_bool(value, entry.key):
        return
    t.out["ema_device"] = "cpu"
    t.sources["ema_device"] = entry.key


def _use_ema(t: Translation, value: Any, entry: DialectKey) -> None:
    on = as_bool(value, entry.key)
    t.put("use_ema", on, entry.key)
    if not on:  # nothing averaged: nothing differs
        t.ignore(entry.key, "off")


def _target_modules(t: Translation, value: Any, entry: DialectKey) -> None:
    """SimpleTuner's `peft_lora_target_modules`: a list, a JSON list in a string, or the path of a JSON file
    holding one (cmd_args.py:280-330)."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise Problem(f"`{entry.key}`: {text!r} is not a JSON list: {exc}") from None
        else:
            value = read_json_file(t, Path(t.path(text, entry.key)), entry.key, list, "a JSON list of module names")
            if value is None:
                return
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise Problem(f"`{entry.key}` must be a list of module names")
    t.put("lora_target_modules", value, entry.key)


#: The keys of a `tread_config` route SimpleTuner reads (helpers/models/wan/transformer.py:1013-1193).
_TREAD_ROUTE_KEYS = ("selection_ratio", "start_layer_idx", "end_layer_idx")


def _tread(t: Translation, value: Any, entry: DialectKey) -> None:
    """SimpleTuner's `tread_config`: an object, or a Python-literal string of one (cmd_args.py:761-766 reads it with
    ``ast.literal_eval``); each route's three keys, any other key unread (as there). null: no routing."""
    if is_inert(value):
        return
    if isinstance(value, str):
        text = value.strip()
        try:
            value = ast.literal_eval(text) if text.startswith("{") else None
        except (ValueError, SyntaxError) as exc:
            raise Problem(f"`{entry.key}`: {text!r} is not an object: {exc}") from None
    if not isinstance(value, dict):
        raise Problem(f'`{entry.key}` must be an object: {{"routes": [{{"selection_ratio": 0.5, ...}}]}}')
    routes = value.get("routes")
    if isinstance(routes, list):
        kept = []
        for i, route in enumerate(routes):
            if isinstance(route, dict):
                for key in sorted(set(route) - set(_TREAD_ROUTE_KEYS)):
                    t.ignore(f"{entry.key}.routes[{i}].{key}", "SimpleTuner's router reads no such key")
                route = {k: plain(v) for k, v in route.items() if k in _TREAD_ROUTE_KEYS}
            kept.append(route)
        value = {**value, "routes": kept}
    t.put("tread_config", value, entry.key)


def _epochs(t: Translation, value: Any, entry: DialectKey) -> None:
    try:
        epochs = as_number(value, entry.key)
    except Problem as exc:
        t.problems.append(str(exc))
        return
    if epochs == 0:  # SimpleTuner: 0 epochs means "train for max_train_steps"
        t.report.mapped.append("`num_train_epochs: 0` -> unset (`max_train_steps` decides)")
        return
    t.put("num_train_epochs", epochs, entry.key)


def _max_steps(t: Translation, value: Any, entry: DialectKey) -> None:
    try:
        steps = as_number(value, entry.key)
    except Problem as exc:
        t.problems.append(str(exc))
        return
    if steps == 0:
        return  # SimpleTuner: 0 means "use num_train_epochs"
    t.put("max_train_steps", steps, entry.key)


def _inverted_tf32(t: Translation, value: Any, entry: DialectKey) -> None:
    try:
        t.put("enable_tf32", not as_bool(value, entry.key), entry.key)
    except Problem as exc:
        t.problems.append(str(exc))


def _snr_gamma(t: Translation, value: Any, entry: DialectKey) -> None:
    if is_inert(value):
        return  # SimpleTuner: no gamma, no Min-SNR weighting
    if t.our_family in FLOW_MATCHING_FAMILIES:
        t.ignore(entry.key, "SimpleTuner applies Min-SNR to DDPM families only (common.py:6360-6398)")
        return
    t.put("snr_gamma", plain(value), entry.key)
    t.put("loss_weighting", "min_snr", entry.key)


def _report_to(t: Translation, value: Any, entry: DialectKey) -> None:
    text = str(value).strip().lower()
    if text in ("none", "", "null"):
        t.put("report_to", "none", entry.key)
    elif text in ("tensorboard", "wandb"):
        t.put("report_to", text, entry.key)
    else:
        t.problems.append(
            f"`report_to`: {value!r}: this trainer logs to `tensorboard` or `wandb` (one tracker), or `none`"
        )


def _push_to_hub(t: Translation, value: Any, entry: DialectKey) -> None:
    """Upload the final weights. SimpleTuner waits for its checkpoint uploads unless `push_to_hub_background`
    is set (its default false, publishing.py:115; trainer.py:2214-2226); ours runs them beside training, so a
    config that uploads and leaves the key out gets SimpleTuner's `false` written, and the report says so."""
    if value is None:  # SimpleTuner's reader skips null (cli_utils.py:191): its default, off
        return
    on = as_bool(value, entry.key)
    t.put("push_to_hub", on, entry.key)
    if on and t.bare.get("push_to_hub_background") is None:
        default = SIMPLETUNER_UPLOAD_DEFAULTS["push_to_hub_background"]
        t.put("push_to_hub_background", default, "SimpleTuner's default push_to_hub_background")
        t.report.defaults.append(
            f"`push_to_hub_background: {default!r}` (SimpleTuner's default: training waits for each checkpoint "
            "upload; the config uploads and does not set it)"
        )


def _push_checkpoints(t: Translation, value: Any, entry: DialectKey) -> None:
    """Checkpoint uploads happen only with `push_to_hub`: without it SimpleTuner's upload returns before any
    request (helpers/publishing/huggingface.py:236-237), so the key is ignored rather than refused."""
    if value is None:
        return
    on = as_bool(value, entry.key)
    if on and not _is_on(t.bare.get("push_to_hub")):
        t.ignore(entry.key, "without `push_to_hub` SimpleTuner uploads nothing")
        return
    t.put("push_checkpoints_to_hub", on, entry.key)


def _is_on(value: Any) -> bool:
    try:
        return value is not None and as_bool(value, "")
    except Problem:
        return False  # the key's own row reports the value


def _hub_model_id(t: Translation, value: Any, entry: DialectKey) -> None:
    """The repo, a huggingface.co URL read as its id (helpers/publishing/huggingface.py:40-56). Unset spellings
    leave it unset: the repo is then `tracker_project_name`, as in SimpleTuner (huggingface.py:30)."""
    if is_inert(value):
        if isinstance(value, str) and value.strip():  # "None", "null", ...: SimpleTuner would take the text
            t.report.notes.append(
                f"`hub_model_id: {value!r}` read as unset (the repo is `tracker_project_name`); SimpleTuner would "
                f"upload to a repo named {value.strip()!r}"
            )
        t.ignore(entry.key, "unset: the repo is `tracker_project_name`")
        return
    t.put("hub_model_id", normalise_repo_id(str(value)), entry.key)


def _model_card_note(t: Translation, value: Any, entry: DialectKey) -> None:
    """Text as written (SimpleTuner's argument is a string); null or "" adds no note (metadata.py:428-433)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return
    t.put("model_card_note", str(value), entry.key)


def _flag(t: Translation, value: Any, entry: DialectKey) -> None:
    """A SimpleTuner switch (true / false, also as strings) onto our boolean of the same name; null is skipped by
    SimpleTuner's reader (cli_utils.py:191), so its default holds (upload settings: the same here)."""
    assert entry.ours is not None
    if value is None:
        return
    t.put(entry.ours, as_bool(value, entry.key), entry.key)


def _validation_prompt(t: Translation, value: Any, entry: DialectKey) -> None:
    if is_inert(value):
        return
    t.put("validation_prompt", value, entry.key)


def _lora_format(t: Translation, value: Any, entry: DialectKey) -> None:
    """`comfyui` (any case) saves a peft LoRA under ComfyUI's names, anything else in diffusers' format
    (lora_format.py:17-28); SimpleTuner renames only the file `save_lora_weights` writes (common.py:2072-2122), so a
    LyCORIS or full run keeps its format, here too."""
    if not (isinstance(value, str) and value.strip().lower() == "comfyui"):
        t.ignore(entry.key, "diffusers' format, as here")
    elif str(t.bare.get("model_type", "lora")).strip().lower() != "lora" or (
        str(t.bare.get("lora_type", "standard")).strip().lower() == "lycoris"
    ):
        t.ignore(entry.key, "SimpleTuner renames a peft LoRA's file only")
    elif _is_on(t.bare.get("use_dora")):
        t.ignore(entry.key, "a DoRA adapter gets no ComfyUI file here (its magnitudes have no ComfyUI names)")
    else:
        t.put("output_formats", ["diffusers", "comfyui"], entry.key)


def _lycoris_config(t: Translation, value: Any, entry: DialectKey) -> None:
    """The LyCORIS JSON file becomes the `lycoris` table. SimpleTuner reads it only with `lora_type: lycoris`
    (cmd_args.py:1116), from the working directory, then beside the config file."""
    if str(t.bare.get("lora_type", "standard")).strip().lower() != "lycoris":
        t.ignore(entry.key, "read only with `lora_type: lycoris`, as in SimpleTuner")
        return
    path = Path(t.path(value, entry.key))
    if not path.is_file() and t.config_dir is not None and (t.config_dir / str(value)).is_file():
        path = t.config_dir / str(value)
    settings = read_json_file(t, path, "lycoris_config", dict, "a JSON object")
    if settings is None:
        return
    t.report.notes.append(f"LyCORIS settings read from {path}")
    for key, item in settings.items():
        ours = LYCORIS_KEYS.get(key)
        if ours is None:
            t.problems.append(f"`lycoris_config` ({path}): `{key}` is not supported here: remove it")
            continue
        t.put(ours, plain(item), f"lycoris_config:{key}")
        t.report.mapped.append(f"`lycoris_config:{key}` -> `{ours}`")


def _data_backend_config(t: Translation, value: Any, entry: DialectKey) -> None:
    """Found as SimpleTuner finds it: from the working directory, then beside the config file."""
    if not isinstance(value, str) or not value:
        t.problems.append("`data_backend_config` must be the path of a multidatabackend JSON file")
        return
    candidates = [Path(os.path.expanduser(value))]
    if not candidates[0].is_absolute():
        candidates = [t.cwd / candidates[0]] + ([t.config_dir / value] if t.config_dir is not None else [])
    found = next((p for p in candidates if p.is_file()), None)
    if found is None:
        tried = " and ".join(str(p) for p in candidates)
        t.problems.append(f"`data_backend_config`: {value!r} not found (looked at {tried})")
        return
    entries = read_json_file(t, found, "data_backend_config", list, "a JSON list of dataset entries")
    if entries is None:
        return
    t.report.notes.append(f"datasets read from {found}")
    t.out["__datasets__"] = entries


def _same(key: str, ours: Optional[str] = None, note: str = "", **kw: Any) -> DialectKey:
    return key_row(key, "same", ours or key, note, **kw)


def _text_encoder_lr(t: Translation, value: Any, entry: DialectKey) -> None:
    """Written with `train_text_encoder` on; without it SimpleTuner warns and drops the rate (trainer.py:4100-4101)."""
    try:
        trains = as_bool(t.bare.get("train_text_encoder", False), "train_text_encoder")
    except Problem:  # its own row names the value
        trains = False
    if is_inert(value) or not trains:
        t.ignore(entry.key, "no text encoder trains: `train_text_encoder` is off")
        return
    t.put("text_encoder_lr", as_number(value, entry.key), entry.key)


def _optimizer(t: Translation, value: Any, entry: DialectKey) -> None:
    removed = SIMPLETUNER_REMOVED_OPTIMIZERS.get(str(value).strip())
    if removed is not None:
        t.problems.append(f"`optimizer`: {value!r}: SimpleTuner itself stops on it ({removed})")
        return
    what = "optimi's, bitsandbytes' 8-bit AdamW / Lion, torch's AdamW / Adam / SGD / Adafactor, Prodigy, AdamW-bf16"
    set_spelled(OPTIMIZERS, what)(t, value, entry)


def _optimizer_config(t: Translation, value: Any, entry: DialectKey) -> None:
    """SimpleTuner's `key=value,...` string (or object); settings with a key of their own here move there."""
    try:
        settings = parse_optimizer_config(value)
    except ValueError as exc:
        t.problems.append(f"`optimizer_config`: {exc}")
        return
    if not isinstance(settings, dict):
        t.problems.append(f"`optimizer_config`: {value!r} is not `key=value,...` or an object")
        return
    rest = {}
    for key, item in settings.items():
        if key in LIFTED_OPTIMIZER_SETTINGS:
            t.put(LIFTED_OPTIMIZER_SETTINGS[key], item, f"optimizer_config:{key}")
        elif key == "betas" and isinstance(item, (list, tuple)) and len(item) in (2, 3):
            t.put("adam_beta1", item[0], "optimizer_config:betas")
            t.put("adam_beta2", item[1], "optimizer_config:betas")
            if len(item) == 3:  # optimi-adan's third beta
                rest["beta3"] = item[2]
        else:
            rest[key] = item
    if rest:
        t.put("optimizer_config", rest, entry.key)


#: The keys this module maps itself (the rest of the dialect is in unmapped.TAIL).
CORE: tuple[DialectKey, ...] = (
    # --- model ---
    _same("model_type", "training_type", "`lora` or `full`", values={"lora": "lora", "full": "full"}),
    _same("model_family", "model_family", "sd1x / sd2x / legacy -> `sd`", apply=_model_family),
    key_row(
        "model_flavour",
        "same",
        "pretrained_model_name_or_path",
        "without `pretrained_model_name_or_path`, the flavour's hub model is loaded from the Hub (as SimpleTuner "
        "does); Wan 2.2 `-high` / `-low` set `train_stages`",
    ),
    _same("pretrained_model_name_or_path", apply=_model_path),
    _same("prediction_type"),
    _same(
        "tokenizer_max_length",
        "t5_max_length",
        "sd3 only: SimpleTuner's T5 length, 154 when unset and at most 154 (sd3/model.py:853-859); the other "
        "families it trains here ignore it or fix their own length, and so does the translation",
    ),
    _same(
        "rescale_betas_zero_snr",
        note="sd / sdxl; SimpleTuner turns it on for every `sd2x` model (so does the translation) and ignores it "
        "for flow-matching families (common.py:4544-4549)",
        apply=lambda t, v, e: (
            t.ignore(e.key, "SimpleTuner rescales DDPM schedules only")
            if t.our_family in FLOW_MATCHING_FAMILIES
            else rename(t, v, e)
        ),
    ),
    _same("revision"),
    key_row(
        "pretrained_transformer_model_name_or_path",
        "unsupported",
        note="the denoiser is loaded from `pretrained_model_name_or_path`: put the transformer / UNet you want into "
        "that folder",
        apply=lambda t, v, e: _same_folder(t, v, e),
    ),
    key_row(
        "pretrained_t5_model_name_or_path",
        "unsupported",
        note="text encoders are loaded from `pretrained_model_name_or_path`: put the T5 you want into that folder",
        apply=lambda t, v, e: _same_folder(t, v, e),
    ),
    _same(
        "pretrained_vae_model_name_or_path",
        note="a folder (from the working directory) or a hub id holding the VAE, its `vae/` subfolder first; null: "
        f"SimpleTuner's default {_ST_DEFAULT_VAE}; a path naming `sdxl` with a family other than sdxl is dropped, as "
        "SimpleTuner drops it (the model's own VAE)",
        apply=_vae_path,
    ),
    key_row(
        "seed_for_each_device",
        "ignored",
        note="each process draws its own noise here (its generator is seeded from `seed` and its rank)",
    ),
    _same("aspect_bucket_alignment"),
    key_row(
        "base_model_precision",
        "approximated",
        "base_model_precision",
        note="the same quanto / torchao kind, on other layers: every Linear layer outside the model's "
        "`_keep_in_fp32_modules` is quantised here; SimpleTuner's quanto call also quantises Conv2d layers and keeps "
        "per-family layers in full precision (sd3 / wan: norms, `proj_out`, embeddings, feed-forward; flux: norms, "
        "`x_embedder`, `context_embedder`, `proj_out`; quantisation/__init__.py:474-540); `fp8-torchao` and "
        "`int8-torchao` use another torchao kernel (said at start)",
        apply=lambda t, v, e: _precision(t, v, e),
    ),
    # --- schedule and optimisation ---
    _same("num_train_epochs", note="0 means: train for `max_train_steps`", apply=_epochs),
    _same("max_train_steps", note="0 means: train for `num_train_epochs`", apply=_max_steps),
    _same("train_batch_size"),
    _same("gradient_accumulation_steps"),
    _same("learning_rate"),
    _same(
        "lr_scheduler",
        note="SimpleTuner's shapes: `cosine` / `cosine_with_warmup` -> `simpletuner_cosine` (its own cosine, no "
        "warm-up ramp); `constant` with `lr_warmup_steps` > 0 -> `constant_with_warmup`; `polynomial` with its "
        "`lr_end` 4e-7 and `lr_power` 0.8; `cosine_with_restarts` stops (it never leaves the peak there)",
    ),
    _same("lr_warmup_steps", note="`simpletuner_cosine`'s half-period (1000 / processes steps when 0)"),
    _same("lr_end", note="read by `polynomial` and `cosine` (SimpleTuner's default 4e-7 written); else ignored"),
    _same("lr_power", note="read by `polynomial` (SimpleTuner's default 0.8 written); else ignored"),
    _same(
        "optimizer",
        note="SimpleTuner's own defaults for it (betas, eps, weight decay, its other settings) are written where the "
        "config does not set them; `optimi-*`, `bnb-adamw8bit`, `bnb-adamw8bit-paged`, `bnb-lion8bit` and "
        "`torch-adafactor` keep their names (the same library classes), `torch-adamw` / `torch-adam` / `torch-sgd` "
        "are `adamw` / `adam` / `sgd`",
        apply=_optimizer,
    ),
    _same(
        "optimizer_config",
        note="`weight_decay` / `eps` / `betas` in it become `weight_decay` / `adam_epsilon` / `adam_beta1`, "
        "`adam_beta2`",
        apply=lambda t, v, e: _optimizer_config(t, v, e),
    ),
    *(
        key_row(
            key,
            "ignored",
            note="SimpleTuner reads it only for DeepSpeed's optimizer (optimizer_param.py:1186-1190); its optimizers "
            "take betas / eps / weight decay from their own defaults, `optimizer_config` and `optimizer_beta1` + "
            "`optimizer_beta2`",
        )
        for key in ("adam_beta1", "adam_beta2", "adam_epsilon", "adam_weight_decay")
    ),
    _same("optimizer_beta1", "adam_beta1", "with `optimizer_beta2` (both or neither, as SimpleTuner requires)"),
    _same("optimizer_beta2", "adam_beta2", "with `optimizer_beta1` (both or neither, as SimpleTuner requires)"),
    _same(
        "max_grad_norm",
        note="0 turns clipping off",
        apply=lambda t, v, e: t.put("max_grad_norm", None if is_inert(v) else plain(v), e.key),
    ),
    _same("grad_clip_method"),
    _same("gradient_checkpointing"),
    _same(
        "tread_config",
        note="TREAD routes (sd3, flux, wan, qwen_image), also as a Python-literal string; the route indices are "
        "checked against the transformer's blocks; routes that overlap or run backwards, which SimpleTuner skips "
        "silently, are refused",
        apply=_tread,
    ),
    key_row(
        "mixed_precision",
        "approximated",
        "mixed_precision",
        "the trained weights stay fp32 and the forward pass autocasts to bf16 / fp16; SimpleTuner casts the trained "
        "model (adapter included) to that dtype and trains the weights themselves in it (cmd_args.py:1108-1112)",
        apply=set_spelled(MIXED, "no fp8 autocast: bf16 with an 8-bit base_model_precision"),
    ),
    _same("seed", note="unset: 42 here, said at start (SimpleTuner seeds nothing; crops and resumes need a seed)"),
    _same("snr_gamma", note="also turns on `loss_weighting: min_snr`", apply=_snr_gamma),
    _same("flow_schedule_shift", "flow_shift"),
    _same(
        "flow_sigmoid_scale",
        "logit_std",
        "flow families draw sigmas as sigmoid(N(0, 1) * scale): `timestep_sampling: logit_normal`, `logit_std`",
    ),
    _same("flow_use_uniform_schedule", "timestep_sampling", "true -> `timestep_sampling: uniform`"),
    key_row("flow_use_beta_schedule", "unsupported", note="the beta sigma schedule is not supported: remove it"),
    _same("disable_tf32", "enable_tf32", "inverted", apply=_inverted_tf32),
    # --- adapter ---
    _same("lora_type", values={"standard": "standard", "lycoris": "lycoris"}),
    _same("lora_rank"),
    _same("lora_alpha"),
    _same("lora_dropout"),
    _same(
        "peft_lora_target_modules",
        "lora_target_modules",
        "a list, a JSON list in a string, or a JSON file holding one (cmd_args.py:280-330)",
        apply=lambda t, v, e: _target_modules(t, v, e),
    ),
    _same(
        "flux_lora_target",
        "lora_target_modules",
        "flux LoRA: its named layer sets (`all`, the default, `all+ffs`, `all+ffs+embedder`, `context`, "
        "`context+ffs`) become the module list",
    ),
    *(
        _same(
            key,
            note="flux only (SimpleTuner ignores it elsewhere, and on a Flux folder without guidance embedding); "
            "`random-range` draws per sample in [`flux_guidance_min`, `flux_guidance_max`]",
            apply=lambda t, v, e: _flux_guidance(t, v, e),
        )
        for key in ("flux_guidance_mode", "flux_guidance_value", "flux_guidance_min", "flux_guidance_max")
    ),
    key_row(
        "disable_multiline_split",
        "ignored",
        note="SimpleTuner's config reader skips it at the top level (a dataset key with no command-line argument, "
        "field_registry/sections/data.py:147-161, cli_utils.py:199-201): set it on each dataset entry",
    ),
    key_row("init_lora", "unsupported", note="training cannot start from an existing LoRA file here: remove it"),
    key_row(
        "lora_init_type",
        "unsupported",
        note="adapters start as peft's default (B = 0); other initialisations (gaussian, PiSSA, LoftQ, ...) are not "
        "supported",
        apply=lambda t, v, e: (
            t.ignore(e.key, "peft's default")
            if str(v) == "default"
            else t.problems.append(f"`{e.key}` = {v!r}: {e.note}")
        ),
    ),
    _same("use_dora", "lora_use_dora"),
    key_row(
        "train_text_encoder",
        "approximated",
        "train_text_encoder",
        "sd / sdxl LoRA runs (other families stop, with the reason): here a LoRA with the UNet's rank, alpha and "
        "dropout trains on each CLIP text encoder (`q_proj`, `k_proj`, `v_proj`, `out_proj`) and each step encodes "
        "its captions; SimpleTuner adds no adapter to its text encoders (models/common.py:1049-1117 adapts the "
        "denoiser only; models/common.py:3121-3126 freezes them), so its text-encoder parameter list stays empty "
        "(trainer.py:4049-4057) and batches keep their cached embeddings (collate.py:1134-1135): it keeps the "
        "encoders loaded (trainer.py:2930-2932) and trains none of their weights",
    ),
    key_row(
        "text_encoder_lr",
        "approximated",
        "text_encoder_lr",
        "the learning rate of the text encoders' optimizer group, as SimpleTuner builds it (trainer.py:4095-4099); "
        "there that group never forms (no text-encoder weight trains, see `train_text_encoder`) and the rate is "
        "dropped with a warning (trainer.py:4100-4101); without `train_text_encoder` it is dropped here too",
        apply=lambda t, v, e: _text_encoder_lr(t, v, e),
    ),
    key_row(
        "controlnet",
        "approximated",
        "controlnet",
        "sdxl / flux (other families stop, with the reason): a ControlNet (`model_type: full`) or a peft LoRA on one "
        "beside the frozen model, from `controlnet_model_name_or_path` or made from the model (`from_unet` / "
        "`from_transformer`, as models/sdxl/model.py:240-248 and flux/model.py:277-287); the residuals go into the "
        "frozen model as there (sdxl/model.py:260-300, flux/model.py:948-1090). It differs: SDXL's conditioning "
        "image reaches the ControlNet in [0, 1], as diffusers' StableDiffusionXLControlNetPipeline preprocesses it, "
        "where SimpleTuner's image transforms give [-1, 1] (models/common.py:1802-1806); an SDXL LoRA is a peft "
        "LoRA (rank, alpha) on SimpleTuner's targets (models/common.py:465-500), where SimpleTuner trains a LoHa "
        "with `use_effective_conv2d` (models/common.py:1049-1062); Flux's conditioning latents are the VAE "
        "distribution's mode; a fresh ControlNet's random layers are drawn under `seed`",
    ),
    _same(
        "controlnet_model_name_or_path",
        note="a folder (from the working directory) or a hub id, loaded with `from_pretrained(path)` as "
        "sdxl/model.py:241-243 and flux/model.py:281-283; a folder without a `config.json` of its own is read at "
        "its `controlnet/` subfolder (a run's output)",
        apply=lambda t, v, e: t.put("controlnet_model_name_or_path", _st_location(t, v), e.key),
    ),
    key_row(
        "lora_format",
        "approximated",
        "output_formats",
        "`comfyui`: the final save also writes `<name>.comfyui.safetensors` beside the diffusers file (SimpleTuner "
        "writes the ComfyUI file alone, under the diffusers name, at checkpoints too); its names are SimpleTuner's "
        "for sd / sdxl / flux / qwen_image; wan's are Wan's own (SimpleTuner keeps diffusers' under "
        "`diffusion_model.`, which ComfyUI's Wan loader does not map) and sd3's carry the scale in the weights "
        "(diffusers refuses SimpleTuner's `.alpha` keys there)",
        apply=lambda t, v, e: _lora_format(t, v, e),
    ),
    _same("lycoris_config", "lycoris", "the JSON file's settings become the `lycoris` table", apply=_lycoris_config),
    # --- loss ---
    _same("loss_type"),
    _same("huber_schedule"),
    _same("huber_c"),
    _same(
        "masked_loss_probability",
        note="the share of batches of a `conditioning_type: segmentation` dataset that mask their loss; a `mask` "
        "dataset masks every batch, as in SimpleTuner",
    ),
    _same("offset_noise", "noise_offset", "the switch of `noise_offset` (off: no offset); flow families take none"),
    _same("noise_offset", note="applied only with `offset_noise: true`, as in SimpleTuner"),
    _same("noise_offset_probability", note="applied only with `offset_noise: true`"),
    _same(
        "caption_dropout_probability",
        note="sdxl: SimpleTuner also zeroes a dropped sample's size and crop ids (collate.py:518-519); here they are "
        "kept (said at start)",
    ),
    key_row(
        "use_ema",
        "approximated",
        "use_ema",
        "the EMA copy is averaged in fp32 here; SimpleTuner keeps it in the training dtype (bf16 with "
        "`mixed_precision: bf16`), where updates smaller than bf16's resolution are lost",
        apply=lambda t, v, e: _use_ema(t, v, e),
    ),
    _same("ema_decay"),
    _same("ema_update_interval"),
    _same("ema_validation"),
    _same(
        "ema_device",
        note="`ema_cpu_only: true` wins over it, as in SimpleTuner",
        apply=lambda t, v, e: _ema_device(t, v, e),
    ),
    _same("ema_warmup_steps"),
    key_row(
        "ema_cpu_only",
        "same",
        "ema_device",
        "true -> `ema_device: cpu` (the EMA lives and updates on the CPU)",
        apply=lambda t, v, e: _ema_cpu_only(t, v, e),
    ),
    # --- checkpoints, output ---
    _same("output_dir", note="taken from the working directory, made absolute", apply=_path_key),
    _same("checkpoint_step_interval", "checkpointing_steps", "0: no step checkpoints", apply=_unset_at_zero),
    _same("checkpointing_steps", note="0: no step checkpoints", apply=_unset_at_zero),
    _same("checkpoints_total_limit", note="0: keep every checkpoint", apply=_unset_at_zero),
    _same(
        "resume_from_checkpoint",
        note="`latest`, or a checkpoint folder's name looked up inside `output_dir` (SimpleTuner keeps only the "
        "name, trainer.py:5022-5049)",
        apply=_resume,
    ),
    # --- validation ---
    _same("validation_prompt", apply=_validation_prompt),
    _same("validation_step_interval", "validation_steps"),
    _same("validation_steps"),
    _same("validation_guidance", "validation_guidance_scale"),
    _same("validation_num_inference_steps"),
    _same("num_validation_images"),
    key_row(
        "validation_resolution",
        "approximated",
        "validation_resolution",
        "validation only: sizes are used as written here; SimpleTuner reads values under 128 as megapixels and "
        "rounds sizes to multiples of 16 (validation.py:4744), and its default is 256 (here: `resolution`)",
    ),
    _same("validation_seed", note="0 means: use `seed`, as in SimpleTuner", apply=_unset_at_zero),
    _same("validation_negative_prompt"),
    key_row(
        "validation_guidance_rescale",
        "ignored",
        note="validation only, and SimpleTuner passes it to its pipeline only with skip-layer guidance "
        "(validation.py:4678-4686), which is not used here",
    ),
    _same("validation_num_video_frames"),
    # --- data ---
    _same("data_backend_config", "datasets", "its entries are translated and inlined", apply=_data_backend_config),
    _same("resolution", note="also each dataset's default, as in SimpleTuner"),
    _same("cache_dir", "cache_config.cache_dir", "made absolute", apply=_path_key),
    _same("cache_dir_text", "cache_config.text_cache_dir", "made absolute", apply=_path_key),
    key_row(
        "eval_steps_interval",
        "approximated",
        "eval_steps",
        "logs a fixed-noise loss on training batches every N steps (`eval_iters` batches), not SimpleTuner's "
        "evaluation datasets",
    ),
    _same("vae_batch_size"),
    # --- logging ---
    _same("report_to", apply=_report_to),
    _same("tracker_project_name"),
    key_row("tracker_run_name", "ignored", note="the tracker names the run"),
    key_row("logging_dir", "ignored", note="logs are written under `output_dir`"),
    # --- Hub uploads ---
    _same(
        "push_to_hub",
        note="uploads the final weights and a model card to `hub_model_id`; without `push_to_hub_background`, "
        "SimpleTuner's `false` is written (training waits for checkpoint uploads, as there)",
        apply=_push_to_hub,
    ),
    _same(
        "push_checkpoints_to_hub",
        note="with `push_to_hub` only: without it SimpleTuner uploads nothing, and the key is ignored",
        apply=_push_checkpoints,
    ),
    _same(
        "push_to_hub_background",
        note="SimpleTuner's default false (training waits for each checkpoint upload) is written with "
        "`push_to_hub`; ours is true",
        apply=_flag,
    ),
    _same(
        "hub_model_id",
        note='a huggingface.co URL is read as its id; unset (null, "", "none"): `tracker_project_name`',
        apply=_hub_model_id,
    ),
    _same("model_card_private", note="the repo is created private (default true)", apply=_flag),
    _same("model_card_note", note="shown near the top of the model card", apply=_model_card_note),
    _same(
        "model_card_safe_for_work",
        note="tags the card `safe-for-work`; false: `not-for-all-audiences`",
        apply=_flag,
    ),
)
