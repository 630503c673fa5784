"""Reading SimpleTuner's dialect: the table's entry type, its value spellings (``"true"``, ``"1e-4"``), the
translation being written (with where each value came from) and its report.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Optional

from simpletuner.configuration.simpletuner.facts import SIMPLETUNER_FAMILIES

Kind = Literal["same", "approximated", "ignored", "unsupported"]


Section = Literal["top", "dataset"]


KINDS: tuple[Kind, ...] = ("same", "approximated", "ignored", "unsupported")


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


def key_row(
    key: str, kind: Kind, ours: Optional[str] = None, note: str = "", section: Section = "top", **kw: Any
) -> DialectKey:
    """A row of the table, its arguments in the order the tables write them."""
    return DialectKey(key, section, kind, ours, note, **kw)


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
    raise Problem(f"`{where}`: {value!r} is not a boolean (true / false)")


def as_number(value: Any, where: str) -> int | float:
    """SimpleTuner's numbers, also when written as strings (``"1e-4"``, ``"20"``)."""
    if isinstance(value, bool):
        raise Problem(f"`{where}`: {value!r} is not a number")
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
            raise Problem(f"`{where}`: {value!r} is not a number") from None
        if math.isfinite(number):
            return number
    raise Problem(f"`{where}`: {value!r} is not a number")


def plain(value: Any) -> Any:
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
    except Problem:
        return value


_PLACEHOLDER = re.compile(r"\{([^{}]+)\}")


def fill_placeholders(value: Any, variables: Mapping[str, Any]) -> Any:
    """SimpleTuner's placeholders in strings, nested lists and objects (its configuration/template_vars.py):
    ``{env:NAME}`` is the environment variable (empty when unset), ``{name}`` a value of ``variables``; any
    other ``{...}`` stays as written."""
    if isinstance(value, str):

        def one(match: re.Match) -> str:
            token = match.group(1)
            if token.startswith("env:"):
                return os.environ.get(token[4:], "")
            if token in variables:
                return "" if variables[token] is None else str(variables[token])
            return match.group(0)

        return _PLACEHOLDER.sub(one, value)
    if isinstance(value, list):
        return [fill_placeholders(v, variables) for v in value]
    if isinstance(value, dict):
        return {k: fill_placeholders(v, variables) for k, v in value.items()}
    return value


class Problem(Exception):
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
    return default is not None and plain(value) == default


@dataclass
class Report:
    """What the translation did, key by key: logged at start and printed by ``convert``."""

    mapped: list[str] = field(default_factory=list)  # "key -> ours" lines
    approximated: list[str] = field(default_factory=list)  # warnings: what differs
    overridden: list[str] = field(default_factory=list)  # warnings: a config value SimpleTuner's code replaces
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
    dataset_entry: Optional[dict[str, Any]] = None  # the dataset entry being read, as written (for keys read together)
    # `dataset_type: conditioning` entries by id -> their folder of source images (absolute; None: unreadable,
    # its problems are listed); a training dataset's `conditioning_data` names one
    conditioning_sources: dict[str, Optional[str]] = field(default_factory=dict)
    # their `conditioning_type` where it is a mask's (`mask` / `segmentation`): the folder is a `mask_data_dir`
    conditioning_masks: dict[str, str] = field(default_factory=dict)

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

    @property
    def our_family(self) -> Optional[str]:
        """Our ``model_family`` for the config's SimpleTuner family (None: unset or not one we train)."""
        return SIMPLETUNER_FAMILIES.get(self.family or "")

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


def rename(t: Translation, value: Any, entry: DialectKey) -> None:
    """The default for ``same`` / ``approximated`` entries: our key gets the value (spelled ours)."""
    assert entry.ours is not None
    if entry.values is not None and isinstance(value, str) and value in entry.values:
        value = entry.values[value]
    t.put(entry.ours, plain(value), entry.key)


def spelled(t: Translation, value: Any, entry: DialectKey, choices: Mapping[str, Any], what: str) -> Any:
    """``value`` in our spelling, or a problem naming the choices."""
    text = str(value).strip()
    if text in choices and choices[text] is not None:
        return choices[text]
    supported = ", ".join(k for k, v in choices.items() if v is not None)
    t.problems.append(
        f"`{entry.key}`: {value!r} is not supported here ({what}); SimpleTuner values that work here: {supported}"
    )
    return None


def set_spelled(choices: Mapping[str, Any], what: str) -> Apply:
    def apply(t: Translation, value: Any, entry: DialectKey) -> None:
        ours = spelled(t, value, entry, choices, what)
        if ours is not None:
            assert entry.ours is not None
            t.put(entry.ours, ours, entry.key)

    return apply


def read_json_file(t: Translation, path: Path, key: str, kind: type, what: str) -> Any:
    """The JSON in ``path`` when it holds a ``kind`` (dict or list); otherwise one problem naming ``key``
    and None."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        t.problems.append(f"`{key}`: {path} does not exist")
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        t.problems.append(f"`{key}`: {path} cannot be read as JSON: {exc}")
        return None
    if not isinstance(data, kind):
        t.problems.append(f"`{key}`: {path} must hold {what}")
        return None
    return data
