"""Keys for the text-embedding cache.

An embedding depends on the exact caption, the text encoder(s) and tokenizer that made
it, the dtype, and the tokenizer's max length (truncation changes the value). Captions are
keyed by content, so two images sharing a caption share one cached embedding.
The cache itself is a :class:`~simpletuner.caching.tensor_cache.TensorCache`; see
:func:`~simpletuner.caching.opening.open_caches`.
"""

from __future__ import annotations

import logging
from typing import Any

from simpletuner.caching.fingerprint import fingerprint

logger = logging.getLogger(__name__)

TEXT_KIND = "text-embed"


def text_cache_key(
    *, caption: str, encoder_identity: str, dtype: str, max_length: int | None, image: dict[str, Any] | None = None
) -> str:
    """The cache key of one caption's embeddings.

    ``caption`` exactly as tokenized (after any prefix or dropout rule); ``encoder_identity`` of the text
    encoder(s) and tokenizer(s) (e.g. a :func:`~simpletuner.caching.fingerprint.fingerprint` of each one's
    :func:`~simpletuner.caching.fingerprint.folder_identity`); ``dtype`` the embeddings are stored in;
    ``max_length`` of the tokenizer, None when it does not truncate; ``image``: an edit pair's source as the
    encoder sees it (JSON-like), None leaves a caption-only key as it was before edit pairs.

    Raises:
        ValueError: ``caption`` is not a str or ``max_length`` is not a positive int or None.
    """
    if not isinstance(caption, str):
        raise ValueError(f"caption must be a str, got {type(caption).__name__}")
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1):
        raise ValueError(f"max_length must be a positive int or None, got {max_length!r}")
    parts: dict[str, Any] = dict(kind=TEXT_KIND, caption=caption, encoder_identity=encoder_identity, dtype=str(dtype))
    parts["max_length"] = max_length
    if image is not None:
        parts["image"] = dict(image)
    return fingerprint(**parts)


def caption_text_key(caption: str, encoder_identity: str, text_dtype, image: dict[str, Any] | None = None) -> str:
    """The text key the trainer uses for ``caption`` (embeddings in ``text_dtype``, the
    tokenizer's own max length; an edit pair's source ``image``, see :func:`text_cache_key`)."""
    return text_cache_key(
        caption=caption, encoder_identity=encoder_identity, dtype=str(text_dtype), max_length=None, image=image
    )
