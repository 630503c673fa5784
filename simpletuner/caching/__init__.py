"""Encode-once caches for VAE latents and text embeddings.

- Where and what: :mod:`.layout` and :mod:`.routing` (the folders), :mod:`.keys` (every key a config's
  training reads), :mod:`.fingerprint`, :mod:`.vae_cache`, :mod:`.text_cache`, :mod:`.size_crop`.
- Stores: :mod:`.base` (:class:`TensorStore`), :mod:`.store` (safetensors shards on disk) with
  :mod:`.shard_checks` (its integrity checks), :mod:`.integrity` and :mod:`.markers`; :mod:`.memory_store`
  (RAM or managed memory); :mod:`.opening` (a store by cache type); :mod:`.read_only`.
- Filling: :mod:`.tensor_cache` (:class:`TensorCache`), :mod:`.share` (between the ranks of a launch),
  :mod:`.threads`; the trainer's fill in phases: :mod:`.plan`, :mod:`.fill`, :mod:`.encoders`;
  :mod:`.reencode` (decoding for the VAE, the re-encoding cache modes).
- :mod:`.report`: what ``simpletuner cache`` (:mod:`simpletuner.cli.cache`) finds in a folder.
"""

from simpletuner.caching.base import TensorStore
from simpletuner.caching.fingerprint import (
    CACHE_FORMAT_VERSION,
    file_stat_identity,
    fingerprint,
    folder_identity,
)
from simpletuner.caching.integrity import CacheIntegrityError, CompactReport, VerifyReport
from simpletuner.caching.keys import CacheKeys, cache_keys
from simpletuner.caching.memory_store import MemoryTensorStore
from simpletuner.caching.opening import open_caches
from simpletuner.caching.store import ShardedTensorStore
from simpletuner.caching.tensor_cache import FillReport, TensorCache
from simpletuner.caching.text_cache import caption_text_key, text_cache_key
from simpletuner.caching.vae_cache import LATENT_DTYPE, latent_cache_key, sample_latent_key

__all__ = [
    "CACHE_FORMAT_VERSION",
    "CacheIntegrityError",
    "CacheKeys",
    "CompactReport",
    "FillReport",
    "MemoryTensorStore",
    "ShardedTensorStore",
    "TensorCache",
    "TensorStore",
    "VerifyReport",
    "cache_keys",
    "file_stat_identity",
    "fingerprint",
    "folder_identity",
    "latent_cache_key",
    "open_caches",
    "text_cache_key",
    "caption_text_key",
    "sample_latent_key",
    "LATENT_DTYPE",
]
