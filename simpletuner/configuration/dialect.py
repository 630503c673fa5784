"""SimpleTuner's config dialect, read as a native config with the same meaning.

SimpleTuner users bring a ``config/config.json`` (keys often written ``"--key"``, values often
strings such as ``"true"`` or ``"1e-4"``) and a ``multidatabackend.json``. :func:`translate` turns
such a config into our native one: every key of the dialect is in :data:`DIALECT`, one table, each
entry marked

  ``same``          mapped onto our key (``ours``) with the same meaning;
  ``approximated``  mapped, and a warning says exactly what differs (``note``);
  ``ignored``       no effect on what is trained here (``note`` says why); listed once;
  ``unsupported``   stops the run before any model loads, naming the key, why, and what to do.

An ``unsupported`` key set to a value that does nothing (``false``, ``null``, ``0``, ``""``, or
SimpleTuner's own default) is reported with the ignored ones instead: published examples spell out
many switches that are off.

Where SimpleTuner's default differs from ours for a key the config leaves out, SimpleTuner's default
is written into the translation (:data:`SIMPLETUNER_DEFAULTS`), so the run means what it meant
there. Paths are taken from the working directory, as SimpleTuner does, and made absolute;
``data_backend_config`` is looked for in the working directory, then beside the config file.

The same report is logged at start (``train``, ``estimate``, ``cache``) and printed by
``simpletuner convert``. documentation/MIGRATING_FROM_SIMPLETUNER.md is generated from the table.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Optional

from simpletuner.configuration.dialect_tail import TAIL, TAIL_DEFAULTS
from simpletuner.configuration.optimizer_settings import parse_optimizer_config

Kind = Literal["same", "approximated", "ignored", "unsupported"]
Section = Literal["top", "dataset"]
KINDS: tuple[Kind, ...] = ("same", "approximated", "ignored", "unsupported")

#: The SimpleTuner commit whose documentation, examples and defaults this table was written from.
SIMPLETUNER_COMMIT = "bc8e6ab7738ce457a2ed8eb2d26cadd91c6442cb"

Apply = Callable[["Translation", Any, "DialectKey"], None]


@dataclass(frozen=True)
class DialectKey:
    """One key of SimpleTuner's config: what plays its part here."""

    key: str
    section: Section
    kind: Kind
    ours: Optional[str] = None  # our key; dotted for a nested one (``lycoris.algo``)
    note: str = ""
    values: Optional[Mapping[str, Any]] = None  # SimpleTuner's spelling of a value -> ours
    apply: Optional[Apply] = None  # how the value is written, when more than a rename


# --- reading SimpleTuner's values ---------------------------------------------------------------
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off", "", "none", "null"}


def as_bool(value: Any, where: str) -> bool:
    """SimpleTuner's booleans: JSON booleans, or strings such as ``"true"`` / ``"false"``."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise _Problem(f"`{where}`: {value!r} is not a boolean (true / false)")


def as_number(value: Any, where: str) -> int | float:
    """SimpleTuner's numbers, also when written as strings (``"1e-4"``, ``"20"``)."""
    if isinstance(value, bool):
        raise _Problem(f"`{where}`: {value!r} is not a number")
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            pass
        try:
            number = float(text)
        except ValueError:
            raise _Problem(f"`{where}`: {value!r} is not a number") from None
        if math.isfinite(number):
            return number
    raise _Problem(f"`{where}`: {value!r} is not a number")


def _plain(value: Any) -> Any:
    """A string that spells a JSON scalar (``"true"``, ``"0.1"``, ``"null"``) read as that scalar;
    other values unchanged. The native schema then checks the type."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text.lower() in ("null", "none"):
        return None
    try:
        return as_number(text, "")
    except _Problem:
        return value


class _Problem(Exception):
    """A value the translation cannot read; becomes one line of the DialectError."""


class DialectError(Exception):
    """The keys of a SimpleTuner config that cannot run here, one line each (the loader raises them as a
    ConfigError, with every other problem of the config)."""

    def __init__(self, problems: list[str], source: Optional[str] = None):
        super().__init__("\n".join(problems))
        self.problems = problems
        self.source = source


def is_inert(value: Any, default: Any = None) -> bool:
    """Whether a value leaves its setting off: false, null, 0, "", "none", or SimpleTuner's default."""
    if value is None or value is False or value == "" or value == [] or value == {}:
        return True
    if isinstance(value, str) and value.strip().lower() in _FALSE:
        return True
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
        return True
    return default is not None and _plain(value) == default


# --- the translation --------------------------------------------------------------------------
@dataclass
class Report:
    """What the translation did, key by key: logged at start and printed by ``convert``."""

    mapped: list[str] = field(default_factory=list)  # "key -> ours" lines
    approximated: list[str] = field(default_factory=list)  # warnings: what differs
    ignored: list[str] = field(default_factory=list)  # "key (why)"
    defaults: list[str] = field(default_factory=list)  # SimpleTuner defaults written in
    notes: list[str] = field(default_factory=list)  # how paths and files were found

    def lines(self, mapped: bool = True) -> list[str]:
        """The report as log lines, the summary first; ``mapped=False`` leaves out the key-by-key mapping
        (the start of a training log keeps the summary, defaults and ignored keys; `convert` prints all)."""
        out = [
            f"read as a SimpleTuner config: {len(self.mapped)} keys mapped, {len(self.approximated)} approximated, "
            f"{len(self.ignored)} ignored, {len(self.defaults)} SimpleTuner defaults applied"
        ]
        out += [f"  {line}" for line in self.notes]
        out += [f"  mapped: {line}" for line in self.mapped] if mapped else []
        out += [f"  default: {line}" for line in self.defaults]
        if self.ignored:
            out.append("  ignored (no effect here): " + "; ".join(self.ignored))
        return out


