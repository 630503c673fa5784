"""Read a JSON config (orjson), apply ``--set`` overrides, validate, check paths.

Everything is checked before any model is loaded, and every problem is reported at once.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import orjson
from pydantic import ValidationError

from simpletuner.configuration.dataset_sections import url_protocol
from simpletuner.configuration.errors import ConfigError, format_validation_error
from simpletuner.configuration.model_folder import looks_like_hub_id, looks_local, settle_model_family
from simpletuner.configuration.partial import InvalidInput, PartialModel, partial_config, run_rules
from simpletuner.configuration.schema import CacheConfig, TrainingConfig
from simpletuner.configuration.sections import METADATA_CAPTION_STRATEGIES, metadata_file_format
from simpletuner.configuration.simpletuner import translate as dialect
from simpletuner.configuration.simpletuner.reading import Report

logger = logging.getLogger(__name__)

_DEFAULT_OUTPUT_DIR: str = TrainingConfig.model_fields["output_dir"].default
_DEFAULT_CACHE_DIR: str = CacheConfig.model_fields["cache_dir"].default


@dataclass(frozen=True)
class LoadedConfig:
    """A validated config plus the raw JSON it came from (kept for later inspection)."""

    config: TrainingConfig
    raw: dict[str, Any]
    path: Path | None
    #: Where ``pretrained_model_name_or_path`` is a hub id (kept in ``raw``): the snapshot (a
    #: ``simpletuner.hub.HubSnapshot``) whose folder ``config`` names instead; None for a local folder.
    hub: Any = None
    #: The same for ``pretrained_vae_model_name_or_path``: its snapshot where it is a hub id; None otherwise.
    hub_vae: Any = None
    #: The same for ``controlnet_model_name_or_path``.
    hub_controlnet: Any = None


def _read_json(path: Path, what: str) -> Any:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError([f"{what} {path} does not exist"]) from None
    except OSError as exc:  # a folder, no permission, a name too long, ...
        raise ConfigError([f"{what} {path} cannot be read: {exc.strerror}"]) from None
    except ValueError:  # an embedded NUL
        raise ConfigError([f"{what} {str(path)!r} holds a NUL character (\\x00), which no path may contain"]) from None
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ConfigError([f"{what} {path} is not valid JSON: {exc}"]) from None


def read_config_file(path: Path) -> Any:
    """The config file's content: JSON, or YAML for a ``.yaml`` / ``.yml`` file (an ai-toolkit job); an ai-toolkit
    job's ``${NAME}`` environment variables filled in as ai-toolkit fills them (configuration/aitoolkit/reading.py)."""
    from simpletuner.configuration.aitoolkit import reading as ait_reading

    if not ait_reading.is_yaml_path(path):
        raw = _read_json(path, "config file")
        if not (ait_reading.looks_like_ai_toolkit(raw) and "${" in path.read_text(encoding="utf-8")):
            return raw
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([f"config file {path} does not exist"]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"config file {path} cannot be read: {exc}"]) from None
    try:
        return ait_reading.parse_job_text(text, ait_reading.is_yaml_path(path), str(path))
    except dialect.DialectError as exc:
        raise ConfigError(exc.problems, exc.source) from None


def parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b=3`` -> (['a', 'b'], 3). Values are JSON when they parse as JSON, else strings."""
    if "=" not in item:
        raise ConfigError([f"override {item!r} must look like key=value (e.g. --set train_batch_size=4)"])
    key, value = item.split("=", 1)
    try:
        parsed = orjson.loads(value)
    except orjson.JSONDecodeError:
        parsed = value
    return key.strip().split("."), parsed


def apply_overrides(raw: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Return a copy of ``raw`` with each ``key.path=value`` applied."""
    out = orjson.loads(orjson.dumps(raw))
    for item in overrides:
        keys, value = parse_override(item)
        node = out
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError([f"override {item!r}: {k} is not an object"])
        node[keys[-1]] = value
    return out


