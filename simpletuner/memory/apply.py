"""Write top-level keys back into a JSON config: minimal edit, backup first, atomic replace.

:func:`apply_updates` (``simpletuner estimate --apply``) refuses a file without its own write bit (even as
root), edits only the given keys' values in place (a missing key goes after a related one, with the file's
indentation; the result is parsed back and re-serialised if it ever differs), copies the original to
``<file>.backup`` (``.backup.1``, ... : never overwritten) and replaces the file with ``os.replace``. A
failure at any step leaves the original untouched and removes what the call created.
See documentation/MEMORY.md, "--apply".
"""

from __future__ import annotations

import difflib
import json
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Where a missing key goes: after the first of these the file has (else at the end).
_NEIGHBOURS = {
    "train_batch_size": ("resolution", "output_dir"),
    "gradient_accumulation_steps": ("train_batch_size",),
    "gradient_checkpointing": ("mixed_precision", "gradient_accumulation_steps", "train_batch_size"),
}


class ApplyError(ValueError):
    """The config could not be rewritten; the original is untouched."""


@dataclass(frozen=True)
class ApplyResult:
    """What ``apply_updates`` did: the backup it wrote and the unified diff (empty: nothing to do)."""

    path: Path
    backup: Path | None
    diff: str
    changed: dict[str, tuple[Any, Any]]  # key -> (old, new); old is None where the file lacked the key


@dataclass(frozen=True)
class _Member:
    key: str
    key_start: int  # the opening quote of the key
    value_start: int
    value_end: int  # one past the value's last character


def _top_level_members(text: str) -> list[_Member] | None:
    """The members of the top-level JSON object with the spans of their values; None when the
    text is not a single object we can read this way."""
    i, n = 0, len(text)
    decoder = json.JSONDecoder()

    def skip_ws(j: int) -> int:
        while j < n and text[j] in " \t\r\n":
            j += 1
        return j

    i = skip_ws(i)
    if i >= n or text[i] != "{":
        return None
    i = skip_ws(i + 1)
    members: list[_Member] = []
    if i < n and text[i] == "}":
        return members
    while i < n:
        if text[i] != '"':
            return None
        try:
            key, after_key = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        j = skip_ws(after_key)
        if j >= n or text[j] != ":":
            return None
        value_start = skip_ws(j + 1)
        try:
            _, value_end = decoder.raw_decode(text, value_start)
        except json.JSONDecodeError:
            return None
        members.append(_Member(key, i, value_start, value_end))
        k = skip_ws(value_end)
        if k < n and text[k] == ",":
            i = skip_ws(k + 1)
        elif k < n and text[k] == "}":
            return members
        else:
            return None
    return None


def _value_text(value: Any) -> str:
    return json.dumps(value)


def edit_top_level(text: str, updates: dict[str, Any]) -> str:
    """``text`` with each top-level key of ``updates`` set: values replaced in place, missing keys
    inserted after a neighbour with the same indentation. Falls back to ``json.dumps(indent=2)``
    of the updated object when the text cannot be edited in place faithfully."""
    data = json.loads(text)
    expected = {**data, **updates}
    members = _top_level_members(text)
    if members is not None and len({m.key for m in members}) == len(members):
        edited = _edit(text, members, updates)
        try:
            if json.loads(edited) == expected and list(json.loads(edited)) == list(_ordered(data, updates)):
                return edited
        except json.JSONDecodeError:
            pass
    return json.dumps(_ordered(data, updates), indent=2) + "\n"


def _ordered(data: dict[str, Any], updates: dict[str, Any]) -> dict[str, Any]:
    """The updated object in the order the in-place edit gives: new keys after their neighbour."""
    out = dict(data)
    for key, value in updates.items():
        if key in out:
            out[key] = value
            continue
        anchor = next((k for k in _NEIGHBOURS.get(key, ()) if k in out), None)
        items = list(out.items())
        at = len(items) if anchor is None else [k for k, _ in items].index(anchor) + 1
        items.insert(at, (key, value))
        out = dict(items)
    return out


