"""Encode-once caches for VAE latents and text embeddings.

- :mod:`.layout`: where a model's caches live (``<cache_dir>/<family>/{vae,text,vae-epochs}``);
  :mod:`.routing`: a dataset's own latent folder (``cache_dir_vae``) and the text folder
  (``cache_config.text_cache_dir``), for training and ``simpletuner cache`` alike.
- :mod:`.keys`: :func:`cache_keys`, every latent and text key a config's training reads; training,
  re-encoding and ``simpletuner cache`` all build their keys there.
- :mod:`.fingerprint`: cache keys over everything that changes a value, plus file and
  encoder-folder identities.
- :mod:`.base`: :class:`TensorStore`, the protocol both stores implement.
- :mod:`.store`: :class:`ShardedTensorStore`, atomic safetensors shards on disk; its integrity
  checks (verify, checked reads, compaction) live in :mod:`.shard_checks`.
- :mod:`.integrity`: per-tensor checksums in each shard's header, :class:`VerifyReport`.
- :mod:`.memory_store`: :class:`MemoryTensorStore`, entries in RAM or managed memory.
- :mod:`.tensor_cache`: :class:`TensorCache` (``fill`` / ``get_batch``); :mod:`.opening`, a cache over
  the store a cache type names, :func:`open_caches` for a model's ``(vae, text)`` pair; :mod:`.share`,
  a fill split between the processes of a launch; :mod:`.threads`, its thread helpers.
- :mod:`.vae_cache`, :mod:`.text_cache`: the key builders for each kind; :mod:`.size_crop`, each image's
  size and crop kept beside its latent for SDXL's micro-conditioning.
- :mod:`.reencode`: decoding images for the VAE, and the re-encoding cache modes
  (``refresh_each_epoch``, ``disable_cache``).
- :mod:`.admin`: ``simpletuner cache verify|clear --config cfg.json`` (the command; it alone asks
  :mod:`simpletuner.models` for a spec); :mod:`.report`: what it finds in a cache folder, as text or JSON.
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