def _model_folder(config, origin: str = "") -> Iterator[str]:
    """``origin``: where a relative path was looked for (:func:`_model_origin`), said when it is not there."""
    model = config.pretrained_model_name_or_path
    if not looks_local(model):
        return
    p = Path(model).expanduser()
    if not p.exists():
        yield (
            f"pretrained_model_name_or_path: {p} does not exist ({origin}give a local diffusers-format folder, "
            "or create a tiny one with `simpletuner zoo --family sd --out DIR`)"
        )
    elif not p.is_dir():
        yield f"pretrained_model_name_or_path: {p} is a file; it must be a diffusers-format folder"
    elif not (p / "model_index.json").exists():
        yield f"pretrained_model_name_or_path: {p} has no model_index.json; is it a diffusers-format pipeline folder?"
    elif not os.access(p, os.R_OK | os.X_OK):
        yield f"pretrained_model_name_or_path: {p} is not readable"


#: The one config file a separate VAE folder must hold, in its ``vae/`` subfolder or at its root.
COMPONENT_CONFIG = "config.json"


def component_subfolder(folder: Path, component: str) -> str | None:
    """Where a folder named for one component (``pretrained_vae_model_name_or_path``) holds it: ``component`` when
    it has ``<component>/config.json`` (a pipeline folder), else None, its root (a component repo such as
    ``madebyollin/sdxl-vae-fp16-fix``). SimpleTuner's order: it loads ``subfolder="vae"`` first, then the root."""
    return component if (folder / component / COMPONENT_CONFIG).is_file() else None


def _vae_folder(config, origin: str = "") -> Iterator[str]:
    """A separate VAE given as a local path exists and holds a VAE config (``vae/config.json`` or ``config.json``);
    its class and latent channels are checked against the family when the model spec is made."""
    vae = config.pretrained_vae_model_name_or_path
    if vae is None or not looks_local(vae):
        return
    key = "pretrained_vae_model_name_or_path"
    p = Path(vae).expanduser()
    layout = "config.json + diffusion_pytorch_model.safetensors at its root, or a vae/ subfolder holding them"
    if not p.exists():
        yield (
            f"{key}: {p} does not exist ({origin}give a local folder or a hub id (org/name) holding a diffusers VAE "
            f"({layout}), or remove the key to use the model's own VAE)"
        )
    elif not p.is_dir():
        yield (
            f"{key}: {p} is a file; it must be a folder holding a diffusers VAE ({layout}): a single-file VAE "
            "checkpoint is not read here, use the diffusers version of it (the hub repo it came from, or convert it "
            "with diffusers' AutoencoderKL.from_single_file(...).save_pretrained(folder))"
        )
    elif not os.access(p, os.R_OK | os.X_OK):
        yield f"{key}: {p} is not readable"
    elif not (p / (component_subfolder(p, "vae") or "") / COMPONENT_CONFIG).is_file():
        yield (
            f"{key}: {p} holds no VAE config (neither vae/config.json nor config.json): point it at a diffusers VAE "
            f"folder ({layout}), or remove the key to use the model's own VAE"
        )


def _output_dir(config) -> Iterator[str]:
    out = Path(config.output_dir).expanduser()
    if out.exists() and not out.is_dir():
        yield f"output_dir: {out} is a file; choose a folder"


def _cache_dir(config) -> Iterator[str]:
    cache = Path(config.cache_config.cache_dir).expanduser()
    if cache.exists() and not cache.is_dir():
        yield f"cache_config.cache_dir: {cache} is a file; choose a folder"


def _dataset_dirs(config) -> Iterator[str]:
    for i, ds in enumerate(config.datasets or []):
        try:
            d = Path(ds.instance_data_dir).expanduser()
            is_left_out = ds.disabled or ds.probability == 0  # never read: its folder may be gone
        except InvalidInput:  # this entry failed validation: its own errors say why
            continue
        if not is_left_out and url_protocol(ds.instance_data_dir) is None and not d.is_dir():
            yield f"datasets[{i}].instance_data_dir: {d} is not a folder"  # a URL is checked when it is listed
        for key in ("conditioning_data_dir", "mask_data_dir"):
            folder = getattr(ds, key)
            if not is_left_out and folder is not None and not Path(folder).expanduser().is_dir():
                yield f"datasets[{i}].{key}: {Path(folder).expanduser()} is not a folder"