def _edit(text: str, members: list[_Member], updates: dict[str, Any]) -> str:
    by_key = {m.key: m for m in members}
    # Replace existing values from the end so earlier spans stay valid.
    replaced = sorted((by_key[k] for k in updates if k in by_key), key=lambda m: -m.value_start)
    for m in replaced:
        text = text[: m.value_start] + _value_text(updates[m.key]) + text[m.value_end :]
    for key, value in updates.items():
        if key in by_key:
            continue
        members = _top_level_members(text) or []
        if not members:
            raise ValueError("no member to insert after")
        names = [m.key for m in members]
        anchor_name = next((k for k in _NEIGHBOURS.get(key, ()) if k in names), names[-1])
        anchor = members[names.index(anchor_name)]
        line_start = text.rfind("\n", 0, anchor.key_start) + 1
        indent = text[line_start : anchor.key_start]
        separator = "\n" + indent if indent.strip() == "" and line_start > 0 else " "
        entry = f"{json.dumps(key)}: {_value_text(value)}"
        text = text[: anchor.value_end] + f",{separator}{entry}" + text[anchor.value_end :]
    return text


def _next_backup(path: Path) -> Path:
    first = path.with_name(path.name + ".backup")
    if not first.exists():
        return first
    n = 1
    while path.with_name(f"{path.name}.backup.{n}").exists():
        n += 1
    return path.with_name(f"{path.name}.backup.{n}")


def _write_backup(path: Path, data: bytes) -> Path:
    """Copy to the first free ``.backup[.N]``, created exclusively (never overwriting one)."""
    for _ in range(100):
        backup = _next_backup(path)
        try:
            with open(backup, "xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            return backup
        except FileExistsError:  # taken between the check and the create: try the next name
            continue
    raise ApplyError(f"could not find a free backup name next to {path}")


def check_writable(path: Path) -> None:
    """ApplyError unless ``path`` is a regular file with a write bit that this process may write,
    in a folder where a temporary file can be created."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ApplyError(f"{path} does not exist") from None
    if not stat.S_ISREG(st.st_mode):
        raise ApplyError(f"{path} is not a regular file")
    if not st.st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH) or not os.access(path, os.W_OK):
        raise ApplyError(
            f"{path} is read-only (mode {stat.S_IMODE(st.st_mode):04o}): --apply leaves it as it is. Make it writable "
            "(chmod u+w) or copy it and apply to the copy"
        )
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise ApplyError(f"{path.parent} is not writable: --apply needs to put a backup and a temporary file there")


def apply_updates(path: str | os.PathLike, updates: dict[str, Any]) -> ApplyResult:
    """Set top-level ``updates`` in the JSON config at ``path``; see the module docstring."""
    path = Path(path)
    check_writable(path)
    original = path.read_bytes()
    text = original.decode("utf-8")
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ApplyError(f"{path} does not hold a JSON object")
    changed = {k: (data.get(k), v) for k, v in updates.items() if k not in data or data[k] != v}
    if not changed:
        return ApplyResult(path, None, "", {})
    new_text = edit_top_level(text, {k: updates[k] for k in updates if k in changed})
    backup = _write_backup(path, original)
    tmp_name = None
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(new_text.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp_name, stat.S_IMODE(path.stat().st_mode))
        os.replace(tmp_name, path)
        tmp_name = None
    except OSError as exc:
        backup.unlink(missing_ok=True)
        raise ApplyError(f"could not write {path}: {exc.strerror or exc}; the original is unchanged") from None
    finally:
        if tmp_name is not None:
            Path(tmp_name).unlink(missing_ok=True)
    diff = "".join(
        difflib.unified_diff(
            text.splitlines(keepends=True), new_text.splitlines(keepends=True), fromfile=str(backup), tofile=str(path)
        )
    )
    return ApplyResult(path, backup, diff, changed)


def describe_changes(changed: dict[str, tuple[Any, Any]]) -> list[str]:
    """``key: old -> new`` lines (``(absent)`` for a key the file did not have)."""
    return [
        f"  {key}: {'(absent)' if old is None else json.dumps(old)} -> {json.dumps(new)}"
        for key, (old, new) in changed.items()
    ]
