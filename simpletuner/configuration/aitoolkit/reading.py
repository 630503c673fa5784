"""Reading an ai-toolkit job file as ai-toolkit reads it (toolkit/config.py:14-110): YAML with exponents read as
numbers (``1e-4``), JSON, ``${NAME}`` environment variables filled in, ``[name]`` replaced by ``config.name``; and
recognising one (``job`` + ``config.process``).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from simpletuner.configuration.simpletuner.reading import DialectError

#: The suffixes ai-toolkit reads as YAML (toolkit/config.py:105).
YAML_SUFFIXES = (".yaml", ".yml")

_ENV = re.compile(r"\$\{([^}]+)\}")

#: ai-toolkit's float resolver (toolkit/config.py:54-65): YAML 1.1 reads ``1e-4`` as a string, ai-toolkit as a number.
_FLOAT = re.compile(
    r"""^(?:
     [-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


def looks_like_ai_toolkit(raw: Any) -> bool:
    """An ai-toolkit job: a ``job`` key, or a ``config`` object holding ``process`` (no native key is either)."""
    if not isinstance(raw, dict):
        return False
    config = raw.get("config")
    return "job" in raw or (isinstance(config, dict) and "process" in config)


def _loader() -> type:
    import yaml  # PyYAML (accelerate's dependency too); only a YAML job file needs it

    class AiToolkitLoader(yaml.SafeLoader):
        """SafeLoader with ai-toolkit's float resolver, on a subclass (ai-toolkit patches SafeLoader itself)."""

    AiToolkitLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))
    return AiToolkitLoader


def parse_job_text(text: str, is_yaml: bool, source: str) -> Any:
    """A job file's text read as ai-toolkit reads it: ``${NAME}`` filled from the environment (unset: a problem),
    then YAML or JSON."""
    missing = sorted({name for name in _ENV.findall(text) if name not in os.environ})
    if missing:
        raise DialectError(
            [
                f"`${{{name}}}`: the environment variable {name} is not set (ai-toolkit stops on it too)"
                for name in missing
            ],
            source,
        )
    text = _ENV.sub(lambda match: os.environ[match.group(1)], text)
    if not is_yaml:
        return json.loads(text)
    import yaml

    try:
        return yaml.load(text, Loader=_loader())  # noqa: S506 -- a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise DialectError([f"{source} is not valid YAML: {exc}"], source) from None


def is_yaml_path(path: Path) -> bool:
    return path.suffix.lower() in YAML_SUFFIXES


def with_name_filled(raw: dict[str, Any]) -> dict[str, Any]:
    """``[name]`` replaced by ``config.name`` in every string (toolkit/config.py:38-51)."""
    config = raw.get("config")
    name = config.get("name") if isinstance(config, dict) else None
    if not isinstance(name, str):
        return raw

    def fill(value: Any) -> Any:
        if isinstance(value, str):
            return value.replace("[name]", name)
        if isinstance(value, list):
            return [fill(v) for v in value]
        if isinstance(value, dict):
            return {k: fill(v) for k, v in value.items()}
        return value

    return fill(raw)