def _validation_image_files(config) -> Iterator[str]:
    images = config.validation_image
    for path in [images] if isinstance(images, str) else images or []:
        if not Path(path).expanduser().is_file():
            yield f"validation_image: {Path(path).expanduser()} is not a file; give an image file"


def _caption_files(config) -> Iterator[str]:
    """Each metadata caption file exists (and, read as Parquet, pyarrow is installed)."""
    for i, ds in enumerate(config.datasets or []):
        try:
            strategy = ds.caption_strategy
            if strategy not in METADATA_CAPTION_STRATEGIES or getattr(ds, strategy) is None:
                continue
            table = getattr(ds, strategy)
            path = Path(table.path).expanduser()
        except InvalidInput:  # this entry failed validation: its own errors say why
            continue
        if not path.is_file():
            yield f"datasets[{i}].{strategy}.path: {path} is not a file; give the {strategy} file of captions"
        elif metadata_file_format(strategy, table.path) == "parquet" and not _is_installed("pyarrow"):
            yield (
                f"datasets[{i}].{strategy}.path: reading a Parquet file needs pyarrow, which this Python "
                f'({sys.executable}) does not have: install it with `pip install -e ".[parquet]"` in the '
                "simpletuner checkout (or `pip install pyarrow`)"
            )


def _resume_dir(config) -> Iterator[str]:
    if config.resume_from_checkpoint not in (None, "latest"):
        ck = Path(config.resume_from_checkpoint).expanduser()
        if not ck.is_dir():
            yield f"resume_from_checkpoint: {ck} is not a folder (use 'latest' or a checkpoint-N folder)"


#: ``report_to`` -> (modules, any of which Accelerate logs through; the extra that installs one).
_TRACKER_PACKAGES: dict[str, tuple[tuple[str, ...], str]] = {
    "tensorboard": (("tensorboard", "tensorboardX"), "tensorboard"),
    "wandb": (("wandb",), "wandb"),
}


def _is_installed(module: str) -> bool:
    """Installed as Accelerate judges it (a spec and package metadata), without importing it."""
    try:
        if importlib.util.find_spec(module) is None:
            return False
        importlib.metadata.metadata(module)
    except (ImportError, ValueError, importlib.metadata.PackageNotFoundError):
        return False
    return True


def _tracker_package(config) -> Iterator[str]:
    """Accelerate drops a tracker whose package is missing with one warning and trains unlogged."""
    modules, extra = _TRACKER_PACKAGES.get(config.report_to, ((), ""))
    if modules and not any(_is_installed(m) for m in modules):
        yield (
            f"report_to: {config.report_to!r} needs the {modules[0]} package, which this Python "
            f'({sys.executable}) does not have: install it with `pip install -e ".[{extra}]"` in the '
            f'simpletuner checkout (or `pip install {modules[0]}`), or set `report_to: "none"` to train '
            "without a tracker"
        )


def _feature_packages(config) -> Iterator[str]:
    """The optional package a chosen optimizer, adapter or base precision needs, checked before anything loads
    (the builders check again, but only after the cache fill)."""
    wanted = []
    optimizer = str(getattr(config, "optimizer", ""))
    if optimizer == "prodigy":
        wanted.append(("optimizer", optimizer, "prodigyopt", "prodigy", "prodigyopt"))
    elif optimizer.startswith("optimi-"):
        wanted.append(("optimizer", optimizer, "optimi", "optimi", "torch-optimi"))
    elif optimizer.startswith("bnb-"):
        wanted.append(("optimizer", optimizer, "bitsandbytes", "bitsandbytes", "bitsandbytes"))
    if getattr(config, "training_type", None) == "lora" and getattr(config, "lora_type", None) == "lycoris":
        wanted.append(("lora_type", "lycoris", "lycoris", "lycoris", "lycoris-lora"))
    precision = str(getattr(config, "base_model_precision", "no_change"))
    if precision.startswith("q"):
        wanted.append(("base_model_precision", precision, "optimum.quanto", "quanto", "optimum-quanto"))
    elif precision.endswith("_torchao"):
        wanted.append(("base_model_precision", precision, "torchao", "torchao", "torchao"))
    for key, value, module, extra, distribution in wanted:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            yield (
                f"{key}: {value!r} needs the {distribution} package, which this Python ({sys.executable}) does not "
                f'have: pip install -e ".[{extra}]" in the simpletuner checkout (or pip install {distribution}), or '
                f"choose another {key}"
            )


