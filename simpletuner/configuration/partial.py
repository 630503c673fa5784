"""A view of a config that failed validation, so cross-field rules and path checks still run.

Pydantic runs a model's after-validators only when all of that model's fields are valid, so an
unknown key or one type error hid every cross-field problem until it was fixed. Here each field
that validated on its own gets its validated value, each one that did not is marked invalid, and
the model's rules (``rules.rules_for``) run on that view: a rule that reads an invalid field is
skipped (its input's own error is already reported), every other rule reports as usual.
"""

from __future__ import annotations

import types
from typing import Annotated, Any, Callable, Iterable, Optional, Union, get_args, get_origin

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from simpletuner.configuration.errors import format_path
from simpletuner.configuration.foreign_keys import stands_for
from simpletuner.configuration.rules import rules_for
from simpletuner.configuration.simpletuner.reading import Section


class InvalidInput(Exception):
    """Raised when a rule reads a value that failed validation: the rule is skipped."""


class _Invalid:
    """A list item (e.g. a dataset entry) that could not be read at all."""

    def __init__(self, loc: tuple):
        self._loc = loc

    def __getattr__(self, name: str) -> Any:
        raise InvalidInput(format_path(self._loc))


_INVALID = object()
_UNIONS = (Union, types.UnionType)


class PartialModel:
    """Attribute access to the valid fields of a model that failed validation."""

    def __init__(self, model: type[BaseModel], values: dict[str, Any], loc: tuple):
        self._model = model
        self._values = values
        self._loc = loc

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("_values", {})
        if name not in values:
            raise AttributeError(name)
        value = values[name]
        if value is _INVALID:
            raise InvalidInput(format_path(self._loc + (name,)))
        return value

    def __repr__(self) -> str:
        return f"PartialModel({self._model.__name__}, {format_path(self._loc)})"


def run_rules(rules: Iterable[Callable[[Any], Iterable[str]]], obj: Any) -> list[str]:
    """Every message of every rule that can be evaluated on ``obj``.

    A rule stops at the first invalid value it reads; what it yielded before stays, since each
    message was reached from valid values only.
    """
    problems: list[str] = []
    for rule in rules:
        try:
            for message in rule(obj):
                problems.append(message)
        except InvalidInput:
            continue
    return problems


class _Builder:
    def __init__(self, errors: list[ErrorDetails]):
        self.locs = [tuple(err["loc"]) for err in errors]
        self.problems: list[str] = []
        self._adapters: dict[Any, TypeAdapter] = {}

    def has_error(self, loc: tuple) -> bool:
        """Some error at ``loc`` or inside it."""
        return any(err[: len(loc)] == loc for err in self.locs)

    def has_error_inside(self, loc: tuple) -> bool:
        """Some error strictly inside ``loc``: its model's after-validators did not run."""
        return any(len(err) > len(loc) and err[: len(loc)] == loc for err in self.locs)

    def validated(self, annotation: Any, raw: Any) -> Any:
        adapter = self._adapters.get(annotation)
        if adapter is None:
            adapter = self._adapters[annotation] = TypeAdapter(annotation)
        try:
            return adapter.validate_python(raw)
        except ValidationError:  # valid inside the whole model but not alone: treat as unreadable
            return _INVALID

    def model(self, model: type[BaseModel], raw: dict, loc: tuple) -> PartialModel:
        values: dict[str, Any] = {}
        for name, field in model.model_fields.items():
            floc = loc + (name,)
            if name in raw:
                values[name] = self.value(field.annotation, raw[name], floc)
            elif self.has_error(floc):  # required and missing
                values[name] = _INVALID
            else:
                values[name] = field.get_default(call_default_factory=True)
        section: Optional[Section] = (
            "top" if not loc else "dataset" if "instance_data_dir" in model.model_fields else None
        )
        for key in raw:
            ours = stands_for(str(key), section, model.model_fields) if key not in model.model_fields else None
            if ours is not None and ours not in raw:  # set under another name: unknown here, not unset
                values[ours] = _INVALID
        partial = PartialModel(model, values, loc)
        if self.has_error_inside(loc):
            self.problems.extend(f"{format_path(loc)}: {msg}" for msg in run_rules(rules_for(model), partial))
        return partial

    def value(self, annotation: Any, raw: Any, loc: tuple) -> Any:
        if not self.has_error(loc):
            return self.validated(annotation, raw)
        inner, discriminator = _unwrap(annotation)
        if get_origin(inner) is list and isinstance(raw, list):
            (item_annotation,) = get_args(inner) or (Any,)
            items = []
            for i, item in enumerate(raw):
                value = self.value(item_annotation, item, loc + (i,))
                items.append(_Invalid(loc + (i,)) if value is _INVALID else value)
            return items
        models = _models(inner)
        if not models or not isinstance(raw, dict):
            return _INVALID
        if len(models) == 1:
            return self.model(models[0], raw, loc)
        tag = raw.get(discriminator) if discriminator else None
        for model in models:
            field = model.model_fields.get(discriminator or "")
            if field is not None and tag in get_args(field.annotation):
                return self.model(model, raw, loc + (tag,))  # pydantic puts the tag in the path
        return _INVALID


def _unwrap(annotation: Any) -> tuple[Any, Optional[str]]:
    """Strip Annotated / Optional; return the inner type and a union discriminator, if any."""
    discriminator = None
    while True:
        origin = get_origin(annotation)
        if origin is Annotated:
            args = get_args(annotation)
            for meta in args[1:]:
                if isinstance(meta, FieldInfo) and isinstance(meta.discriminator, str):
                    discriminator = meta.discriminator
            annotation = args[0]
        elif origin in _UNIONS and type(None) in get_args(annotation):
            rest = [a for a in get_args(annotation) if a is not type(None)]
            annotation = rest[0] if len(rest) == 1 else Union[tuple(rest)]
        else:
            return annotation, discriminator


def _models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if get_origin(annotation) in _UNIONS:
        return [a for a in get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
    return []


def partial_config(model: type[BaseModel], raw: dict, exc: ValidationError) -> tuple[PartialModel, list[str]]:
    """The valid part of ``raw`` as a :class:`PartialModel`, and the cross-field problems found on it.

    Only models whose own validators were prevented from running (an error inside them) are
    checked here; the others already reported through ``exc``.
    """
    builder = _Builder(exc.errors(include_url=False))
    root = builder.model(model, raw, ())
    return root, builder.problems