@dataclass
class Translation:
    """The native config being written, where each value came from, and the report."""

    cwd: Path
    config_dir: Optional[Path]
    family: Optional[str] = None  # SimpleTuner's spelling (sd1x, flux, ...), for `{model_family}`
    out: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # our dotted key -> what set it
    problems: list[str] = field(default_factory=list)
    report: Report = field(default_factory=Report)
    bare: dict[str, Any] = field(default_factory=dict)  # the config's keys without `--`
    dataset: Optional[dict[str, Any]] = None  # the dataset entry being written, for "dataset" keys
    dataset_label: str = ""

    def put(self, ours: str, value: Any, source: str) -> None:
        """Set our key ``ours`` (dotted: nested) from ``source``; two sources that disagree are a problem."""
        target = self.dataset if self.dataset is not None else self.out
        scope = f"{self.dataset_label}." if self.dataset is not None else ""
        parts = ours.split(".")
        node = target
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        slot = scope + ours
        if parts[-1] in node and slot in self.sources and node[parts[-1]] != value:
            self.problems.append(
                f"`{self.sources[slot]}` and `{source}` both set `{slot}`, to {node[parts[-1]]!r} and {value!r}: "
                "keep one of them"
            )
            return
        node[parts[-1]] = value
        self.sources[slot] = source

    def is_set(self, ours: str) -> bool:
        scope = f"{self.dataset_label}." if self.dataset is not None else ""
        return scope + ours in self.sources

    def path(self, value: Any, where: str) -> Any:
        """A SimpleTuner path: taken from the working directory (as SimpleTuner does), made absolute."""
        if not isinstance(value, str) or not value:
            return value
        if self.family is not None:
            value = value.replace("{model_family}", self.family)
        expanded = os.path.expanduser(value)
        if os.path.isabs(expanded):
            return value
        return os.path.normpath(os.path.join(self.cwd, expanded))

    def approx(self, key: str, message: str) -> None:
        self.report.approximated.append(f"`{key}`: {message}")

    def ignore(self, key: str, why: str) -> None:
        self.report.ignored.append(f"`{key}` ({why})")


def _rename(t: Translation, value: Any, entry: DialectKey) -> None:
    """The default for ``same`` / ``approximated`` entries: our key gets the value (spelled ours)."""
    assert entry.ours is not None
    if entry.values is not None and isinstance(value, str) and value in entry.values:
        value = entry.values[value]
    t.put(entry.ours, _plain(value), entry.key)


def _spelled(t: Translation, value: Any, entry: DialectKey, choices: Mapping[str, Any], what: str) -> Any:
    """``value`` in our spelling, or a problem naming the choices."""
    text = str(value).strip()
    if text in choices and choices[text] is not None:
        return choices[text]
    supported = ", ".join(k for k, v in choices.items() if v is not None)
    t.problems.append(
        f"`{entry.key}`: {value!r} is not supported here ({what}); SimpleTuner values that work here: {supported}"
    )
    return None


def _set_spelled(choices: Mapping[str, Any], what: str) -> Apply:
    def apply(t: Translation, value: Any, entry: DialectKey) -> None:
        ours = _spelled(t, value, entry, choices, what)
        if ours is not None:
            assert entry.ours is not None
            t.put(entry.ours, ours, entry.key)

    return apply


#: SimpleTuner's model families -> ours (None: a family this trainer does not train).
FAMILIES: dict[str, Optional[str]] = {
    "sd1x": "sd",
    "sd2x": "sd",
    "legacy": "sd",
    "sdxl": "sdxl",
    "sd3": "sd3",
    "flux": "flux",
    "wan": "wan",
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
}
#: Each family's flavour when the config names none (SimpleTuner's DEFAULT_MODEL_FLAVOUR).
DEFAULT_FLAVOURS = {
    "sd1x": "dreamshaper",
    "sd2x": "pseudoflex-v2",
    "sdxl": "base-1.0",
    "sd3": "medium",
    "flux": "krea",
    "wan": "t2v-480p-1.3b-2.1",
}
#: Flavours of a kind this trainer does not train yet, and why.
_FLAVOUR_UNSUPPORTED = {
    "i2v": "image-to-video training is not supported yet (text-to-video Wan is)",
    "flf2v": "first-last-frame-to-video training is not supported",
    "vace": "Wan VACE training is not supported",
    "ti2v": "Wan 2.2 TI2V-5B training is not supported yet",
    "kontext": "Flux Kontext (image editing) training is not supported",
    "refiner": "the SDXL refiner is not supported (it has one text encoder and an aesthetic-score input)",
    "animegen": "AnimeGen expert weights are downloaded from URLs, which this trainer does not do",
}


def _model_family(t: Translation, value: Any, entry: DialectKey) -> None:
    text = str(value).strip()
    ours = FAMILIES.get(text)
    if ours is None:
        t.problems.append(
            f"`model_family`: {text!r} is not a family this trainer trains; the SimpleTuner families that work "
            f"here are {', '.join(FAMILIES)}"
        )
        return
    t.put("model_family", ours, entry.key)


def _hub_advice(hub_id: str) -> str:
    return (
        f"it stands for the hub model {hub_id}, and this trainer downloads nothing: on a machine with network run "
        f"`huggingface-cli download {hub_id} --local-dir /path/to/{hub_id.split('/')[-1]}`, copy the folder here, "
        "and set `pretrained_model_name_or_path` to it"
    )


def resolve_flavour(t: Translation, flavour: str, model_path: Any) -> None:
    """What ``model_flavour`` means here: Wan 2.2 ``-high`` / ``-low`` set ``train_stages``; a flavour
    of a kind not trained here stops; without a local ``pretrained_model_name_or_path`` it stops with the
    hub id it stands for and the download command."""
    family = t.family or ""
    table = FLAVOURS.get(family, {})
    if flavour not in table:
        known = ", ".join(table) or "none"
        t.problems.append(f"`model_flavour`: {flavour!r} is not a SimpleTuner flavour of {family!r} (known: {known})")
        return
    for marker, why in _FLAVOUR_UNSUPPORTED.items():
        if flavour.startswith(marker):
            t.problems.append(f"`model_flavour`: {flavour!r}: {why}")
            return
    if flavour.endswith("-high") or flavour.endswith("-low"):
        t.put("train_stages", flavour.rsplit("-", 1)[1], "model_flavour")
    if model_path is None and "pretrained_model_name_or_path" not in t.sources:
        t.problems.append(
            f"`model_flavour`: {flavour!r}: no `pretrained_model_name_or_path` is set; {_hub_advice(table[flavour])}"
        )