_PATH_CHECKS = (
    _model_folder,
    _vae_folder,
    _output_dir,
    _cache_dir,
    _dataset_dirs,
    _caption_files,
    _validation_image_files,
    _resume_dir,
    _tracker_package,
    _feature_packages,
)


def check_paths(config: TrainingConfig | PartialModel, model_origin: str = "", vae_origin: str = "") -> list[str]:
    """Problems with paths (and tracker packages) the run needs; empty when all is well.

    Works on a config that failed validation too: a check whose field is itself invalid is skipped.
    ``model_origin`` / ``vae_origin``: where a relative model / VAE path was looked for (:func:`_model_origin`).
    """
    model_check = (lambda c: _model_folder(c, model_origin)) if model_origin else _model_folder
    vae_check = (lambda c: _vae_folder(c, vae_origin)) if vae_origin else _vae_folder
    return run_rules((model_check, vae_check, *_PATH_CHECKS[2:]), config)


def _resolve_datasets(raw: dict[str, Any], base_dir: Path | None, problems: list[str]) -> dict[str, Any]:
    """``data_backend_config`` read into ``datasets`` (the file's problems go to ``problems``)."""
    resolved = dict(raw)
    if isinstance(resolved.get("data_backend_config"), str) and "datasets" not in resolved:
        dpath = Path(resolved["data_backend_config"]).expanduser()
        if not dpath.is_absolute() and base_dir is not None:
            dpath = base_dir / dpath
        try:
            datasets = _read_json(dpath, "data_backend_config")
        except ConfigError as exc:
            problems.extend(exc.problems)
        else:
            if not isinstance(datasets, list):
                problems.append(f"data_backend_config: {dpath} must hold a JSON list of dataset entries")
            else:
                resolved.pop("data_backend_config")
                resolved["datasets"] = datasets
    return resolved


def _from_base(value: Any, base_dir: Path) -> Any:
    """``value`` taken from ``base_dir`` when it is a relative path (``~``, absolute paths and URLs such as
    ``s3://bucket/prefix`` stay)."""
    if not isinstance(value, str) or not value or value.startswith("~") or Path(value).is_absolute():
        return value
    if url_protocol(value) is not None:
        return value
    return os.path.normpath(os.path.join(os.path.abspath(base_dir), value))


def _model_from_base(value: Any, base_dir: Path) -> Any:
    """A relative ``pretrained_model_name_or_path`` (or ``pretrained_vae_model_name_or_path``) taken from ``base_dir``
    like every other path; one that is not there and reads as a hub id (``org/name``) stays as written."""
    local = _from_base(value, base_dir)
    if local is value or os.path.exists(local) or not looks_like_hub_id(value):
        return local
    return value


def _model_origin(raw: dict[str, Any], base_dir: Path | None, key: str = "pretrained_model_name_or_path") -> str:
    """Where a relative ``pretrained_model_name_or_path`` (or another model path ``key``) was looked for, for the
    message when it is not there: the config file's folder, and the working directory when the folder is there
    instead (the rule before)."""
    value = raw.get(key)
    if base_dir is None or not isinstance(value, str) or _model_from_base(value, base_dir) in (value, None):
        return ""
    origin = f"{value!r} is taken from the config file's folder {os.path.abspath(base_dir)}, as every relative path"
    if os.path.isdir(value):
        origin += (
            f"; the working directory holds it ({os.path.abspath(value)}), but relative paths no longer start there: "
            "write that path, or one relative to the config file's folder"
        )
    return origin + "; "


