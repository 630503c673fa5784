"""Validation prompts: the ``validation_prompts`` key read into a list (from a list or a text file)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from simpletuner.configuration.paths import path_problem


def read_prompt_file(path: str) -> list[str]:
    """The prompts in a UTF-8 text file, one per line; surrounding spaces and blank lines dropped.

    Raises ValueError (a config problem) when the file is missing, unreadable or holds no prompt.
    The loader has already made a relative path absolute against the config file's folder.
    """
    problem = path_problem(path)
    if problem:
        raise ValueError(f"prompt file: {problem}")
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(
            f"prompt file {p} does not exist (give a text file with one prompt per line, or a list of prompts)"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:  # a folder, no permission, ...
        raise ValueError(f"prompt file {p} cannot be read as UTF-8 text: {exc}") from None
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"prompt file {p} holds no prompt: write one prompt per line")
    return prompts


def prompts_from(value: Any) -> Optional[list[str]]:
    """``validation_prompts`` as given -> the list of prompts (a string is a prompt file's path).

    Raises ValueError with the fix for anything else: another type, an empty list, an item that is
    not a non-empty string.
    """
    if value is None:
        return None
    if isinstance(value, str):
        return read_prompt_file(value)
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"expected a list of prompts or the path of a prompt file (in quotes), got {value!r}")
    if not value:
        raise ValueError("is an empty list: add prompts, or remove the key")
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item.strip():
            raise ValueError(f"item {i} ({item!r}) is not a prompt: every item must be a non-empty string")
    return list(value)


def merged_prompts(single: Optional[str], several: Optional[list[str]]) -> list[str]:
    """Every prompt to render, in order: ``validation_prompt`` first, then ``validation_prompts``;
    a prompt given twice is rendered once (the first place it appears decides its row)."""
    prompts = ([single] if single else []) + list(several or [])
    return list(dict.fromkeys(prompts))
