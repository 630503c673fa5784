"""Unreadable files: when they stop a run, and the messages that name them.

A real LoRA set often holds a file or two that cannot be read (a download cut off, an empty file, a text
file renamed ``.png``). Like SimpleTuner and kohya, the run skips them and lists them (a WARNING with the
count and the names at the end of the dataset scan, and again at the end of the cache fill, which finds
what only a full decode shows). It stops only when at least ``max_bad_image_fraction`` of a dataset
(:data:`DEFAULT_MAX_BAD_FRACTION`: half) cannot be read: that many usually means a wrong folder, files of
another kind, or a copy that did not finish, and training on what is left would not be what was asked.
The same rule (:func:`is_too_many`) decides when images that would be upscaled far stop the run
(:mod:`simpletuner.data_backend.size_rules`).
"""

from __future__ import annotations

import logging
from fractions import Fraction

logger = logging.getLogger("simpletuner.data_backend.metadata")  # the scan's messages, under the scan's name

#: ``max_bad_image_fraction``'s default: a dataset stops the run when half or more of it cannot be read.
DEFAULT_MAX_BAD_FRACTION = 0.5
#: Bad files named in an error message.
NUM_BAD_FILES_SHOWN = 10
#: Bad files named in a warning (the rest are counted).
NUM_BAD_FILES_LISTED = 100


def is_too_many(num_bad: int, total: int, limit: float) -> bool:
    """Whether ``num_bad`` of ``total`` reach ``limit`` (a fraction): at least one, and at least that share.
    ``limit`` is taken as written (``0.1`` is one tenth exactly), so 3 of 30 reach 0.1."""
    return num_bad > 0 and Fraction(num_bad, max(total, 1)) >= Fraction(str(limit))


def format_bad(bad: list[tuple[str, str]], limit: int = NUM_BAD_FILES_SHOWN) -> str:
    """``bad`` as indented ``- path: reason`` lines, the first ``limit``, then how many more."""
    lines = [f"  - {path}: {reason}" for path, reason in bad[:limit]]
    if len(bad) > limit:
        lines.append(f"  ... ({len(bad) - limit} more)")
    return "\n".join(lines)


def check_bad_files(
    dataset_id: str, root: str, total: int, bad: list[tuple[str, str]], limit: float, noun: str = "image files"
) -> None:
    """Stop when ``bad`` reach ``limit`` of the ``total`` image files (or clips) (:func:`is_too_many`),
    saying which dataset, how many of how many, the first names, and what to check."""
    if not is_too_many(len(bad), total, limit):
        return
    if len(bad) >= total:
        what, anyway = f"none of the {total} {noun} under {root} could be read", ""
    else:
        what = (
            f"{len(bad)} of {total} {noun} under {root} could not be read ({len(bad) / total:.1%}; the run stops at "
            f"max_bad_image_fraction={limit:g}, {limit:.1%})"
        )
        anyway = ", or raise `max_bad_image_fraction` to train on the readable ones anyway"
    raise ValueError(
        f"dataset {dataset_id!r}: {what}. So many usually means a wrong `instance_data_dir`, files of another kind "
        "under a media file name, or a copy or download that did not finish. "
        f"First {min(len(bad), NUM_BAD_FILES_SHOWN)}:\n{format_bad(bad)}\n"
        f"Check the folder and open one of these files in a viewer; fix or remove them{anyway}."
    )


def warn_skipped(
    dataset_id: str, total: int, skipped: list[tuple[str, str]], when: str, noun: str = "image files"
) -> None:
    """One warning: how many of the dataset's ``total`` files were skipped ``when`` (``"while scanning"``)
    and each one's name and reason (the first :data:`NUM_BAD_FILES_LISTED`)."""
    if not skipped:
        return
    logger.warning(
        "dataset %r: skipped %d of %d %s as unreadable %s:\n%s",
        dataset_id,
        len(skipped),
        total,
        noun,
        when,
        format_bad(skipped, NUM_BAD_FILES_LISTED),
    )


def report_after_fill(
    dataset_id: str, total: int, bad: list[tuple[str, str]], num_at_fill: int, noun: str = "image files"
) -> None:
    """The end of the cache fill: one warning with every unreadable file of the dataset, those the scan
    found and the ``num_at_fill`` (the last in ``bad``) only a full decode showed."""
    if not bad:
        return
    logger.warning(
        "dataset %r: %d of %d %s are unreadable and left out of training (%d found by the scan, %d by the "
        "cache fill):\n%s",
        dataset_id,
        len(bad),
        total,
        noun,
        len(bad) - num_at_fill,
        num_at_fill,
        format_bad(bad, NUM_BAD_FILES_LISTED),
    )