def _resolve_relative_paths(raw: dict[str, Any], base_dir: Path | None) -> dict[str, Any]:
    """Relative ``pretrained_model_name_or_path`` / ``pretrained_vae_model_name_or_path`` (unless a hub id:
    :func:`_model_from_base`), ``output_dir``,
    ``cache_config.cache_dir`` / ``text_cache_dir``, ``datasets[].instance_data_dir`` /
    ``conditioning_data_dir`` / ``mask_data_dir`` / ``cache_dir_vae``, a ``validation_image``, a
    ``validation_prompts`` file and a ``resume_from_checkpoint`` folder, made absolute against ``base_dir``
    (the config file's folder), so the same config run from another folder writes and reads the same places.
    ``--set`` values are part of the config and follow the same rule. Without ``base_dir`` (a dict, no file) nothing
    changes: relative paths are then taken from the working directory."""
    if base_dir is None:
        return raw
    out = dict(raw)
    for key in ("pretrained_model_name_or_path", "pretrained_vae_model_name_or_path", "controlnet_model_name_or_path"):
        if isinstance(out.get(key), str):
            out[key] = _model_from_base(out[key], base_dir)
    out["output_dir"] = _from_base(out.get("output_dir", _DEFAULT_OUTPUT_DIR), base_dir)
    if isinstance(out.get("resume_from_checkpoint"), str) and out["resume_from_checkpoint"] != "latest":
        out["resume_from_checkpoint"] = _from_base(out["resume_from_checkpoint"], base_dir)
    if isinstance(out.get("validation_prompts"), str):  # a prompt file (schema.py reads it)
        out["validation_prompts"] = _from_base(out["validation_prompts"], base_dir)
    image = out.get("validation_image")
    if isinstance(image, str):
        out["validation_image"] = _from_base(image, base_dir)
    elif isinstance(image, list):
        out["validation_image"] = [_from_base(v, base_dir) if isinstance(v, str) else v for v in image]
    cache = out.get("cache_config", {})
    if isinstance(cache, dict):
        out["cache_config"] = {**cache, "cache_dir": _from_base(cache.get("cache_dir", _DEFAULT_CACHE_DIR), base_dir)}
        if "text_cache_dir" in cache:
            out["cache_config"]["text_cache_dir"] = _cache_folder_from_base(cache["text_cache_dir"], base_dir)
    datasets = out.get("datasets")
    if isinstance(datasets, list):
        out["datasets"] = [
            {**d, "instance_data_dir": _from_base(d["instance_data_dir"], base_dir)}
            if isinstance(d, dict) and "instance_data_dir" in d
            else d
            for d in datasets
        ]
        for key in ("conditioning_data_dir", "mask_data_dir"):
            out["datasets"] = [
                {**d, key: _from_base(d[key], base_dir)} if isinstance(d, dict) and isinstance(d.get(key), str) else d
                for d in out["datasets"]
            ]
        out["datasets"] = [_caption_tables_from_base(d, base_dir) for d in out["datasets"]]
        out["datasets"] = [
            {**d, "cache_dir_vae": _cache_folder_from_base(d["cache_dir_vae"], base_dir)}
            if isinstance(d, dict) and "cache_dir_vae" in d
            else d
            for d in out["datasets"]
        ]
    return out


def _cache_folder_from_base(value: Any, base_dir: Path) -> Any:
    """A ``cache_dir_vae`` / ``text_cache_dir`` taken from ``base_dir`` like any path, unless it starts at
    ``{output_dir}`` (already absolute once filled in)."""
    if isinstance(value, str) and value.startswith("{output_dir}"):
        return value
    return _from_base(value, base_dir)


def _caption_tables_from_base(dataset: Any, base_dir: Path) -> Any:
    """A dataset entry whose `parquet` / `csv` / `jsonl` table's relative `path` is taken from ``base_dir``."""
    if not isinstance(dataset, dict):
        return dataset
    out = dataset
    for name in METADATA_CAPTION_STRATEGIES:
        table = dataset.get(name)
        if isinstance(table, dict) and "path" in table:
            out = {**out, name: {**table, "path": _from_base(table["path"], base_dir)}}
    return out


