"""Which files of a Hub dataset repo make up a split, found by their names as the ``datasets`` library finds
them when the repo's README declares no ``configs`` (its ``data_files.py``, ``_get_data_files_patterns``).

The first rule that matches any data file of the repo decides, for every split: (1) ``data/<split>-00000-of-
00001*.*`` (what ``push_to_hub`` writes; any split name); (2) a folder named for a split (``train/``,
``default/train/``, ``partial-train/``); (3) the split in the file name (``train.parquet``,
``my_train_file.parquet``); (4) no split named at all: every file is ``train``. Rules 2 and 3 know
``train``, ``validation`` and ``test`` by their keywords (``valid``, ``dev``, ``eval``, ...). Hidden files,
``__`` folders and the README are not data files. Paths are the repo's POSIX paths; nothing is read.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import PurePosixPath

#: Each split the name rules know, and the words that name it (the datasets library's SPLIT_KEYWORDS).
SPLIT_KEYWORDS: dict[str, tuple[str, ...]] = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "dev", "val"),
    "test": ("test", "testing", "eval", "evaluation"),
}
#: Files of a repo that are never data (the datasets library's FILES_TO_IGNORE).
NOT_DATA = frozenset(
    ("README.md", "config.json", "dataset_info.json", "dataset_infos.json", "dummy_data.zip", "dataset_dict.json")
)
_SHARDED = re.compile(r"data/(?P<split>\w+(?:\.\w+)*)-[0-9]{5}-of-[0-9]{5}[^/]*\.[^/]*", re.ASCII)
_SEP = "[-._ 0-9]"  # what may stand beside a split's keyword in a name


def _names(template: str) -> dict[str, list[re.Pattern[str]]]:
    """Each known split -> ``template`` (a regex with ``{w}`` for a keyword) for each of its keywords."""
    return {
        split: [re.compile(template.format(w=re.escape(word), s=_SEP)) for word in words]
        for split, words in SPLIT_KEYWORDS.items()
    }


#: Rule 2: a folder named ``train``, ``train-*``, ``*-train`` or ``*-train-*`` (``-`` any of _SEP).
_FOLDER_NAMES = _names(r"{w}|{w}{s}.*|.*{s}{w}|.*{s}{w}{s}.*")
#: Rule 3: a file named ``train-*`` or ``*-train-*`` (``train.parquet`` too: ``.`` is a separator).
_FILE_NAMES = _names(r"{w}{s}.*|.*{s}{w}{s}.*")


def data_files(paths: Iterable[str]) -> list[str]:
    """The data files among a repo's ``paths``: not hidden, not under a ``__`` folder, not a README or info file."""
    kept = []
    for path in paths:
        parts = PurePosixPath(path).parts
        if any(p.startswith(".") for p in parts) or any(p.startswith("__") for p in parts[:-1]):
            continue
        if parts and parts[-1] not in NOT_DATA:
            kept.append(path)
    return sorted(kept)


def split_data_files(paths: Iterable[str]) -> dict[str, list[str]]:
    """Each split of the repo whose files are ``paths`` -> its data files (any format), by the first name
    rule that matches (module docstring); empty for a repo without data files."""
    files = data_files(paths)
    sharded: dict[str, list[str]] = {}
    for path in files:
        match = _SHARDED.fullmatch(path)
        if match:
            sharded.setdefault(match["split"], []).append(path)
    if sharded:
        return sharded
    for rule, in_folder in ((_FOLDER_NAMES, True), (_FILE_NAMES, False)):
        found = {}
        for split, patterns in rule.items():
            chosen = [p for p in files if _named_by(p, patterns, in_folder)]
            if chosen:
                found[split] = chosen
        if found:
            return found
    return {"train": files} if files else {}


def _named_by(path: str, patterns: list[re.Pattern[str]], in_folder: bool) -> bool:
    """One of ``path``'s folders (``in_folder``), else its file name, matches one of ``patterns``."""
    parts = PurePosixPath(path).parts
    names = parts[:-1] if in_folder else parts[-1:]
    return any(pattern.fullmatch(name) for pattern in patterns for name in names)


def is_parquet(path: str) -> bool:
    return path.lower().endswith(".parquet")


def split_parquet_files(paths: Iterable[str], split: str) -> list[str]:
    """The ``.parquet`` files of ``split`` among a repo's ``paths`` (sorted; empty when it has none)."""
    return [p for p in split_data_files(paths).get(split, []) if is_parquet(p)]


def parquet_splits(paths: Iterable[str]) -> list[str]:
    """The splits of the repo that hold ``.parquet`` files: ``train``, ``validation``, ``test`` first, then the
    others by name."""
    found = [s for s, files in split_data_files(paths).items() if any(is_parquet(f) for f in files)]
    known = [s for s in SPLIT_KEYWORDS if s in found]
    return known + sorted(s for s in found if s not in SPLIT_KEYWORDS)
