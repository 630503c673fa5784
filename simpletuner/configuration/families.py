"""The model families, in one table: what the config rules need to know about each.

The schema takes its ``model_family`` values from here, the cross-field rules (``rules.py``) ask
which families train with flow matching, take video or pick an expert with ``train_stages``, and
which latent grid their buckets must fit. The model layer (``simpletuner.models.MODEL_FAMILIES``)
has one spec per family named here; a test keeps the two in step. Adding a family: a row here,
its spec there.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """What the configuration knows about one model family."""

    name: str
    #: Trained with flow matching (sigma in (0, 1)) rather than a DDPM schedule.
    flow_matching: bool
    #: Takes video datasets (``dataset_type: video``).
    video: bool
    #: Has two experts (Wan 2.2), of which ``train_stages`` may pick one.
    experts: bool
    #: Pixels per latent along a side (the VAE's down factor) and latents per denoiser token along a
    #: side (sd3's and wan's 2x2 patches, flux's 2x2 packing; a UNet pads what it needs), as in every
    #: released checkpoint of the family. A bucket side must be a multiple of their product, or the
    #: latents do not split into whole tokens and training fails after the cache fill. The model spec
    #: checks again against the folder's own configs before anything loads
    #: (``ModelSpec.check_alignment``), for a folder whose factors differ.
    latent_grid: tuple[int, int]


#: Every family, in the order the schema and the messages list them.
FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family("sd", flow_matching=False, video=False, experts=False, latent_grid=(8, 1)),
        Family("sdxl", flow_matching=False, video=False, experts=False, latent_grid=(8, 1)),
        Family("sd3", flow_matching=True, video=False, experts=False, latent_grid=(8, 2)),
        Family("flux", flow_matching=True, video=False, experts=False, latent_grid=(8, 2)),
        Family("wan", flow_matching=True, video=True, experts=True, latent_grid=(8, 2)),
        Family("qwen_image", flow_matching=True, video=False, experts=False, latent_grid=(8, 2)),
    )
}

#: The values ``model_family`` may take.
FAMILY_NAMES: tuple[str, ...] = tuple(FAMILIES)
#: Model families trained with flow matching (sigma in (0, 1)) rather than a DDPM schedule.
FLOW_MATCHING_FAMILIES = frozenset(name for name, f in FAMILIES.items() if f.flow_matching)
#: Families that take video datasets.
VIDEO_FAMILIES = tuple(name for name, f in FAMILIES.items() if f.video)
#: Families with experts ``train_stages`` can choose between.
EXPERT_FAMILIES = tuple(name for name, f in FAMILIES.items() if f.experts)
#: Per family: (pixels per latent, latents per token) along a side; see :attr:`Family.latent_grid`.
FAMILY_LATENT_GRID: dict[str, tuple[int, int]] = {name: f.latent_grid for name, f in FAMILIES.items()}

#: Keys only one family reads, and their defaults (the schema takes its defaults from here): a config
#: of another family that sets one to anything else is refused, naming the key (rules.py), and a
#: family's spec may refuse them for a folder that cannot use them (flux: a transformer without a
#: guidance embedding). The Flux guidance keys and defaults are SimpleTuner's (its field registry).
FAMILY_ONLY_KEYS: dict[str, tuple[str, object]] = {
    "flux_guidance_mode": ("flux", "constant"),
    "flux_guidance_value": ("flux", 1.0),
    "flux_guidance_min": ("flux", 0.0),
    "flux_guidance_max": ("flux", 4.0),
}


def family_keys_changed(config, family: str) -> list[str]:
    """The keys only ``family`` reads (``FAMILY_ONLY_KEYS``) that ``config`` sets to another value than
    their default, as ``key value`` (for messages), in the table's order."""
    changed = []
    for key, (owner, default) in FAMILY_ONLY_KEYS.items():
        if owner == family and getattr(config, key) != default:
            changed.append(f"{key} {getattr(config, key)!r}")
    return changed