def validate_config(
    raw: dict[str, Any], base_dir: Path | None = None, source: str | None = None, check_files: bool = True
) -> TrainingConfig:
    """Validate a raw dict into a TrainingConfig or raise ConfigError listing every problem.

    One pass: unknown keys, wrong types and values, cross-field rules (those whose inputs are
    valid) and missing paths are all reported together.
    """
    if not isinstance(raw, dict):
        raise ConfigError(["the config must be a JSON object ({...})"], source)
    problems: list[str] = []
    resolved = _resolve_relative_paths(_resolve_datasets(raw, base_dir, problems), base_dir)
    resolved, family_problems = settle_model_family(resolved)
    problems.extend(family_problems)
    try:
        config: TrainingConfig | PartialModel = TrainingConfig.model_validate(resolved)
    except ValidationError as exc:
        problems.extend(format_validation_error(exc, TrainingConfig))
        config, rule_problems = partial_config(TrainingConfig, resolved, exc)
        problems.extend(rule_problems)
    if check_files:
        vae_origin = _model_origin(raw, base_dir, "pretrained_vae_model_name_or_path")
        problems.extend(check_paths(config, _model_origin(raw, base_dir), vae_origin))
    if problems:
        raise ConfigError(problems, source)
    assert isinstance(config, TrainingConfig)  # a failed validation always leaves at least one line
    return config


def read_raw_config(path: str | os.PathLike, overrides: Iterable[str] = ()) -> dict[str, Any]:
    """The config file's JSON object with ``--set`` overrides applied, not validated yet. A SimpleTuner
    config is translated first (configuration/simpletuner/; its report is logged once per file), so the
    overrides, like everything after, use our key names."""
    p = Path(path)
    raw = read_config_file(p)
    if not isinstance(raw, dict):
        raise ConfigError(["the config must be a JSON object ({...})"], str(p))
    return apply_overrides(native_config(raw, p), overrides)


NATIVE_KEYS: frozenset[str] = frozenset(TrainingConfig.model_fields)
_REPORTED: set[Path] = set()


def translate_dialect(raw: dict[str, Any], path: Path | None = None) -> tuple[str, dict[str, Any], Report | None]:
    """``(dialect, native config, report)``: ``("native", raw, None)`` for a native config; a SimpleTuner config
    (``"simpletuner"``) or an ai-toolkit job (``"ai-toolkit"``) translated, with the translation's report. Raises
    ConfigError listing every key that cannot be translated."""
    from simpletuner.configuration.aitoolkit.reading import looks_like_ai_toolkit

    is_job = looks_like_ai_toolkit(raw)
    if not is_job and not dialect.looks_like_simpletuner(raw, NATIVE_KEYS):
        return "native", raw, None
    try:
        if is_job:  # its table is imported only for a job file (a native config's start never pays for it)
            from simpletuner.configuration.aitoolkit import translate as ait

            return ("ai-toolkit", *ait.translate(raw, path))
        return ("simpletuner", *dialect.translate(raw, path))
    except dialect.DialectError as exc:
        raise ConfigError(exc.problems, exc.source) from None


def native_config(raw: dict[str, Any], path: Path | None = None) -> dict[str, Any]:
    """``raw`` itself when it is a native config; a SimpleTuner config or an ai-toolkit job translated (and its
    report logged once per file: the summary and mapping at INFO, each approximation as a warning)."""
    name, native, report = translate_dialect(raw, path)
    if report is None:
        return raw
    tool = "ai-toolkit" if name == "ai-toolkit" else "SimpleTuner"
    key = path.resolve() if path is not None else None
    if key is None or key not in _REPORTED:
        if key is not None:
            _REPORTED.add(key)
        for line in report.lines(mapped=False):
            logger.info("%s", line)
        for line in report.mapped:
            logger.debug("%s key mapped: %s", tool, line)
        for line in report.approximated:
            logger.warning("%s key approximated: %s", tool, line)
        for line in report.overridden:
            logger.warning("%s setting forced: %s", tool, line)
    return native


def load_config(path: str | os.PathLike, overrides: Iterable[str] = (), check_files: bool = True) -> LoadedConfig:
    """Load and validate ``path``; raises ConfigError with every problem found."""
    p = Path(path)
    raw = read_raw_config(p, overrides)
    config = validate_config(raw, base_dir=p.parent, source=str(p), check_files=check_files)
    return LoadedConfig(config=config, raw=with_settled_family(raw, config), path=p)


def with_settled_family(raw: dict[str, Any], config: TrainingConfig) -> dict[str, Any]:
    """``raw`` recording the ``model_family`` the run uses where the config left it to the folder."""
    return raw if raw.get("model_family") is not None else {**raw, "model_family": config.model_family}
