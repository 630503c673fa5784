"""Turn pydantic validation errors into one message listing every problem with its path and fix."""

from __future__ import annotations

import difflib
from typing import Any, Iterable, get_args

from pydantic import BaseModel, ValidationError


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


_UNION_TAGS: set[str] = {"local", "in_memory"}


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


def _describe(err: dict, model: type[BaseModel]) -> list[str]:
    path = format_path(err["loc"])
    kind = err["type"]
    value = err.get("input")
    if kind == "extra_forbidden":
        key = err["loc"][-1]
        owner = _model_at(model, tuple(err["loc"]))
        hint = ""
        if owner is not None:
            close = difflib.get_close_matches(str(key), list(owner.model_fields), n=1)
            if close:
                hint = f"; did you mean '{close[0]}'?"
        return [f"{path}: unknown key '{key}'{hint} (remove it or fix the spelling)"]
    if kind == "missing":
        return [f"{path}: required but missing; add it"]
    if kind == "literal_error":
        allowed = err.get("ctx", {}).get("expected", "")
        allowed = allowed.replace("'", "").replace(" or ", ", ")
        return [f"{path}: {value!r} is not one of {allowed}"]
    if kind == "union_tag_invalid":
        allowed = err.get("ctx", {}).get("expected_tags", "").replace("'", "")
        tag = err.get("ctx", {}).get("tag")
        return [f"{path}.type: {tag!r} is not one of {allowed}"]
    if kind == "union_tag_not_found":
        return [f"{path}.type: required; set the dataset's storage type (e.g. 'local')"]
    if kind == "value_error":
        msg = err["msg"].removeprefix("Value error, ")
        return [f"{path}: {m}" for m in msg.split("; ")]
    return [f"{path}: {err['msg'].lower()} (got {value!r})"]


def format_validation_error(exc: ValidationError, model: type[BaseModel]) -> list[str]:
    """One readable line per problem in ``exc``."""
    lines: list[str] = []
    for err in exc.errors(include_url=False):
        lines.extend(_describe(err, model))
    return lines
