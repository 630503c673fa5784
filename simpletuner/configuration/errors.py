"""Turn pydantic validation errors into one message listing every problem with its path and fix."""

from __future__ import annotations

from typing import Any, Callable, Iterable, get_args

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from simpletuner.configuration.foreign_keys import (
    describe_foreign_key,
    describe_foreign_value,
    foreign_key,
    foreign_value,
    stands_for,
)
from simpletuner.configuration.schema import DatasetConfig
from simpletuner.configuration.simpletuner.reading import Section


class ConfigError(ValueError):
    """A configuration problem the user must fix. ``problems`` holds one line per problem."""

    def __init__(self, problems: Iterable[str], source: str | None = None):
        self.problems = list(problems)
        self.source = source
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s){where}:\n{lines}")


def format_path(loc: Iterable[Any]) -> str:
    """``('datasets', 0, 'local', 'crop')`` -> ``datasets[0].crop`` (union tags dropped)."""
    out = ""
    previous = None
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(previous, int) and part in _UNION_TAGS:
            pass  # pydantic puts the discriminator value right after the list index
        else:
            out += f".{part}" if out else str(part)
        previous = part
    return out or "(top level)"


def _model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The pydantic model class that owns the field at ``loc`` (for 'did you mean')."""
    candidates: list[type[BaseModel]] = [model]
    previous = None
    for part in loc[:-1]:
        skip = isinstance(part, int) or (isinstance(previous, int) and part in _UNION_TAGS)
        previous = part
        if skip:
            continue
        found: list[type[BaseModel]] = []
        for cand in candidates:
            field = cand.model_fields.get(part)
            if field is not None:
                found.extend(_models_in(field.annotation))
        if not found:
            return None
        candidates = found
    tag = loc[-2] if len(loc) >= 3 and isinstance(loc[-3], int) else None
    for cand in candidates:  # a union member whose `type` matches the tag pydantic put in the path
        type_field = cand.model_fields.get("type")
        if tag is not None and type_field is not None and tag in get_args(type_field.annotation):
            return cand
    return candidates[0]


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in get_args(annotation):
        found.extend(_models_in(arg))
    return found


#: The dataset entry's ``type`` values (``local``, ``in_memory``, ...), read from the members of the
#: ``DatasetConfig`` union: pydantic puts the matching one right after the list index in an error's path.
_UNION_TAGS: frozenset[str] = frozenset(
    tag for member in _models_in(DatasetConfig) for tag in get_args(member.model_fields["type"].annotation)
)


def _normalise(key: str) -> str:
    return key.strip().lstrip("-").lower().replace("-", "_")


def _distance(a: str, b: str) -> int:
    """Edit distance counting a swap of neighbours as one edit (optimal string alignment)."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        row = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                row[j] = min(row[j], prev2[j - 2] + 1)
        prev2, prev = prev, row
    return prev[-1]


def _is_typo_of(typo: str, known: str) -> bool:
    """True when ``typo`` reads as a misspelling of ``known``, not merely a key that looks alike.

    Accepted: the same words with underscores moved or dropped (``train_batchsize``); one edit
    anywhere (``learning_rat``, ``mixed_precison``); or all words equal but one, which is one edit
    away (two for words over 7 letters: ``gradient_acumulaton_steps``). ``loss_type`` is not a typo
    of ``lora_type`` (a different word), nor ``max_length`` of ``max_lr``, nor
    ``validation_guidance_rescale`` of ``validation_guidance_scale``.
    """
    a = _normalise(typo)
    if a == known or a.replace("_", "") == known.replace("_", ""):
        return True
    if _distance(a, known) <= 1 and min(len(a), len(known)) >= 4:
        return True
    words_a, words_b = a.split("_"), known.split("_")
    if len(words_a) != len(words_b):
        return False
    differing = [(x, y) for x, y in zip(words_a, words_b) if x != y]
    if len(differing) != 1:
        return False
    x, y = differing[0]
    limit = 1 if max(len(x), len(y)) <= 7 else 2
    return min(len(x), len(y)) >= 3 and _distance(x, y) <= limit


def close_matches(key: str, known: Iterable[str]) -> list[str]:
    """The known keys ``key`` is a typo of, nearest first; all of them when equally near."""
    candidates = [k for k in known if _is_typo_of(key, k)]
    if not candidates:
        return []
    nearest = min(_distance(_normalise(key), k) for k in candidates)
    return [k for k in candidates if _distance(_normalise(key), k) == nearest]


def close_match(key: str, known: Iterable[str]) -> str | None:
    """The one known key ``key`` is a typo of, or None (none, or several equally near)."""
    matches = close_matches(key, known)
    return matches[0] if len(matches) == 1 else None