def _same_folder(t: Translation, value: Any, entry: DialectKey) -> None:
    """A component path that names the model folder itself (or nothing) asks for nothing extra."""
    model = t.bare.get("pretrained_model_name_or_path")
    if is_inert(value) or value == model:
        t.ignore(entry.key, "the model folder itself")
    else:
        t.problems.append(f"`{entry.key}` = {value!r}: {entry.note}")


def _model_path(t: Translation, value: Any, entry: DialectKey) -> None:
    """A local folder (relative ones from the working directory, as SimpleTuner reads them); a hub id
    stops with the download command, since nothing is downloaded here."""
    if isinstance(value, str) and value:
        local = os.path.normpath(os.path.join(t.cwd, os.path.expanduser(value)))
        if os.path.isdir(local):
            value = local
        elif value.count("/") == 1 and not value.startswith((".", "/", "~")):
            t.problems.append(f"`{entry.key}`: {value!r} is not a local folder; {_hub_advice(value)}")
            return
    t.put("pretrained_model_name_or_path", value, entry.key)


def _path_key(t: Translation, value: Any, entry: DialectKey) -> None:
    assert entry.ours is not None
    t.put(entry.ours, t.path(value, entry.key), entry.key)


def _resume(t: Translation, value: Any, entry: DialectKey) -> None:
    if is_inert(value):
        return
    t.put("resume_from_checkpoint", value if value == "latest" else t.path(value, entry.key), entry.key)


def _epochs(t: Translation, value: Any, entry: DialectKey) -> None:
    try:
        epochs = as_number(value, entry.key)
    except _Problem as exc:
        t.problems.append(str(exc))
        return
    if epochs == 0:  # SimpleTuner: 0 epochs means "train for max_train_steps"
        t.report.mapped.append("`num_train_epochs: 0` -> unset (`max_train_steps` decides)")
        return
    t.put("num_train_epochs", epochs, entry.key)


def _max_steps(t: Translation, value: Any, entry: DialectKey) -> None:
    try:
        steps = as_number(value, entry.key)
    except _Problem as exc:
        t.problems.append(str(exc))
        return
    if steps == 0:
        return  # SimpleTuner: 0 means "use num_train_epochs"
    t.put("max_train_steps", steps, entry.key)


def _inverted_tf32(t: Translation, value: Any, entry: DialectKey) -> None:
    try:
        t.put("enable_tf32", not as_bool(value, entry.key), entry.key)
    except _Problem as exc:
        t.problems.append(str(exc))


def _snr_gamma(t: Translation, value: Any, entry: DialectKey) -> None:
    if is_inert(value):
        return  # SimpleTuner: no gamma, no Min-SNR weighting
    t.put("snr_gamma", _plain(value), entry.key)
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


def _hub(t: Translation, value: Any, entry: DialectKey) -> None:
    try:
        on = as_bool(value, entry.key)
    except _Problem as exc:
        t.problems.append(str(exc))
        return
    if on:
        t.problems.append(
            f"`{entry.key}: true`: this trainer does not upload to the Hugging Face Hub; set it to false and upload "
            "the output folder yourself (`huggingface-cli upload`)"
        )
    else:
        t.ignore(entry.key, "hub uploads are off")


def _validation_prompt(t: Translation, value: Any, entry: DialectKey) -> None:
    if is_inert(value):
        return
    t.put("validation_prompt", value, entry.key)


