"""Estimates kept on disk, so the next ``simpletuner estimate`` of the same thing is read, not remade.

Each ``(micro-batch, gradient checkpointing)`` estimate is stored under a key of everything that can change
it (the model folder's ``*.json`` / ``*.txt`` files by content, the config less :data:`NOT_IN_KEY`,
simpletuner's own source and the libraries' versions): a miss is only slower, a wrong hit would be wrong.
The folder is ``$SIMPLETUNER_ESTIMATE_CACHE`` (``off`` disables it), else
``$XDG_CACHE_HOME/simpletuner/estimates``. An unreadable entry is a miss; an unwritable one is skipped.
See documentation/MEMORY.md (the estimate cache) and PERFORMANCE.md, "Issue 29: simpletuner estimate".
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import fields
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig
    from simpletuner.memory.estimator import MemoryBreakdown

logger = logging.getLogger(__name__)

CACHE_ENV = "SIMPLETUNER_ESTIMATE_CACHE"
FORMAT = 1
#: Config keys that are not in the key: given to the estimate separately (micro-batch, checkpointing)
#: or never read by it (what --apply and --set usually change between two estimates of one config).
NOT_IN_KEY = frozenset(
    {
        "train_batch_size",
        "gradient_checkpointing",
        "gradient_accumulation_steps",
        "max_train_steps",
        "num_train_epochs",
        "resume_from_checkpoint",
    }
)
_LIBRARIES = ("torch", "diffusers", "peft", "transformers", "accelerate", "optimum-quanto", "lycoris-lora")
_MODEL_FILES = (".json", ".txt")


def cache_folder(environ=None) -> Path | None:
    """Where estimates are kept; None when ``SIMPLETUNER_ESTIMATE_CACHE`` is ``off`` (or ``0``, ``no``)."""
    environ = os.environ if environ is None else environ
    value = environ.get(CACHE_ENV)
    if value is not None:
        return None if value.strip().lower() in ("", "0", "off", "no", "false") else Path(value).expanduser()
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "simpletuner" / "estimates"


@lru_cache(maxsize=1)
def _code_and_libraries() -> str:
    """A digest of simpletuner's source and the installed versions of the libraries the estimate runs."""
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parents[1]
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() + b"\0")
    for name in _LIBRARIES:
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            version = "-"
        digest.update(f"{name}={version}\0".encode())
    return digest.hexdigest()


def _model_digest(root: Path) -> str | None:
    if not (root / "model_index.json").is_file():
        return None  # the estimate explains a missing folder itself
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in _MODEL_FILES and p.is_file()):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def estimate_key(config: "TrainingConfig", micro_batch_size: int, gradient_checkpointing: bool) -> str | None:
    """The key of one estimate of ``config``; None when it cannot be made (no model folder here)."""
    model = _model_digest(Path(config.pretrained_model_name_or_path).expanduser())
    if model is None:
        return None
    settings = {k: v for k, v in config.model_dump(mode="json").items() if k not in NOT_IN_KEY}
    material = {
        "format": FORMAT,
        "code": _code_and_libraries(),
        "model": model,
        "config": settings,
        "micro_batch_size": micro_batch_size,
        "gradient_checkpointing": gradient_checkpointing,
    }
    return hashlib.sha256(orjson.dumps(material, option=orjson.OPT_SORT_KEYS)).hexdigest()


def load(key: str | None, folder: Path | None) -> tuple["MemoryBreakdown", int | None] | None:
    """``(breakdown, validation model bytes)`` stored under ``key``; None on a miss."""
    if key is None or folder is None:
        return None
    from simpletuner.memory.estimator import MemoryBreakdown

    try:
        stored = orjson.loads((folder / f"{key}.json").read_bytes())
        values = stored["breakdown"]
        values["latent_shape"] = tuple(values["latent_shape"])
        breakdown = MemoryBreakdown(**{f.name: values[f.name] for f in fields(MemoryBreakdown)})
        return breakdown, stored["validation_bytes"]
    except (OSError, ValueError, KeyError, TypeError):  # absent, damaged or from another format: a miss
        return None


def save(key: str | None, folder: Path | None, breakdown: "MemoryBreakdown", validation_bytes: int | None) -> None:
    """Store an estimate (temp file + rename); a folder that cannot be written is skipped."""
    if key is None or folder is None:
        return
    data: dict[str, Any] = {"breakdown": breakdown.as_dict(), "validation_bytes": validation_bytes}
    temp = folder / f".{key}.{os.getpid()}.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        temp.write_bytes(orjson.dumps(data))
        os.replace(temp, folder / f"{key}.json")
    except OSError as exc:
        logger.debug("estimate not stored in %s: %s", folder, exc)
        try:
            temp.unlink(missing_ok=True)
        except OSError:
            pass


def lookup(config: "TrainingConfig", micro_batch_size: int) -> tuple["MemoryBreakdown", int] | None:
    """The stored estimate of ``config`` (its own ``gradient_checkpointing``) at ``micro_batch_size``."""
    found = load(estimate_key(config, micro_batch_size, config.gradient_checkpointing), cache_folder())
    return None if found is None or found[1] is None else (found[0], found[1])


def keep(config: "TrainingConfig", micro_batch_size: int, breakdown: "MemoryBreakdown", validation_bytes: int) -> None:
    """Store the estimate of ``config`` at ``micro_batch_size`` for the next run."""
    key = estimate_key(config, micro_batch_size, config.gradient_checkpointing)
    save(key, cache_folder(), breakdown, validation_bytes)