def _section(loc: tuple, owner: type[BaseModel] | None) -> Section | None:
    """Which part of another tool's config a key at ``loc`` would come from."""
    if len(loc) == 1:
        return "top"
    if loc[0] == "datasets" and owner is not None and "instance_data_dir" in owner.model_fields:
        return "dataset"
    return None


def _unknown_key(err: ErrorDetails, model: type[BaseModel]) -> str:
    loc = tuple(err["loc"])
    path = format_path(loc)
    key = str(loc[-1])
    owner = _model_at(model, loc)
    bare = key.lstrip("-")
    dashes = bare != key
    known = list(owner.model_fields) if owner is not None else []
    if dashes and bare in known:
        return f"{path}: write keys without the leading `--` (SimpleTuner's command-line style): use '{bare}'"
    section = _section(loc, owner)
    entries = foreign_key(bare, section) if section else []
    if entries:
        tail = " (and without the leading `--`)" if dashes else ""
        return f"{path}: {describe_foreign_key(entries, bare)}{tail}"
    close = close_matches(key, known)
    hint = f"; did you mean {' or '.join(repr(k) for k in close)}?" if close else ""
    return f"{path}: unknown key '{key}'{hint} (remove it or fix the spelling)"


def _literal(err: ErrorDetails, path: str) -> str:
    value = err.get("input")
    allowed = err.get("ctx", {}).get("expected", "").replace("'", "").replace(" or ", ", ")
    line = f"{path}: {value!r} is not one of {allowed}"
    names = [part for part in err["loc"] if isinstance(part, str)]
    entry = foreign_value(names[-1], value) if names else None
    return f"{line}; {describe_foreign_value(entry)}" if entry else line


def _bound(word: str, key: str) -> Callable[[ErrorDetails], str]:
    return lambda err: f"must be {word} {err.get('ctx', {}).get(key)}"


_SIMPLE: dict[str, Callable[[ErrorDetails], str]] = {
    "int_parsing": lambda err: "expected a whole number",
    "int_type": lambda err: "expected a whole number",
    "int_from_float": lambda err: "expected a whole number",
    "float_parsing": lambda err: "expected a number",
    "float_type": lambda err: "expected a number",
    "bool_parsing": lambda err: "expected true or false",
    "bool_type": lambda err: "expected true or false",
    "string_type": lambda err: "expected a string (in quotes)",
    "list_type": lambda err: "expected a list ([...])",
    "dict_type": lambda err: "expected an object ({...})",
    "model_type": lambda err: "expected an object ({...})",
    "model_attributes_type": lambda err: "expected an object ({...})",
    "greater_than": _bound(">", "gt"),
    "greater_than_equal": _bound(">=", "ge"),
    "less_than": _bound("<", "lt"),
    "less_than_equal": _bound("<=", "le"),
    "too_short": lambda err: "must not be empty",
}


def _describe(err: ErrorDetails, model: type[BaseModel]) -> list[str]:
    path = format_path(err["loc"])
    kind = err["type"]
    value = err.get("input")
    if kind == "extra_forbidden":
        return [_unknown_key(err, model)]
    if kind == "missing":
        return [f"{path}: required but missing; add it"]
    if kind == "literal_error":
        return [_literal(err, path)]
    if kind == "union_tag_invalid":
        allowed = err.get("ctx", {}).get("expected_tags", "").replace("'", "")
        tag = err.get("ctx", {}).get("tag")
        line = f"{path}.type: {tag!r} is not one of {allowed}"
        entry = foreign_value("type", tag)
        return [f"{line}; {describe_foreign_value(entry)}" if entry else line]
    if kind == "union_tag_not_found":
        return [f"{path}.type: required; set the dataset's storage type (e.g. 'local')"]
    if kind == "value_error":
        msg = err["msg"].removeprefix("Value error, ")
        return [f"{path}: {m}" for m in msg.split("\n")]
    if kind in _SIMPLE:
        return [f"{path}: {_SIMPLE[kind](err)}, got {value!r}"]
    return [f"{path}: {err['msg'].lower()} (got {value!r})"]


def format_validation_error(exc: ValidationError, model: type[BaseModel]) -> list[str]:
    """One readable line per problem in ``exc``.

    A required key given under another name (``--key``, another tool's name) is not also
    reported missing: the line about that name already says what to write.
    """
    errors = exc.errors(include_url=False)
    given_as: set[tuple] = set()
    for err in errors:
        if err["type"] == "extra_forbidden":
            loc = tuple(err["loc"])
            owner = _model_at(model, loc)
            ours = stands_for(str(loc[-1]), _section(loc, owner), owner.model_fields) if owner else None
            if ours is not None:
                given_as.add(loc[:-1] + (ours,))
    lines: list[str] = []
    for err in errors:
        if err["type"] == "missing" and tuple(err["loc"]) in given_as:
            continue
        lines.extend(_describe(err, model))
    return lines
