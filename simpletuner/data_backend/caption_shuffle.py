"""Tag shuffling of captions (a dataset's ``caption_shuffle``), SimpleTuner's ``CaptionShuffler``
(``simpletuner/helpers/prompts.py:168-242`` at SIMPLETUNER_COMMIT), variant for variant.

A caption splits into tags at ``split_on``; the first ``position_start`` stay in place (kohya's ``keep_tokens``)
and the rest are shuffled ``count`` times, copy ``i`` with ``random.Random(seed + md5(caption) + i)``. The
copies (after the caption itself with ``include_original``) are new captions of the image: each is encoded once
into the text cache, and every draw of the image trains on one of them (the lines of a caption file are drawn
the same way: :func:`~simpletuner.data_backend.captions.caption_line_index`). What differs from kohya's
shuffle on every use: documentation/DATA_SOURCES.md, "Caption shuffling".
"""

from __future__ import annotations

import hashlib
import logging
import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from simpletuner.configuration.dataset_sections import CaptionShuffle

logger = logging.getLogger("simpletuner.data_backend.metadata")  # the scan's messages, under the scan's name

#: ``split_on`` -> (the separator the caption is split at, the one the tags are joined with).
SEPARATORS = {"comma": (",", ", "), "space": (" ", " "), "period": (".", ". ")}


def shuffled_captions(caption: str, shuffle: CaptionShuffle, seed: int) -> list[str]:
    """``caption`` and its shuffled copies, as SimpleTuner's ``expand_with_shuffles``: the caption itself first
    (``include_original``), then each copy not already listed. ``seed``: ``shuffle.seed``, else the run's.
    A caption with fewer than ``position_start + 2`` tags has nothing to shuffle and is returned alone."""
    if not shuffle.enable or not caption.strip():
        return [caption]
    split, join = SEPARATORS[shuffle.split_on]
    tags = [part.strip() for part in caption.split(split) if part.strip()]
    fixed, rest = tags[: shuffle.position_start], tags[shuffle.position_start :]
    if len(rest) <= 1:
        return [caption]
    out = [caption] if shuffle.include_original else []
    caption_hash = int(hashlib.md5(caption.encode("utf-8"), usedforsecurity=False).hexdigest(), 16) & 0xFFFFFFFF
    base = shuffle.seed if shuffle.seed is not None else seed
    for i in range(shuffle.count):
        copy = list(rest)
        random.Random((base or 0) + caption_hash + i).shuffle(copy)
        text = join.join(fixed + copy)
        if text not in out:
            out.append(text)
    return out or [caption]


def is_shuffling(shuffle: CaptionShuffle | None) -> bool:
    """Whether a dataset's ``caption_shuffle`` makes shuffled copies."""
    return shuffle is not None and shuffle.enable
