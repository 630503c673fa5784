"""The model family a diffusers folder declares (``model_index.json``'s ``_class_name``).

Read before validation, so a config whose ``model_family`` contradicts its folder stops at
config time (not later, at "tokenizer_2 does not exist"), and a config that omits
``model_family`` gets the folder's family. Only the one JSON file is read: nothing is imported.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from simpletuner.configuration.families import FAMILIES, FAMILY_NAMES

logger = logging.getLogger(__name__)

#: ``model_index.json`` ``_class_name`` -> the ``model_family`` that trains it (diffusers' names).
PIPELINE_FAMILIES: dict[str, str] = {
    class_name: family.name for family in FAMILIES.values() for class_name in family.pipeline_classes
}

#: ``model_family`` when it is omitted and there is no local folder to read (a hub id).
HUB_DEFAULT_FAMILY = "sd"


@dataclass(frozen=True)
class FolderFamily:
    """What a model folder says about its family: ``family`` is None when the class is unknown."""

    index_file: Path
    class_name: str | None
    family: str | None


def looks_like_hub_id(name: str) -> bool:
    """``org/name``: one slash, not starting with ``.``, ``/`` or ``~`` (the shape alone; nothing is looked up)."""
    return name.count("/") == 1 and not name.startswith((".", "/", "~"))


def looks_local(name: str) -> bool:
    """A hub id is ``org/name``; anything else (absolute, ./, ~, several slashes, existing) is a path."""
    return os.path.exists(name) or not looks_like_hub_id(name)


def read_folder_family(model: Any) -> FolderFamily | None:
    """The family ``model``'s ``model_index.json`` names; None when there is no readable local index
    (a hub id, a missing folder: the path checks report those)."""
    if not isinstance(model, str) or not model or not looks_local(model):
        return None
    index_file = Path(model).expanduser() / "model_index.json"
    try:
        index = orjson.loads(index_file.read_bytes())
    except (OSError, ValueError):  # no file, a name too long, a NUL in the path; orjson's errors are ValueErrors
        return None
    class_name = index.get("_class_name") if isinstance(index, dict) else None
    if not isinstance(class_name, str):
        return FolderFamily(index_file, None, None)
    return FolderFamily(index_file, class_name, PIPELINE_FAMILIES.get(class_name))


def _known_pipelines() -> str:
    return ", ".join(f"{name} ({family})" for name, family in PIPELINE_FAMILIES.items())


def settle_model_family(raw: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``raw`` with ``model_family`` taken from the folder where it is omitted, and the problems
    found: a ``model_family`` that contradicts the folder's pipeline class, or an omitted one whose
    folder names no pipeline we know. Omitted with no local folder (a hub id): ``sd``.

    The returned dict is a copy when anything was added; ``raw`` itself is never changed.
    """
    model = raw.get("pretrained_model_name_or_path")
    given = raw.get("model_family")
    found = read_folder_family(model)
    if given is None:
        if found is None:
            logger.info("model_family not set and %r is not a local folder: using %r", model, HUB_DEFAULT_FAMILY)
            return {**raw, "model_family": HUB_DEFAULT_FAMILY}, []
        if found.family is None:  # "sd" only so the other rules can run; the problem refuses the config
            raw = {**raw, "model_family": HUB_DEFAULT_FAMILY}
            what = f"names pipeline class {found.class_name!r}" if found.class_name else "has no `_class_name`"
            return raw, [
                f"model_family: not set, and {found.index_file} {what}, which no model family trains "
                f"(known: {_known_pipelines()}); set `model_family` to one of {', '.join(FAMILY_NAMES)}, "
                "or point `pretrained_model_name_or_path` at a folder of one of those pipelines"
            ]
        logger.info("model_family %r taken from %s (_class_name %s)", found.family, found.index_file, found.class_name)
        return {**raw, "model_family": found.family}, []
    # isinstance first: a list or object given as the family is the schema's to report (and unhashable)
    if (
        found is not None
        and found.family is not None
        and isinstance(given, str)
        and given in FAMILY_NAMES
        and given != found.family
    ):
        return raw, [
            f"model_family: the config says {given!r}, but {found.index_file} names {found.class_name}, "
            f'a {found.family!r} pipeline; set `model_family: "{found.family}"` (or remove `model_family` '
            f"to take it from the folder), or point `pretrained_model_name_or_path` at a {given} folder"
        ]
    return raw, []


#: A Hub repo name part: letters, digits, ``-``, ``_``, ``.``; not starting or ending with ``-`` / ``.``.
_REPO_PART = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?$")


def normalise_repo_id(value: str) -> str:
    """A repo id as written in ``hub_model_id``: an ``https://huggingface.co/org/name`` URL (or ``huggingface.co/...``)
    is read as ``org/name``, as SimpleTuner reads it (helpers/publishing/huggingface.py:40-56); surrounding
    spaces, a query and a ``/tree/...`` tail go."""
    cleaned = value.strip()
    cleaned = re.sub(r"^[a-z]+://", "", cleaned).split("?", 1)[0].split("#", 1)[0]
    if "huggingface.co/" in cleaned:
        cleaned = cleaned.split("huggingface.co/", 1)[1]
    cleaned = cleaned.strip("/")
    parts = cleaned.split("/")
    if len(parts) > 2 and parts[2] in ("tree", "blob", "resolve"):
        cleaned = "/".join(parts[:2])
    return cleaned


def repo_id_problem(repo_id: str) -> str | None:
    """What is wrong with ``repo_id`` as a model repo to upload to (``org/name`` or ``name``), or None."""
    parts = repo_id.split("/")
    if not repo_id or len(parts) > 2:
        return f"{repo_id!r} is not a repo id: write `org/name` (or `name` for the account of your token)"
    bad = [p for p in parts if not _REPO_PART.match(p) or "--" in p or ".." in p or len(p) > 96]
    if bad:
        return (
            f"{repo_id!r} is not a repo id: {bad[0]!r} may hold only letters, digits, '-', '_' and '.', not start or "
            "end with '-' or '.', have no '--' or '..', and be at most 96 characters"
        )
    return None
