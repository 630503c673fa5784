"""Names the run turns into files and folders, checked at config time so a run does not fail later with
``OSError: File name too long``: a path (:func:`path_problem`) and one folder name (:func:`folder_name_problem`).
"""

from __future__ import annotations

import os
from pathlib import Path

#: Limits where ``os.pathconf`` cannot say (Linux's: one name, a whole path).
DEFAULT_NAME_MAX, DEFAULT_PATH_MAX = 255, 4096


def _filesystem_limits(path: str) -> tuple[int, int]:
    """(bytes per name, bytes per path) of the filesystem the nearest existing ancestor of ``path`` is on."""
    folder = os.path.dirname(os.path.abspath(path))
    while folder and not os.path.isdir(folder):
        parent = os.path.dirname(folder)
        folder = "" if parent == folder else parent
    limits = []
    for name, default in (("PC_NAME_MAX", DEFAULT_NAME_MAX), ("PC_PATH_MAX", DEFAULT_PATH_MAX)):
        try:
            limits.append(int(os.pathconf(folder or os.sep, name)))
        except (AttributeError, ValueError, OSError):  # no pathconf (Windows), or the name is unknown here
            limits.append(default)
    return limits[0], limits[1]


def _short(text: str) -> str:
    return repr(text) if len(text) <= 40 else repr(text[:20] + "..." + text[-12:])


def path_problem(value: str) -> str | None:
    """Why ``value`` cannot name a file or folder on this machine, or None: empty, a NUL character,
    a name (path component) longer than the filesystem allows (255 bytes on most), or a whole path
    longer than it allows. Checked at config time so the run does not fail later with
    ``OSError: File name too long``."""
    if not value.strip():
        return "is empty: give a path"
    if "\x00" in value:
        return f"{_short(value)} holds a NUL character (\\x00), which no path may contain"
    expanded = os.path.expanduser(value)
    name_max, path_max = _filesystem_limits(expanded)
    for part in Path(expanded).parts:
        size = len(os.fsencode(part))
        if size > name_max:
            return (
                f"the name {_short(part)} is {size} bytes long, and the filesystem allows {name_max} bytes for one "
                "file or folder name: shorten it"
            )
    size = len(os.fsencode(os.path.abspath(expanded)))
    if size >= path_max:
        return (
            f"{_short(value)} is {size} bytes long as a full path, and the filesystem allows {path_max - 1}: shorten it"
        )
    return None


def folder_name_problem(value: str) -> str | None:
    """Why ``value`` cannot be one folder name (it becomes one, e.g. a tracker's log folder), or None."""
    if not value.strip() or value in (".", ".."):
        return f"{value!r} is not a folder name: give a name such as 'my-project'"
    if any(sep in value for sep in ("/", "\\", "\x00")):
        return (
            f"{_short(value)} is not one folder name: it becomes a folder of that name under output_dir/logs, "
            "so it may not hold '/', '\\' or NUL; use a name such as 'my-project'"
        )
    size = len(os.fsencode(value))
    if size > DEFAULT_NAME_MAX:
        return (
            f"{_short(value)} is {size} bytes long, and a folder name may have at most {DEFAULT_NAME_MAX} "
            "bytes on most filesystems: shorten it"
        )
    return None