#: A LyCORIS JSON file's keys -> ours (rank and alpha are `lora_rank` / `lora_alpha` here).
_LYCORIS_KEYS = {
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


def _lycoris_config(t: Translation, value: Any, entry: DialectKey) -> None:
    """The LyCORIS JSON file (from the working directory, as SimpleTuner reads it) becomes the `lycoris` table."""
    path = Path(t.path(value, entry.key))
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        t.problems.append(f"`lycoris_config`: {path} does not exist")
        return
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        t.problems.append(f"`lycoris_config`: {path} cannot be read as JSON: {exc}")
        return
    if not isinstance(settings, dict):
        t.problems.append(f"`lycoris_config`: {path} must hold a JSON object")
        return
    t.report.notes.append(f"LyCORIS settings read from {path}")
    for key, item in settings.items():
        ours = _LYCORIS_KEYS.get(key)
        if ours is None:
            t.problems.append(f"`lycoris_config` ({path}): `{key}` is not supported here: remove it")
            continue
        t.put(ours, _plain(item), f"lycoris_config:{key}")
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
    try:
        entries = json.loads(found.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        t.problems.append(f"`data_backend_config`: {found} cannot be read as JSON: {exc}")
        return
    if not isinstance(entries, list):
        t.problems.append(f"`data_backend_config`: {found} must hold a JSON list of dataset entries")
        return
    t.report.notes.append(f"datasets read from {found}")
    t.out["__datasets__"] = entries


def _entry(key: str, kind: Kind, ours: Optional[str] = None, note: str = "", section: Section = "top", **kw):
    return DialectKey(key, section, kind, ours, note, **kw)


def _same(key: str, ours: Optional[str] = None, note: str = "", **kw):
    return _entry(key, "same", ours or key, note, **kw)


#: SimpleTuner's values -> ours; None: a value of SimpleTuner's that does not run here.
_OPTIMIZERS: dict[str, Optional[str]] = {
    "adamw_bf16": "adamw_bf16",
    "prodigy": "prodigy",
    "optimi-adamw": "adamw",
    "optimi-adam": "adam",
    "optimi-sgd": "sgd",
    **dict.fromkeys(
        (
            "ao-adamw8bit",
            "ao-adamw4bit",
            "ao-adamfp8",
            "ao-adamwfp8",
            "adamw_schedulefree",
            "adamw_schedulefree+aggressive",
            "adamw_schedulefree+no_kahan",
            "optimi-stableadamw",
            "optimi-lion",
            "optimi-radam",
            "optimi-ranger",
            "optimi-adan",
            "soap",
        )
    ),
}
_LR_SCHEDULERS: dict[str, Optional[str]] = {
    "constant": "constant",
    "constant_with_warmup": "constant_with_warmup",
    "linear": "linear",
    "cosine": "cosine",
    "cosine_with_restarts": "cosine_with_restarts",
    "polynomial": "polynomial",
    "sine": None,
}
_PRECISIONS: dict[str, Optional[str]] = {
    "no_change": "no_change",
    "int8-quanto": "qint8",
    "fp8-quanto": "qfloat8",
    "int8-torchao": "int8_torchao",
    "fp8-torchao": "fp8_torchao",
    **dict.fromkeys(
        (
            "int4-quanto",
            "int2-quanto",
            "int8dq-torchao",
            "int8dq-int4-torchao",
            "nf4-bnb",
            "int4-torchao",
            "fp8uz-quanto",
            "fp8-native",
            "fp8wo-torchao",
            "fp8-int4-torchao",
            "fp8-transformerengine",
        )
    ),
}
_MIXED: dict[str, Optional[str]] = {"bf16": "bf16", "fp16": "fp16", "no": "no", "fp8": None}

#: The keys this module maps itself (the rest of the dialect is in dialect_tail.TAIL).
CORE: tuple[DialectKey, ...] = (
    # --- model ---
    _same("model_type", "training_type", "`lora` or `full`", values={"lora": "lora", "full": "full"}),
    _same("model_family", "model_family", "sd1x / sd2x / legacy -> `sd`", apply=_model_family),
    _entry(
        "model_flavour",
        "approximated",
        "pretrained_model_name_or_path",
        "names a hub model; here `pretrained_model_name_or_path` must be a local folder (no downloads); Wan 2.2 "
        "`-high` / `-low` set `train_stages`",
    ),
    _same("pretrained_model_name_or_path", apply=_model_path),
    _same("prediction_type"),
    _same("revision"),
    _entry(
        "pretrained_transformer_model_name_or_path",
        "unsupported",
        note="the denoiser is loaded from `pretrained_model_name_or_path`: put the transformer / UNet you want into "
        "that folder",
        apply=lambda t, v, e: _same_folder(t, v, e),
    ),
    _entry(
        "pretrained_t5_model_name_or_path",
        "unsupported",
        note="text encoders are loaded from `pretrained_model_name_or_path`: put the T5 you want into that folder",
        apply=lambda t, v, e: _same_folder(t, v, e),
    ),
    _entry(
        "pretrained_vae_model_name_or_path",
        "unsupported",
        note="the VAE is loaded from `pretrained_model_name_or_path`: put the VAE you want into that folder",
        apply=lambda t, v, e: _same_folder(t, v, e),
    ),
    _entry(
        "seed_for_each_device",
        "ignored",
        note="each process draws its own noise here (its generator is seeded from `seed` and its rank)",
    ),
    _same("aspect_bucket_alignment"),
    _same("base_model_precision", apply=_set_spelled(_PRECISIONS, "8-bit quanto / torchao kinds only")),
    _same("train_stages"),
    # --- schedule and optimisation ---
    _same("num_train_epochs", note="0 means: train for `max_train_steps`", apply=_epochs),
    _same("max_train_steps", note="0 means: train for `num_train_epochs`", apply=_max_steps),
    _same("train_batch_size"),
    _same("gradient_accumulation_steps"),
    _same("learning_rate"),
    _same("lr_scheduler", apply=_set_spelled(_LR_SCHEDULERS, "diffusers' schedules")),
    _same("lr_warmup_steps"),
    _same("optimizer", apply=_set_spelled(_OPTIMIZERS, "AdamW-bf16, Prodigy and optimi's AdamW / Adam / SGD")),
    _same(
        "optimizer_config",
        note="`weight_decay` / `eps` / `betas` in it become `weight_decay` / `adam_epsilon` / `adam_beta1`, "
        "`adam_beta2`",
        apply=lambda t, v, e: _optimizer_config(t, v, e),
    ),
    _same("adam_beta1"),
    _same("adam_beta2"),
    _same("optimizer_beta1", "adam_beta1"),
    _same("optimizer_beta2", "adam_beta2"),
    _same("adam_epsilon"),
    _same("adam_weight_decay", "weight_decay"),
    _same(
        "max_grad_norm",
        note="0 turns clipping off",
        apply=lambda t, v, e: t.put("max_grad_norm", None if is_inert(v) else _plain(v), e.key),
    ),
    _same("grad_clip_method"),
    _same("gradient_checkpointing"),
    _same("mixed_precision", apply=_set_spelled(_MIXED, "no fp8 autocast: bf16 with an 8-bit base_model_precision")),
    _same("seed"),
    _same("snr_gamma", note="also turns on `loss_weighting: min_snr`", apply=_snr_gamma),
    _same("flow_schedule_shift", "flow_shift"),
    _same(
        "flow_sigmoid_scale",
        "logit_std",
        "flow families draw sigmas as sigmoid(N(0, 1) * scale): `timestep_sampling: logit_normal`, `logit_std`",
    ),
    _same("flow_use_uniform_schedule", "timestep_sampling", "true -> `timestep_sampling: uniform`"),
    _entry("flow_use_beta_schedule", "unsupported", note="the beta sigma schedule is not supported: remove it"),
    _same("disable_tf32", "enable_tf32", "inverted", apply=_inverted_tf32),
    # --- adapter ---
    _same("lora_type", values={"standard": "standard", "lycoris": "lycoris"}),
    _same("lora_rank"),
    _same("lora_alpha"),
    _same("lora_dropout"),
    _same("peft_lora_target_modules", "lora_target_modules"),
    _same(
        "flux_lora_target",
        "lora_target_modules",
        "flux LoRA: its named layer sets (`all`, the default, `all+ffs`, `all+ffs+embedder`, `context`, "
        "`context+ffs`) become the module list",
    ),
    _entry("init_lora", "unsupported", note="training cannot start from an existing LoRA file here: remove it"),
    _entry(
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
    _same("lycoris_config", "lycoris", "the JSON file's settings become the `lycoris` table", apply=_lycoris_config),
    # --- loss ---
    _same("loss_type"),
    _same("huber_schedule"),
    _same("huber_c"),
    _same("offset_noise", "noise_offset", "the switch of `noise_offset` (off: no offset); flow families take none"),
    _same("noise_offset", note="applied only with `offset_noise: true`, as in SimpleTuner"),
    _same("noise_offset_probability", note="applied only with `offset_noise: true`"),
    _same("caption_dropout_probability"),
    _same("use_ema"),
    _same("ema_decay"),
    _same("ema_update_interval"),
    _same("ema_validation"),
    _same("ema_device"),
    _same("ema_warmup_steps"),
    _entry(
        "ema_cpu_only",
        "same",
        "ema_device",
        "true -> `ema_device: cpu` (the EMA lives and updates on the CPU)",
        apply=lambda t, v, e: t.put("ema_device", "cpu", e.key) if as_bool(v, e.key) else None,
    ),
    # --- checkpoints, output ---
    _same("output_dir", note="taken from the working directory, made absolute", apply=_path_key),
    _same("checkpoint_step_interval", "checkpointing_steps"),
    _same("checkpointing_steps"),
    _same("checkpoints_total_limit"),
    _same("resume_from_checkpoint", apply=_resume),
    # --- validation ---
    _same("validation_prompt", apply=_validation_prompt),
    _same("validation_step_interval", "validation_steps"),
    _same("validation_steps"),
    _same("validation_guidance", "validation_guidance_scale"),
    _same("validation_num_inference_steps"),
    _same("num_validation_images"),
    _same("validation_resolution"),
    _same("validation_seed"),
    _same("validation_negative_prompt"),
    _same("validation_guidance_rescale"),
    _same("validation_num_video_frames"),
    # --- data ---
    _same("data_backend_config", "datasets", "its entries are translated and inlined", apply=_data_backend_config),
    _same("resolution", note="also each dataset's default, as in SimpleTuner"),
    _same("cache_dir", "cache_config.cache_dir", "made absolute", apply=_path_key),
    _same("cache_dir_text", "cache_config.text_cache_dir", "made absolute", apply=_path_key),
    _entry(
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
    _entry("tracker_run_name", "ignored", note="the tracker names the run"),
    _entry("logging_dir", "ignored", note="logs are written under `output_dir`"),
    _entry("hub_model_id", "ignored", note="this trainer does not upload to the Hugging Face Hub"),
    _entry("push_to_hub", "unsupported", note="this trainer does not upload to the Hugging Face Hub", apply=_hub),
    _entry("push_checkpoints_to_hub", "unsupported", note="this trainer does not upload to the Hub", apply=_hub),
)


# --- dataset entries (multidatabackend.json) ---------------------------------------------------
def _ds(key: str, kind: Kind = "same", ours: Optional[str] = None, note: str = "", **kw) -> DialectKey:
    return DialectKey(key, "dataset", kind, ours or (key if kind == "same" else None), note, **kw)


def _storage(t: Translation, value: Any, entry: DialectKey) -> None:
    text = str(value).strip()
    if text in ("local", "in_memory"):
        t.put("type", text, entry.key)
    elif text == "aws":
        t.problems.append(
            f"{t.dataset_label}: `type: aws`: S3 storage is not supported yet: copy the data to a local folder and "
            "use `type: local`"
        )
    elif text == "huggingface":
        t.problems.append(
            f"{t.dataset_label}: `type: huggingface`: Hugging Face Hub datasets cannot be downloaded here: download "
            "the dataset's images and captions to a local folder and use `type: local`"
        )
    else:
        t.problems.append(f"{t.dataset_label}: `type: {text}` is not supported here: use `type: local`")


def _dataset_path(t: Translation, value: Any, entry: DialectKey) -> None:
    assert entry.ours is not None
    t.put(entry.ours, t.path(value, f"{t.dataset_label}.{entry.key}"), entry.key)


_CAPTION_STRATEGIES: dict[str, Optional[str]] = {
    "textfile": "textfile",
    "filename": "filename",
    "instanceprompt": "instance_prompt",
    "instance_prompt": "instance_prompt",
    "parquet": "parquet",
    "huggingface": None,
    "webshart": None,
    "csv": None,  # SimpleTuner's `csv` downloads images from a URL list; ours reads local captions
}


def _caption_strategy(t: Translation, value: Any, entry: DialectKey) -> None:
    choices = _CAPTION_STRATEGIES
    ours = _spelled(t, value, entry, choices, "captions from text files, file names, the instance prompt or parquet")
    if ours is not None:
        t.put("caption_strategy", ours, entry.key)


def _only_instance_prompt(t: Translation, value: Any, entry: DialectKey) -> None:
    try:
        on = as_bool(value, entry.key)
    except _Problem as exc:
        t.problems.append(f"{t.dataset_label}: {exc}")
        return
    if on:
        t.put("caption_strategy", "instance_prompt", entry.key)


def _regularisation(t: Translation, value: Any, entry: DialectKey) -> None:
    t.put("is_regularisation_data", _plain(value), entry.key)


def _video(t: Translation, value: Any, entry: DialectKey) -> None:
    """SimpleTuner's ``video`` sub-table: ``num_frames`` maps; the rest is refused or ignored by name."""
    if not isinstance(value, dict):
        t.problems.append(f"{t.dataset_label}: `video` must be an object")
        return
    for key, item in value.items():
        where = f"{t.dataset_label}.video.{key}"
        if key == "num_frames":
            t.put("num_frames", _plain(item), f"video.{key}")
        elif key == "min_frames":
            t.approx(where, "clips shorter than `num_frames` are skipped; `min_frames` is not read separately")
        elif key == "is_i2v" and not is_inert(item):
            t.problems.append(f"{where}: image-to-video training is not supported yet: remove it")
        elif key in ("is_i2v", "bucket_strategy") and (is_inert(item) or item == "aspect_ratio"):
            t.ignore(where, "its default")
        else:
            t.problems.append(f"{where}: not supported here (clips train on `num_frames` frames from their start)")


def _text_embeds_ref(t: Translation, value: Any, entry: DialectKey) -> None:
    t.report.notes.append(
        f"{t.dataset_label}: `text_embeds: {value}`: text embeddings share one folder here (entries are keyed by "
        "caption and encoder, so sharing changes no embedding)"
    )


def _size(t: Translation, value: Any, entry: DialectKey) -> None:
    """A size filter; SimpleTuner reads 0 (and null) as "not set"."""
    if not is_inert(value):
        t.put(entry.key, _plain(value), entry.key)


def _cache_dir_vae(t: Translation, value: Any, entry: DialectKey) -> None:
    if is_inert(value):
        return
    t.put("cache_dir_vae", t.path(value, entry.key), entry.key)


def _probability(t: Translation, value: Any, entry: DialectKey) -> None:
    number = _plain(value)
    if number == 0:
        t.approx(
            f"{t.dataset_label}.probability",
            "0 leaves the dataset out of training here; SimpleTuner's loader reads a probability of 0 as 1.0",
        )
    t.put("probability", number, entry.key)


def _vae_clear(t: Translation, value: Any, entry: DialectKey) -> None:
    if is_inert(value):
        t.ignore(f"{t.dataset_label}.{entry.key}", "off")
        return
    t.approx(
        f"{t.dataset_label}.{entry.key}",
        "latents are not re-encoded each epoch: each image keeps one crop for the whole run (random crops are "
        "drawn once per image from the seed)",
    )


DATASET_CORE: tuple[DialectKey, ...] = (
    _ds("id"),
    _ds("type", apply=_storage),
    _ds("instance_data_dir", note="taken from the working directory, made absolute", apply=_dataset_path),
    _ds("dataset_type", note="`image` or `video`; `text_embeds` entries set the text cache folder"),
    _ds("disabled"),
    _ds("disable", "same", "disabled"),
    _ds(
        "huggingface",
        "unsupported",
        note="Hugging Face Hub datasets cannot be downloaded here: download the dataset to a local folder and use "
        "`type: local`",
    ),
    _ds("crop"),
    _ds("crop_style"),
    _ds("crop_aspect"),
    _ds("crop_aspect_buckets"),
    _ds("resolution"),
    _ds("resolution_type"),
    _ds("minimum_image_size", note="0 means unset, as in SimpleTuner", apply=_size),
    _ds("maximum_image_size", note="0 means unset, as in SimpleTuner", apply=_size),
    _ds("target_downsample_size", note="0 means unset, as in SimpleTuner", apply=_size),
    _ds("minimum_aspect_ratio"),
    _ds("maximum_aspect_ratio"),
    _ds("caption_strategy", note="`instanceprompt` -> `instance_prompt`", apply=_caption_strategy),
    _ds("instance_prompt"),
    _ds("prepend_instance_prompt"),
    _ds(
        "only_instance_prompt",
        "same",
        "caption_strategy",
        "true -> `caption_strategy: instance_prompt`",
        apply=_only_instance_prompt,
    ),
    _ds("parquet"),
    _ds("repeats"),
    _ds("probability", apply=_probability),
    _ds("is_regularisation_data", apply=_regularisation),
    _ds("is_regularization_data", "same", "is_regularisation_data", apply=_regularisation),
    _ds("cache_dir_vae", note="`{model_family}` is SimpleTuner's family name; made absolute", apply=_cache_dir_vae),
    _ds("cache_dir", "same", "cache_config.text_cache_dir", "of a `dataset_type: text_embeds` entry"),
    _ds("default", "ignored", note="of a `text_embeds` entry: there is one text cache folder"),
    _ds(
        "text_embeds",
        "approximated",
        "cache_config.text_cache_dir",
        note="every dataset's text embeddings share one folder",
        apply=_text_embeds_ref,
    ),
    _ds("video", "same", "num_frames", "`video.num_frames` -> `num_frames`", apply=_video),
    _ds("vae_cache_clear_each_epoch", "approximated", note="each image keeps one crop for the run", apply=_vae_clear),
)

#: Top-level keys SimpleTuner gives each dataset that does not set its own.
_DATASET_DEFAULTS_FROM_TOP = (
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
TOP_DATASET_KEYS: tuple[DialectKey, ...] = tuple(
    _entry(
        key,
        "same",
        "datasets[].caption_strategy" if key == "only_instance_prompt" else f"datasets[].{key}",
        "each dataset's default, as in SimpleTuner",
    )
    for key in _DATASET_DEFAULTS_FROM_TOP
) + (
    _entry(
        "aspect_bucket_rounding",
        "approximated",
        None,
        "aspect ratios are rounded to 2 decimals here (SimpleTuner's default); another value is approximated by 2",
        apply=lambda t, v, e: (
            t.ignore(e.key, "2, as here")
            if _plain(v) == 2
            else t.approx(e.key, f"{v!r}: aspect ratios are rounded to 2 decimals here")
        ),
    ),
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
}
#: Each dataset's defaults in SimpleTuner's loader where ours differ.
SIMPLETUNER_DATASET_DEFAULTS: dict[str, Any] = {
    "crop": False,
    "crop_aspect": "square",
    "crop_style": "random",
    "allow_upscale": True,  # SimpleTuner upscales small images whatever the factor (`max_upscale_threshold` unset)
}
#: Flow-matching families: SimpleTuner draws sigmas as sigmoid(N(0, 1) * flow_sigmoid_scale) unless a
#: uniform or beta schedule is asked for.
_FLOW_FAMILIES = ("sd3", "flux", "wan")


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


def _flow_sampling(t: Translation, bare: dict[str, Any]) -> None:
    """SimpleTuner's sigma draw for flow families: sigmoid(N(0, 1) * flow_sigmoid_scale), unless
    ``flow_use_uniform_schedule`` (uniform) or ``flow_use_beta_schedule`` (not supported) is on."""
    if FAMILIES.get(t.family or "") not in _FLOW_FAMILIES:
        return
    try:
        uniform = as_bool(bare.get("flow_use_uniform_schedule", False), "flow_use_uniform_schedule")
        beta = as_bool(bare.get("flow_use_beta_schedule", False), "flow_use_beta_schedule")
        scale = as_number(bare.get("flow_sigmoid_scale", 1.0), "flow_sigmoid_scale")
    except _Problem as exc:
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


#: Every value spelling the translation reads, by key (for documentation/MIGRATING_FROM_SIMPLETUNER.md).
VALUE_TABLES: dict[str, Mapping[str, Optional[str]]] = {
    "model_family": FAMILIES,
    "base_model_precision": _PRECISIONS,
    "optimizer": _OPTIMIZERS,
    "lr_scheduler": _LR_SCHEDULERS,
    "mixed_precision": _MIXED,
    "caption_strategy": _CAPTION_STRATEGIES,
}

#: SimpleTuner features whose settings share a prefix and are turned on by one switch: with the
#: switch off (or absent), the other keys of the feature do nothing.
_FEATURE_SWITCHES: dict[str, str] = {
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


def _switch_of(name: str) -> Optional[str]:
    for prefix, switch in _FEATURE_SWITCHES.items():
        if name.startswith(prefix) and name != switch:
            return switch
    return None


def _switched_off(bare: Mapping[str, Any], name: str) -> bool:
    switch = _switch_of(name)
    return switch is not None and is_inert(bare.get(switch))


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


def _flux_lora_target(t: Translation, bare: Mapping[str, Any]) -> None:
    """SimpleTuner's Flux LoRA adapts the layers `flux_lora_target` names (default `all`), not our default."""
    if FAMILIES.get(t.family or "") != "flux" or t.out.get("training_type") != "lora":
        if "flux_lora_target" in bare:
            t.ignore("flux_lora_target", "not a Flux LoRA")
        return
    if t.out.get("lora_type", "standard") != "standard" or t.is_set("lora_target_modules"):
        if "flux_lora_target" in bare:
            t.ignore("flux_lora_target", "the LyCORIS preset or `peft_lora_target_modules` picks the layers")
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


#: optimizer_config settings that are keys of their own here.
_LIFTED_OPTIMIZER_SETTINGS = {"weight_decay": "weight_decay", "eps": "adam_epsilon"}


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
        if key in _LIFTED_OPTIMIZER_SETTINGS:
            t.put(_LIFTED_OPTIMIZER_SETTINGS[key], item, f"optimizer_config:{key}")
        elif key == "betas" and isinstance(item, (list, tuple)) and len(item) == 2:
            t.put("adam_beta1", item[0], "optimizer_config:betas")
            t.put("adam_beta2", item[1], "optimizer_config:betas")
        else:
            rest[key] = item
    if rest:
        t.put("optimizer_config", rest, entry.key)


def _validation_defaults(t: Translation, bare: Mapping[str, Any]) -> None:
    """SimpleTuner's validation defaults that depend on the family: Wan renders the pipeline's 81 frames;
    families with a negative prompt get SimpleTuner's default one (flux has none)."""
    if not t.out.get("validation_prompt"):
        return
    family = FAMILIES.get(t.family or "")
    if family == "wan" and "validation_num_video_frames" not in bare:
        t.put("validation_num_video_frames", 81, "SimpleTuner's default (the Wan pipeline's 81 frames)")
        t.report.defaults.append("`validation_num_video_frames: 81` (the Wan pipeline's default, as SimpleTuner)")
    if family != "flux" and "validation_negative_prompt" not in bare:
        t.put("validation_negative_prompt", "blurry, cropped, ugly", "SimpleTuner's default negative prompt")
        t.report.defaults.append("`validation_negative_prompt: 'blurry, cropped, ugly'` (SimpleTuner's default)")


def _optimizer_meaning(t: Translation, bare: Mapping[str, Any]) -> None:
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


def _noise_offset(t: Translation, bare: Mapping[str, Any]) -> None:
    """SimpleTuner adds `noise_offset` (default 0.1, with `noise_offset_probability`, default 0.25) only
    when `offset_noise` is on, and never to flow-matching models."""
    given = [k for k in ("offset_noise", "noise_offset", "noise_offset_probability") if k in bare]
    if not given:
        return
    try:
        on = as_bool(bare.get("offset_noise", False), "offset_noise")
    except _Problem as exc:
        t.problems.append(str(exc))
        return
    if not on:
        for key in given:
            t.ignore(key, "`offset_noise` is off: SimpleTuner adds no noise offset")
        return
    if FAMILIES.get(t.family or "") in _FLOW_FAMILIES:
        for key in given:
            t.ignore(key, "SimpleTuner adds no noise offset to flow-matching models")
        return
    t.put("noise_offset", _plain(bare.get("noise_offset", 0.1)), "noise_offset")
    t.put("noise_offset_probability", _plain(bare.get("noise_offset_probability", 0.25)), "noise_offset_probability")
    t.report.mapped.append(
        "`offset_noise` + `noise_offset` + `noise_offset_probability` -> `noise_offset`, `noise_offset_probability`"
    )


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
        (entry.apply or _rename)(t, value, entry)
    except _Problem as exc:
        t.problems.append(f"{label + ': ' if label else ''}{exc}")
    if len(t.problems) == before and not any(line.startswith(f"`{shown}") for line in t.report.mapped):
        t.report.mapped.append(f"`{shown}` -> `{entry.ours}`" if entry.ours != name else f"`{shown}`")
        if entry.kind == "approximated" and not is_inert(value):
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


_UNSUPPORTED_DATASET_TYPES = {
    "image_embeds": "image-embedding caches are not used here",
    "conditioning_image_embeds": "conditioning image embeddings belong to image-to-video families not supported yet",
    "conditioning": "conditioning datasets (ControlNet, edit pairs) are not supported yet",
    "audio": "audio datasets are not supported",
    "caption": "caption-only datasets are not supported",
}


def _area_resolution(t: Translation, top: dict[str, Any]) -> None:
    """`resolution_type: area` at the top level: `resolution` is megapixels. Each dataset gets it (ours is a
    side in pixels at the top level); the top level keeps the square side of that area, rounded to 64 px."""
    try:
        megapixels = float(as_number(t.out["resolution"], "resolution"))
    except _Problem as exc:
        t.problems.append(str(exc))
        return
    top["resolution"] = megapixels
    side = max(64, int(round(math.sqrt(megapixels * 1e6) / 64)) * 64)
    t.out["resolution"] = side
    t.report.notes.append(
        f"`resolution: {megapixels}` megapixels (`resolution_type: area`) -> each dataset's `resolution`; the "
        f"top-level `resolution` (validation's default size) is {side} px"
    )


def _translate_datasets(t: Translation, entries: list[Any], top: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
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
        if kind in _UNSUPPORTED_DATASET_TYPES:
            if not as_bool(entry.get("disabled", False), f"{label}.disabled"):
                t.problems.append(f"{label}: `dataset_type: {kind}`: {_UNSUPPORTED_DATASET_TYPES[kind]}")
            continue
        t.dataset, t.dataset_label = {}, label
        for name, value in _bare_keys(entry, t, label).items():
            _apply_key(t, name, value, entry_for(name, "dataset"), label)
        if "resolution" in top and "resolution" not in entry:
            t.put("resolution", top["resolution"], "top-level resolution (megapixels)")
        for key in _DATASET_DEFAULTS_FROM_TOP:
            if key in top and key not in entry and f"--{key}" not in entry:
                item = _BY_KEY[("dataset", key)]
                (item.apply or _rename)(t, top[key], item)
        for key, default in SIMPLETUNER_DATASET_DEFAULTS.items():
            if not t.is_set(key):
                t.put(key, default, f"SimpleTuner's dataset default {key}")
        out.append(t.dataset)
        t.dataset, t.dataset_label = None, ""
    return out


def translate(
    raw: Mapping[str, Any],
    config_path: Optional[Path] = None,
    cwd: Optional[Path] = None,
) -> tuple[dict[str, Any], Report]:
    """SimpleTuner config ``raw`` -> (native config, report). Raises DialectError listing every key that
    is unsupported or unreadable, and every setting two keys set to different values."""
    t = Translation(cwd=Path(cwd or os.getcwd()), config_dir=config_path.parent if config_path else None)
    bare = t.bare = _bare_keys(raw, t)
    family = bare.get("model_family")
    t.family = str(family).strip() if isinstance(family, str) else None
    top_for_datasets: dict[str, Any] = {}
    for name, value in bare.items():
        if name in _READ_WITH_OTHERS:
            continue
        if name in _DATASET_DEFAULTS_FROM_TOP:
            top_for_datasets[name] = value
            t.report.mapped.append(f"`{name}` -> each dataset's `{name}`")
            continue
        _apply_key(t, name, value, entry_for(name), "")
    for name, default in SIMPLETUNER_DEFAULTS.items():
        if name in bare:
            continue
        if name in _DATASET_DEFAULTS_FROM_TOP:
            top_for_datasets[name] = default
            t.report.defaults.append(f"`{name}: {default!r}` for each dataset that does not set it")
            continue
        entry = entry_for(name)
        assert entry is not None and entry.ours is not None, name
        if name == "flow_schedule_shift" and FAMILIES.get(t.family or "") not in _FLOW_FAMILIES:
            continue
        if t.is_set(entry.ours):
            continue
        (entry.apply or _rename)(t, default, entry)
        t.report.defaults.append(f"`{name}: {default!r}` (SimpleTuner's default; the config does not set it)")
    _flow_sampling(t, bare)
    _noise_offset(t, bare)
    _flux_lora_target(t, bare)
    _optimizer_meaning(t, bare)
    _validation_defaults(t, bare)
    cache = t.out.setdefault("cache_config", {})
    if "cache_dir" not in cache:  # SimpleTuner keeps its caches under cache/ in the working directory
        cache["cache_dir"] = str(t.cwd / "cache")
        t.report.notes.append(f"caches under {cache['cache_dir']} (a dataset's `cache_dir_vae` wins for its latents)")
    flavour = bare.get("model_flavour")
    if isinstance(flavour, str) and flavour:
        resolve_flavour(t, flavour, t.out.get("pretrained_model_name_or_path"))
    elif "pretrained_model_name_or_path" not in t.out and t.family in DEFAULT_FLAVOURS:
        default = DEFAULT_FLAVOURS[t.family]
        t.problems.append(
            f"neither `pretrained_model_name_or_path` nor `model_flavour` is set: SimpleTuner would use its default "
            f"{t.family} flavour {default!r}; {_hub_advice(FLAVOURS[t.family][default])}"
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
