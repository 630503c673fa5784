"""A SimpleTuner config (``config.json`` + ``multidatabackend.json``) -> a native config with the same
meaning, and the report of what each key became. :data:`DIALECT` is the one table of its keys; how the
translation keeps the meaning is documentation/MIGRATING_FROM_SIMPLETUNER.md, generated from the table.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Mapping, Optional

from simpletuner.configuration.families import FLOW_MATCHING_FAMILIES
from simpletuner.configuration.simpletuner.facts import (
    CONTROLNET_CONDITIONING,
    DATASET_DEFAULTS_FROM_TOP,
    DEFAULT_FLAVOURS,
    FEATURE_SWITCHES,
    FLAVOURS,
    MASK_CONDITIONING,
    MASK_RESAMPLING,
    REFERENCE_CONDITIONING,
    SIMPLETUNER_DATASET_DEFAULTS,
    SIMPLETUNER_DEFAULTS,
    SIMPLETUNER_TRUE_ALSO_HERE,
    UNSUPPORTED_CONDITIONING_TYPES,
    UNSUPPORTED_DATASET_TYPES,
)
from simpletuner.configuration.simpletuner.mapped import CORE, resolve_flavour
from simpletuner.configuration.simpletuner.mapped_datasets import DATASET_CORE, TOP_DATASET_KEYS, default_video_frames
from simpletuner.configuration.simpletuner.reading import (
    DialectError,
    DialectKey,
    Problem,
    Report,
    Section,
    Translation,
    as_bool,
    as_number,
    fill_placeholders,
    is_inert,
    rename,
)
from simpletuner.configuration.simpletuner.semantics import (
    READ_HERE,
    flow_sampling,
    flux_guidance_range,
    flux_lora_target,
    forced_settings,
    lora_targets,
    lr_schedule,
    noise_offset,
    optimizer_meaning,
    optimizer_settings,
    prompt_length,
    sdxl_conditioning,
    seed,
    unreadable_files,
    validation_cadence,
    validation_defaults,
)
from simpletuner.configuration.simpletuner.unmapped import TAIL, TAIL_DEFAULTS


def _table() -> tuple[DialectKey, ...]:
    mapped = CORE + TOP_DATASET_KEYS + DATASET_CORE
    here = {(e.section, e.key) for e in mapped}  # a key mapped here is not also in the tail
    tail = tuple(DialectKey(k, sec, kind, None, note) for k, sec, kind, note in TAIL if (sec, k) not in here)
    return mapped + tail


#: Every key of SimpleTuner's dialect this trainer knows, top-level and dataset-level.
DIALECT: tuple[DialectKey, ...] = _table()


_BY_KEY: dict[tuple[str, str], DialectKey] = {(e.section, e.key): e for e in DIALECT}


def entry_for(key: str, section: Section = "top") -> Optional[DialectKey]:
    """The table's entry for SimpleTuner's ``key`` (without a leading ``--``) in ``section``."""
    return _BY_KEY.get((section, key))


def looks_like_simpletuner(raw: Any, native_keys: frozenset[str]) -> bool:
    """A SimpleTuner config: a key written ``--key``, or a key of its dialect that is not one of ours."""
    if not isinstance(raw, dict):
        return False
    for key in raw:
        if not isinstance(key, str):
            continue
        if key.startswith("--"):
            return True
        entry = entry_for(key)
        if entry is not None and key not in native_keys:
            return True
    return False


def _is_true(value: Any) -> bool:
    try:
        return value is not None and as_bool(value, "")
    except Problem:
        return False


def _switch_of(name: str) -> Optional[str]:
    for prefix, switch in FEATURE_SWITCHES.items():
        if name.startswith(prefix) and name != switch:
            return switch
    return None


def _switched_off(bare: Mapping[str, Any], name: str) -> bool:
    switch = _switch_of(name)
    return switch is not None and is_inert(bare.get(switch))


#: Keys read as part of another key's meaning (not mapped on their own).
_READ_WITH_OTHERS = (
    "flow_use_uniform_schedule",
    "flow_use_beta_schedule",
    "flow_sigmoid_scale",
    "model_flavour",
    "offset_noise",
    "noise_offset",
    "noise_offset_probability",
    "flux_lora_target",
    *READ_HERE,
)


def _apply_key(t: Translation, name: str, value: Any, entry: Optional[DialectKey], label: str) -> None:
    shown = f"{label}.{name}" if label else name
    if entry is None:  # not a SimpleTuner key we know: ours, or a typo the native validation names
        target = t.dataset if t.dataset is not None else t.out
        target[name] = value
        return
    if entry.kind == "ignored":
        t.ignore(shown, entry.note)
        return
    if entry.kind == "unsupported":
        if entry.apply is not None:
            entry.apply(t, value, entry)
        elif is_inert(value, SIMPLETUNER_DEFAULTS.get(name, TAIL_DEFAULTS.get(name))):
            t.ignore(shown, f"set to {value!r}, which does nothing")
        elif not label and _switched_off(t.bare, name):
            t.ignore(shown, f"its feature is off (`{_switch_of(name)}`)")
        else:
            t.problems.append(f"`{shown}` = {value!r}: {entry.note}")
        return
    before = len(t.problems)
    try:
        (entry.apply or rename)(t, value, entry)
    except Problem as exc:
        t.problems.append(f"{label + ': ' if label else ''}{exc}")
    handled = t.report.mapped + t.report.ignored  # an apply that reported the key itself (mapped or ignored)
    if len(t.problems) == before and not any(line.startswith(f"`{shown}") for line in handled):
        t.report.mapped.append(f"`{shown}` -> `{entry.ours}`" if entry.ours != name else f"`{shown}`")
        said = any(line.startswith(f"`{shown}") for line in t.report.approximated)
        if entry.kind == "approximated" and not is_inert(value) and not said:
            t.approx(shown, entry.note)


def _bare_keys(raw: Mapping[str, Any], t: Translation, label: str = "") -> dict[str, Any]:
    bare: dict[str, Any] = {}
    for key, value in raw.items():
        name = key[2:] if isinstance(key, str) and key.startswith("--") else key
        if name in bare and bare[name] != value:
            where = f"{label}: " if label else ""
            t.problems.append(f"{where}`--{name}` and `{name}` are both set, to different values: keep one of them")
        bare[name] = value
    return bare


def _without_string_false(t: Translation, bare: dict[str, Any]) -> dict[str, Any]:
    """SimpleTuner's config reader skips a top-level value that is the string ``"false"`` (cli_utils.py:223-226), so
    the key keeps its default: where that default is on (gradient checkpointing), the run keeps it on, and says so."""
    kept = {}
    for name, value in bare.items():
        if not (isinstance(value, str) and value.strip().lower() == "false"):
            kept[name] = value
        elif SIMPLETUNER_DEFAULTS.get(name) is True or name in SIMPLETUNER_TRUE_ALSO_HERE:
            t.report.overridden.append(
                f'`{name}: "false"` (a string) -> true: SimpleTuner\'s config reader skips the string "false", so its '
                f"default (true) applies there and here; write false without quotes to turn it off"
            )
        else:
            t.report.notes.append(f'`{name}: "false"` (a string): skipped as SimpleTuner\'s reader skips it')
    return kept


def _text_embeds_entry(t: Translation, entry: dict[str, Any], label: str) -> None:
    storage = str(entry.get("type", "local"))
    if storage != "local":
        t.problems.append(
            f"{label}: a `text_embeds` entry of `type: {storage}`: text caches are stored in a local folder here; "
            "use `type: local` with `cache_dir`"
        )
        return
    folder = entry.get("cache_dir")
    if is_inert(folder):
        return
    is_default = as_bool(entry.get("default", False), f"{label}.default")
    path = t.path(folder, f"{label}.cache_dir")
    current = t.out.get("cache_config", {}).get("text_cache_dir")
    if current is not None and current != path:
        if not is_default:
            t.report.notes.append(f"{label}: text cache folder {path} not used: the default entry's {current} is")
            return
        t.report.notes.append(f"text cache folder {path} (the default `text_embeds` entry) instead of {current}")
    t.out.setdefault("cache_config", {})["text_cache_dir"] = path
    t.sources["cache_config.text_cache_dir"] = f"{label}.cache_dir"
    t.report.mapped.append(f"`{label}.cache_dir` -> `cache_config.text_cache_dir`")


def _area_resolution(t: Translation, top: dict[str, Any]) -> None:
    """`resolution_type: area` at the top level: `resolution` is megapixels. Each dataset gets it (ours is a
    side in pixels at the top level); the top level keeps the square side of that area, rounded to 64 px."""
    try:
        megapixels = float(as_number(t.out["resolution"], "resolution"))
    except Problem as exc:
        t.problems.append(str(exc))
        return
    top["resolution"] = megapixels
    side = max(64, int(round(math.sqrt(megapixels * 1e6) / 64)) * 64)
    t.out["resolution"] = side
    t.report.notes.append(
        f"`resolution: {megapixels}` megapixels (`resolution_type: area`) -> each dataset's `resolution`; the "
        f"top-level `resolution` (validation's default size) is {side} px"
    )


#: Keys of a `dataset_type: conditioning` entry read by :func:`_conditioning_entry` itself.
_CONDITIONING_OWN_KEYS = (
    "id",
    "dataset_type",
    "disabled",
    "disable",
    "type",
    "instance_data_dir",
    "conditioning_type",
    "source_dataset_id",
)


def _raw_key(entry: Mapping[str, Any], key: str) -> Any:
    return entry.get(key, entry.get(f"--{key}"))


def _is_conditioning(entry: Mapping[str, Any]) -> bool:
    """A conditioning entry: `dataset_type: conditioning`, or any entry with a `conditioning_type`, which SimpleTuner
    makes one (data_backend/factory.py:4529-4530; its Kontext quickstart writes the reference entry so)."""
    return str(entry.get("dataset_type")) == "conditioning" or _raw_key(entry, "conditioning_type") is not None


def _conditioning_entry(t: Translation, entry: dict[str, Any], label: str) -> Optional[str]:
    """A `dataset_type: conditioning` entry (Qwen-Image-Edit source images, or the masks of masked loss): its
    folder (absolute), or None with the problems listed. Its other keys are reported: each source image (mask)
    follows its image here."""
    bare = _bare_keys(entry, t, label)
    kind = bare.get("conditioning_type")
    follows = (
        "a mask follows its image: that dataset's crop and size apply"
        if kind in MASK_CONDITIONING
        else "a source image follows its edited image: that dataset's crop, size and captions apply"
    )  # captions too as in SimpleTuner: with one conditioning dataset it reads the training captions (collate.py:1031)
    _conditioning_keys(t, bare, label, follows)
    storage = str(bare.get("type", "local")).strip()
    if storage != "local":
        t.problems.append(
            f"{label}: `type: {storage}`: source images and masks are read from a local folder here: copy them to "
            "one and use `type: local`"
        )
    _conditioning_type(t, kind, label)
    folder = bare.get("instance_data_dir")
    if not isinstance(folder, str) or not folder:
        t.problems.append(f"{label}: `instance_data_dir` must name the folder of source images (or masks)")
        return None
    return t.path(folder, f"{label}.instance_data_dir")


def _conditioning_keys(t: Translation, bare: dict[str, Any], label: str, follows: str) -> None:
    """The keys of a `dataset_type: conditioning` entry other than its own: refused where unsupported and set,
    otherwise reported as ignored (``follows`` says why)."""
    for name, value in bare.items():
        shown = f"{label}.{name}"
        if name in _CONDITIONING_OWN_KEYS:
            continue
        item = entry_for(name, "dataset")
        if item is None:
            t.problems.append(f"`{shown}`: not a key SimpleTuner reads on a `dataset_type: conditioning` entry")
        elif item.kind == "ignored":
            t.ignore(shown, item.note)
        elif item.kind == "unsupported" and not is_inert(value):
            t.problems.append(f"`{shown}` = {value!r}: {item.note}")
        elif item.kind == "unsupported":
            t.ignore(shown, f"set to {value!r}, which does nothing")
        else:
            t.ignore(shown, follows)


def _trains_controlnet(t: Translation) -> bool:
    try:
        return as_bool(t.bare.get("controlnet", False), "controlnet")
    except Problem:  # its own row names the value
        return False


def _conditioning_type(t: Translation, kind: Any, label: str) -> None:
    """A conditioning entry's `conditioning_type`: read here (said where approximated), or a problem. With
    `controlnet: true`, `controlnet` or unset (SimpleTuner's CONTROLNET.md example) names the ControlNet's
    conditioning images, which follow their images' crop and size (collate.py:255-290, `prepare_like`)."""
    if _trains_controlnet(t) and kind in (None, CONTROLNET_CONDITIONING):
        return
    if kind == CONTROLNET_CONDITIONING:
        t.problems.append(
            f"{label}: `conditioning_type: controlnet` names a ControlNet's conditioning images, but `controlnet` is "
            "not true: set `controlnet: true` (sdxl, flux), or remove the entry"
        )
    elif isinstance(kind, str) and kind in MASK_CONDITIONING:
        t.approx(f"{label}.conditioning_type: {kind}", MASK_RESAMPLING)
    elif isinstance(kind, str) and kind in REFERENCE_CONDITIONING:
        warning = REFERENCE_CONDITIONING[kind]
        if warning is not None:
            t.approx(f"{label}.conditioning_type: {kind}", warning)
    elif kind is None:
        t.problems.append(
            f"{label}: `conditioning_type` is not set: SimpleTuner's Qwen-Image-Edit training needs `reference_strict` "
            "(the source takes the edited image's crop) or `reference_loose`; set one"
        )
    else:
        why = UNSUPPORTED_CONDITIONING_TYPES.get(str(kind), "not a kind of conditioning trained here")
        t.problems.append(
            f"{label}: `conditioning_type: {kind}`: {why}; source/edited image pairs (Qwen-Image-Edit `edit-v1`) use "
            "`reference_strict` or `reference_loose`, masked loss `mask` or `segmentation`"
        )


def _read_conditioning(t: Translation, entries: list[Any]) -> None:
    """The `dataset_type: conditioning` entries, before the datasets that name them: each must be named by one
    training dataset's `conditioning_data` (SimpleTuner pairs them no other way); its `source_dataset_id`, if
    set, must be that dataset."""
    named_by: dict[str, list[Any]] = {}
    for entry in entries:
        if (
            isinstance(entry, dict)
            and str(entry.get("dataset_type", "image")) in ("image", "video")
            and not _is_conditioning(entry)
        ):
            names = _raw_key(entry, "conditioning_data")
            for name in [names] if isinstance(names, str) else names if isinstance(names, list) else []:
                if isinstance(name, str):
                    named_by.setdefault(name, []).append(entry.get("id"))
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not _is_conditioning(entry):
            continue
        name = entry.get("id")
        label = f"datasets[{i}] ({name})" if isinstance(name, str) else f"datasets[{i}]"
        try:
            if as_bool(_raw_key(entry, "disabled") or _raw_key(entry, "disable") or False, f"{label}.disabled"):
                continue
        except Problem as exc:
            t.problems.append(str(exc))
            continue
        if not isinstance(name, str) or name not in named_by:
            t.problems.append(
                f"{label}: a `dataset_type: conditioning` entry that no training dataset names in `conditioning_data`, "
                "so no image is paired with its sources. Name its `id` in the `conditioning_data` of the dataset "
                "whose images it conditions, or remove it"
            )
            if isinstance(name, str):
                t.conditioning_sources[name] = None  # listed where a misspelt name is refused
            continue
        source = _raw_key(entry, "source_dataset_id")
        if isinstance(source, str) and source not in named_by[name]:
            t.problems.append(
                f"{label}: `source_dataset_id: {source}` is not a dataset whose `conditioning_data` names {name!r} "
                f"(those are: {', '.join(map(repr, named_by[name]))}): set it to that one, or remove it"
            )
        t.conditioning_sources[name] = _conditioning_entry(t, entry, label)
        _record_conditioning(t, entry, name, named_by[name], label)


def _record_conditioning(t: Translation, entry: dict[str, Any], name: str, named_by: list[Any], label: str) -> None:
    """Note a read conditioning entry: a mask's kind (its folder becomes a `mask_data_dir`) and the mapping."""
    kind = _raw_key(entry, "conditioning_type")
    if kind in MASK_CONDITIONING:
        t.conditioning_masks[name] = kind
    ours = "mask_data_dir" if kind in MASK_CONDITIONING else "conditioning_data_dir"
    t.report.mapped.append(
        f"`{label}.instance_data_dir` -> `{ours}` of {', '.join(map(repr, named_by))} (the entry is not a dataset "
        "of its own)"
    )


def _translate_datasets(t: Translation, entries: list[Any], top: dict[str, Any]) -> list[dict[str, Any]]:  # noqa: C901
    out: list[dict[str, Any]] = []
    _read_conditioning(t, entries)
    for i, entry in enumerate(entries):
        label = f"datasets[{i}]"
        if not isinstance(entry, dict):
            t.problems.append(f"{label}: must be a JSON object")
            continue
        if isinstance(entry.get("id"), str):
            label = f"datasets[{i}] ({entry['id']})"
        kind = str(entry.get("dataset_type", "image"))
        if kind == "text_embeds":
            _text_embeds_entry(t, entry, label)
            continue
        if _is_conditioning(entry):  # read by _read_conditioning; its folder is a training dataset's
            continue
        if kind == "conditioning_image_embeds":
            t.ignore(label, _BY_KEY[("dataset", "conditioning_image_embeds")].note)
            continue
        if kind in UNSUPPORTED_DATASET_TYPES:
            if not as_bool(entry.get("disabled", False), f"{label}.disabled"):
                t.problems.append(f"{label}: `dataset_type: {kind}`: {UNSUPPORTED_DATASET_TYPES[kind]}")
            continue
        t.dataset, t.dataset_label = {}, label
        # SimpleTuner fills {model_family}, {output_dir}, {id} and {env:NAME} in dataset entries (factory.py:1194-1218)
        output_dir = t.bare.get("output_dir", SIMPLETUNER_DEFAULTS["output_dir"])
        names = {"model_family": t.family, "output_dir": output_dir, "id": entry.get("id", "")}
        t.dataset_entry = fill_placeholders(_bare_keys(entry, t, label), names)
        for name, value in t.dataset_entry.items():
            _apply_key(t, name, value, entry_for(name, "dataset"), label)
        if "resolution" in top and "resolution" not in entry:
            t.put("resolution", top["resolution"], "top-level resolution (megapixels)")
        for key in DATASET_DEFAULTS_FROM_TOP:
            # A top-level `only_instance_prompt: true` holds for every dataset, its own `false` too: SimpleTuner
            # ORs the two (factory.py:3519).
            own = key in t.dataset_entry and not (key == "only_instance_prompt" and _is_true(top.get(key)))
            if key in top and not own:
                item = _BY_KEY[("dataset", key)]
                (item.apply or rename)(t, top[key], item)
        for key, default in SIMPLETUNER_DATASET_DEFAULTS.items():
            if not t.is_set(key):
                t.put(key, default, f"SimpleTuner's dataset default {key}")
        if kind == "video" and not t.is_set("num_frames"):
            default_video_frames(t, t.bare.get("framerate"))
        out.append(t.dataset)
        t.dataset, t.dataset_label, t.dataset_entry = None, "", None
    return out


def translate(  # noqa: C901, PLR0915
    raw: Mapping[str, Any],
    config_path: Optional[Path] = None,
    cwd: Optional[Path] = None,
) -> tuple[dict[str, Any], Report]:
    """SimpleTuner config ``raw`` -> (native config, report). Raises DialectError listing every key that
    is unsupported or unreadable, and every setting two keys set to different values."""
    t = Translation(cwd=Path(cwd or os.getcwd()), config_dir=config_path.parent if config_path else None)
    # Top-level values get only {env:NAME} filled, as SimpleTuner's reader does (cli_utils.py:201).
    bare = t.bare = _without_string_false(t, fill_placeholders(_bare_keys(raw, t), {}))
    family = bare.get("model_family")
    t.family = str(family).strip() if isinstance(family, str) else None
    top_for_datasets: dict[str, Any] = {}
    for name, value in bare.items():
        if name in _READ_WITH_OTHERS:
            continue
        if name in DATASET_DEFAULTS_FROM_TOP:
            top_for_datasets[name] = value
            t.report.mapped.append(f"`{name}` -> each dataset's `{name}`")
            continue
        _apply_key(t, name, value, entry_for(name), "")
    forced_settings(t, bare)  # before the defaults: a forced value is not also a default
    lr_schedule(t, bare)
    for name, default in SIMPLETUNER_DEFAULTS.items():
        if name in bare or name in READ_HERE:
            continue
        if name in DATASET_DEFAULTS_FROM_TOP:
            top_for_datasets[name] = default
            t.report.defaults.append(f"`{name}: {default!r}` for each dataset that does not set it")
            continue
        entry = entry_for(name)
        assert entry is not None and entry.ours is not None, name
        if name == "flow_schedule_shift" and t.our_family not in FLOW_MATCHING_FAMILIES:
            continue
        if t.is_set(entry.ours):
            continue
        (entry.apply or rename)(t, default, entry)
        t.report.defaults.append(f"`{name}: {default!r}` (SimpleTuner's default; the config does not set it)")
    flow_sampling(t, bare)
    noise_offset(t, bare)
    flux_lora_target(t, bare)
    optimizer_meaning(t, bare)
    optimizer_settings(t, bare)
    validation_defaults(t, bare)
    validation_cadence(t, bare)
    seed(t, bare)
    prompt_length(t, bare)
    lora_targets(t, bare)
    flux_guidance_range(t, bare)
    sdxl_conditioning(t, bare)
    unreadable_files(t, bare)
    cache = t.out.setdefault("cache_config", {})
    if "cache_dir" not in cache:  # SimpleTuner keeps its caches under cache/ in the working directory
        cache["cache_dir"] = str(t.cwd / "cache")
        t.report.notes.append(f"caches under {cache['cache_dir']} (a dataset's `cache_dir_vae` wins for its latents)")
    flavour = bare.get("model_flavour")
    if isinstance(flavour, str) and flavour:
        resolve_flavour(t, flavour, t.out.get("pretrained_model_name_or_path"))
    elif "pretrained_model_name_or_path" not in t.out and t.family in DEFAULT_FLAVOURS:
        default = DEFAULT_FLAVOURS[t.family]  # SimpleTuner's default flavour of the family, and its hub model
        t.put("pretrained_model_name_or_path", FLAVOURS[t.family][default], "model_family")
        t.report.notes.append(
            f"neither `pretrained_model_name_or_path` nor `model_flavour` is set: the {t.family} default flavour "
            f"{default!r}, {FLAVOURS[t.family][default]}, as SimpleTuner loads it"
        )
    if str(top_for_datasets.get("resolution_type")) == "area" and "resolution" in t.out:
        _area_resolution(t, top_for_datasets)
    entries = t.out.pop("__datasets__", None)
    if entries is not None:
        t.out["datasets"] = _translate_datasets(t, entries, top_for_datasets)
    if t.problems:
        source = str(config_path) if config_path else None
        raise DialectError(
            [*t.problems, "(read as a SimpleTuner config; `simpletuner convert` shows the whole mapping)"], source
        )
    return t.out, t.report
