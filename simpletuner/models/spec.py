"""ModelSpec: what the trainer needs from a model family, and nothing family-specific beyond it.

A family module implements loading from a diffusers-format folder, prompt and image encoding
for the caches, the training loss (noise, timesteps, target) and adapter saving. The trainer
only talks to this interface, so adding a family never adds an ``if family == ...`` branch.

Safe loading: a model folder is data, never code. Each family loads fixed classes (the names
in ``model_index.json`` are checked against the family's allow-list, never imported or
called), weights come from safetensors only (``use_safetensors=True``; a folder holding only
pickle weights is refused before anything loads), and ``trust_remote_code`` is never set.
"""

from __future__ import annotations

import abc
import functools
import inspect
import json
import logging
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Sequence

import torch
from torch import nn

from simpletuner.configuration.families import FAMILY_LATENT_GRID
from simpletuner.configuration.loader import COMPONENT_CONFIG, component_subfolder
from simpletuner.configuration.rules import alignment_problem
from simpletuner.diskspace import disk_full_guard, inject_fault, require_space
from simpletuner.file_modes import ordinary_permissions
from simpletuner.models import tread
from simpletuner.models.adapters import prepare_for_training

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig


#: Weight files ``from_pretrained`` would unpickle (a pickle can run any code when loaded).
PICKLE_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
_SAFETENSORS = re.compile(r"\.safetensors(\.index\.json)?$")
_PICKLE = re.compile("(" + "|".join(re.escape(s) for s in PICKLE_WEIGHT_SUFFIXES) + r")(\.index\.json)?$")
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

ComponentKind = Literal["model", "tokenizer", "processor", "scheduler"]

#: Pixels per latent assumed when a folder's VAE config cannot be read (every family's VAE: 8).
FAMILY_GRID_DEFAULT = 8

#: Prefix of the folders a final save keeps inside output_dir while it runs: ``.final-save.tmp-*``
#: (the weights being written) and ``.final-save.old-*`` (an earlier model folder being replaced).
#: A save killed midway leaves one; the next final save and ``--overwrite`` remove them.
FINAL_SAVE_PREFIX = ".final-save."
#: Written beside the final weights once they are in place: ``{"step": N, "files": [...]}``. A
#: checkpoint past that step means the final save after it never completed (see run_folder).
FINAL_RECORD = "final_weights.json"


def pickle_only_weights(folder: Path) -> list[str]:
    """Names of the pickle weight files in ``folder`` when it holds no safetensors weights;
    ``[]`` when it has safetensors, or no weights at all (a configs-only folder)."""
    if not folder.is_dir():
        return []
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    if any(_SAFETENSORS.search(n) for n in names):
        return []
    return [n for n in names if _PICKLE.search(n)]


def _base_classes(kind: ComponentKind) -> tuple[type, ...]:
    if kind == "model":
        from diffusers import ModelMixin
        from transformers import PreTrainedModel

        return (ModelMixin, PreTrainedModel)
    if kind == "tokenizer":
        from transformers import PreTrainedTokenizerBase

        return (PreTrainedTokenizerBase,)
    if kind == "processor":
        from transformers import ProcessorMixin

        return (ProcessorMixin,)
    from diffusers import SchedulerMixin

    return (SchedulerMixin,)


def resolve_component_class(library: Any, class_name: Any, kind: ComponentKind) -> type[Any]:
    """The class a model folder names as ``[library, class_name]`` (``model_index.json``), only when it is a
    diffusers / transformers class of the right kind.

    ``library`` is ``"diffusers"`` or ``"transformers"``; ``class_name`` a plain identifier it exports whose
    value derives from ``ModelMixin`` / ``PreTrainedModel`` (``kind="model"``), ``PreTrainedTokenizerBase``,
    ``ProcessorMixin`` or ``SchedulerMixin``. Nothing else is imported or called, so a folder naming
    ``["os", "system"]`` or ``["transformers", "pipeline"]`` can never reach a callable.

    Raises:
        ValueError: any other library or name; the message names what was refused.
    """
    named = (
        f"{library}.{class_name}"
        if isinstance(library, str) and isinstance(class_name, str)
        else repr([library, class_name])
    )
    if (
        library not in ("diffusers", "transformers")
        or not isinstance(class_name, str)
        or not _IDENTIFIER.match(class_name)
    ):
        raise ValueError(f"{named} is not a diffusers or transformers class; refusing to load it")
    import diffusers
    import transformers

    module = diffusers if library == "diffusers" else transformers
    try:
        found = getattr(module, class_name)
    except (AttributeError, ImportError, RuntimeError):
        found = None
    bases = _base_classes(kind)
    if not (inspect.isclass(found) and issubclass(found, bases)):
        wanted = " or ".join(f"{b.__module__.split('.')[0]}.{b.__name__}" for b in bases)
        raise ValueError(f"{named} is not a {kind} class (a subclass of {wanted}); refusing to load it")
    return found


def read_model_index(root: Path) -> dict[str, Any] | None:
    """The ``model_index.json`` of the local folder ``root``, parsed; None when it has none. The one
    reader of that file in the model layer (:attr:`ModelSpec.model_index` keeps what it read).

    Raises:
        ValueError: the file is not valid JSON, or not a JSON object.
    """
    index_file = root / "model_index.json"
    if not index_file.is_file():
        return None
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{index_file} is not valid JSON ({exc}); is {root} a diffusers pipeline folder?") from None
    if not isinstance(index, dict):
        raise ValueError(f"{index_file} is not a JSON object; is {root} a diffusers pipeline folder?")
    return index


#: The config key naming a separate VAE (its messages name it).
VAE_KEY = "pretrained_vae_model_name_or_path"


@dataclass(frozen=True)
class ComponentLocation:
    """Where one component loads from: ``path`` (a local folder or a hub id) and the ``subfolder`` of it that holds
    the component (None: its root), at the hub ``revision`` (None: the default branch; a local folder ignores it).
    ``is_separate``: named by a key of its own (``pretrained_vae_model_name_or_path``), not the model folder's."""

    path: str
    subfolder: str | None
    revision: str | None = None
    is_separate: bool = False

    @property
    def local_folder(self) -> Path | None:
        """The folder holding the component's ``config.json`` and weights when ``path`` is a local folder; None for
        a hub id."""
        root = Path(self.path).expanduser()
        if not root.is_dir():
            return None
        return root / self.subfolder if self.subfolder else root

    def pretrained_args(self) -> dict[str, Any]:
        """The arguments of ``from_pretrained`` / ``load_config`` that name this place. A separate local folder is
        named by the component's own folder: given a folder and a subfolder, diffusers reads the weights at the
        folder's root when it has some (and the config from the subfolder)."""
        folder = self.local_folder if self.is_separate else None
        if folder is not None:
            return {"pretrained_model_name_or_path": str(folder)}
        args: dict[str, Any] = {"pretrained_model_name_or_path": self.path, "subfolder": self.subfolder}
        if self.revision:
            args["revision"] = self.revision
        return args

    def describe(self) -> str:
        """``path/subfolder`` (``path`` for a root)."""
        return f"{self.path}/{self.subfolder}" if self.subfolder else self.path


def vae_location(config: "TrainingConfig") -> ComponentLocation:
    """Where ``config``'s VAE loads from: ``pretrained_vae_model_name_or_path`` when set (its ``vae/`` subfolder when
    it has ``vae/config.json``, else its root; a hub id the entry point did not resolve to its snapshot folder is
    read as a component repo, its root), else the model folder's ``vae/`` at ``revision``. The one answer to "where
    is the VAE": :meth:`ModelSpec.vae_location` and the memory estimate ask it."""
    separate = config.pretrained_vae_model_name_or_path
    if separate is None:
        return ComponentLocation(config.pretrained_model_name_or_path, "vae", config.revision)
    root = Path(separate).expanduser()
    if not root.is_dir():
        return ComponentLocation(separate, None, is_separate=True)
    return ComponentLocation(str(root), component_subfolder(root, "vae"), is_separate=True)


def vae_latent_channels(vae_config: dict[str, Any]) -> int | None:
    """Channels of the latents a VAE config makes: ``latent_channels`` (AutoencoderKL) or ``z_dim`` (the Wan and
    Qwen-Image VAEs); None when it says neither."""
    for key in ("latent_channels", "z_dim"):
        value = vae_config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


class ModelSpec(abc.ABC):
    """One diffusion-model family. Instances are cheap (a look at the folder's
    ``model_index.json`` and file names); components load on request."""

    family: ClassVar[str]
    #: Module names LoRA adapts when ``lora_target_modules`` is not set.
    default_lora_targets: ClassVar[list[str]]
    #: Name of the trained component inside the pipeline folder (``unet``, ``transformer``).
    denoiser_name: ClassVar[str]
    #: Components this family loads: folder name -> (kind, library, allowed class names, or a
    #: pattern the name must match in full). The names are only compared, never imported: each
    #: family loads its own fixed classes (a scheduler's class does not matter, the family
    #: builds its training scheduler from the folder's config, hence a pattern for it).
    components: ClassVar[dict[str, tuple[ComponentKind, str, frozenset[str] | re.Pattern]]]

    def __init__(self, config: "TrainingConfig"):
        self.config = config
        self.model_path = config.pretrained_model_name_or_path
        self.check_model_folder()
        self.check_alignment()
        self.check_positions()
        self.check_token_routing()

    #: Whether training pairs each image with a source (conditioning) image (an edit model: datasets need
    #: ``conditioning_data_dir`` or a ``conditioning_column``). Such a family's ``encode_images`` takes
    #: ``[B, 6, H, W]`` (image, then source) and, when :attr:`prompt_sees_source`, its ``encode_prompts`` a
    #: ``images=`` list of the sources (PIL, at the image's size).
    conditions_on_image: ClassVar[bool] = False
    #: For an edit model: whether the prompt embedding depends on the source too (Qwen-Image-Edit's text encoder
    #: sees it: one cached embedding per pair), or on the caption alone (Flux Kontext: one per caption).
    prompt_sees_source: ClassVar[bool] = True

    #: Whether the denoiser is conditioned on each image's original size and crop offset (SDXL's micro-
    #: conditioning): its latent entries then hold them too (caching/size_crop.py).
    conditions_on_size_crop: ClassVar[bool] = False

    def pixel_entries(self, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """What a latent entry keeps of a batch's pixels themselves (``[B, C, H, W]`` as :meth:`encode_images` takes
        them), by name, batch first; they join the batch's conditioning. None by default: an SDXL ControlNet keeps
        its conditioning image (models/sdxl_controlnet.py)."""
        return {}

    def pixel_entry_bytes(self, width: int, height: int) -> int:
        """Bytes of :meth:`pixel_entries` for one ``width`` x ``height`` image (the cache's size estimate)."""
        return 0

    def pixel_entry_shapes(self, batch_size: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of each :meth:`pixel_entries` tensor of a micro-batch at a square ``resolution`` bucket
        (the memory estimate's batch; :meth:`batch_shapes` gives the rest)."""
        return {}

    @property
    def takes_validation_image(self) -> bool:
        """Whether validation renders from an image (``validation_image``): an edit model's source, an
        image-to-video model's first frame. The sampler of such a family takes ``image=`` (PIL)."""
        return self.conditions_on_image

    #: Frames per second of the validation videos of a video family (the .mp4 / animated .webp
    #: and the trackers' videos); image families render no video and never read it.
    video_fps: ClassVar[int] = 16

    # --- latent grid ---------------------------------------------------------------------
    #: Latents the denoiser takes per token along a side when the folder does not say: 2 for
    #: sd3 / wan (patches) and flux (2x2 packing); 1 for a UNet (it pads odd sides itself).
    latent_patch: ClassVar[int] = 1

    def vae_scale_from_folder(self) -> int | None:
        """Pixels per latent along a side from the local folder's VAE config (2 ** (blocks - 1));
        None when there is no readable config (a hub id)."""
        vae = self._component_config("vae")
        blocks = vae.get("block_out_channels") if vae else None
        return 2 ** (len(blocks) - 1) if isinstance(blocks, list) and blocks else None

    def latent_patch_from_folder(self) -> int:
        """Latents per token along a side for this folder's denoiser (:attr:`latent_patch` by default)."""
        return self.latent_patch

    def vae_location(self) -> ComponentLocation:
        """Where this run's VAE loads from (:func:`vae_location`): every VAE load and VAE config read goes here."""
        return vae_location(self.config)

    def component_location(self, name: str) -> ComponentLocation:
        """Where component ``name`` loads from: :meth:`vae_location` for ``vae``, else the model folder's ``name/``."""
        if name == "vae":
            return self.vae_location()
        return ComponentLocation(self.model_path, name, self.config.revision)

    def denoiser_latent_channels(self) -> int | None:
        """Channels of the latents the denoiser takes and predicts, from its config (``out_channels``, else
        ``in_channels``; an image-conditioned model's input has more); None without a readable config."""
        config = self._component_config(self.denoiser_name) or {}
        for key in ("out_channels", "in_channels"):
            value = config.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return None

    def _component_config(self, subfolder: str) -> dict[str, Any] | None:
        try:
            found = self.read_component_config(subfolder)
        except (ValueError, OSError):  # a hub id, unreadable or invalid JSON: the loaders say so later
            return None
        return found if isinstance(found, dict) else None

    def check_alignment(self) -> None:
        """Refuse, before anything loads, an ``aspect_bucket_alignment`` whose buckets give latent
        sides that do not split into whole denoiser tokens (odd sides for 2x2 patches fail only
        after the cache fill, with a shape mismatch). Reads the folder's configs only; the config
        rule checked the family's usual factors already, this catches a folder whose differ.

        Raises:
            ValueError: naming the folder's factors and the alignments that fit.
        """
        vae = self.vae_scale_from_folder()
        location = self.vae_location()
        where = f" of {location.path if location.is_separate else self.local_root}" if vae is not None else ""
        if vae is None:
            vae = FAMILY_LATENT_GRID.get(self.family, (8, 1))[0]
        problem = alignment_problem(
            self.family, self.config.aspect_bucket_alignment, vae, self.latent_patch_from_folder(), where
        )
        if problem:
            raise ValueError(problem)

    def positions_per_side(self) -> tuple[int, str] | None:
        """How many tokens along a side the denoiser has position embeddings for, and the config key
        that says so (sd3's ``pos_embed_max_size``, wan's ``rope_max_seq_len``); None: no limit."""
        return None

    def check_positions(self) -> None:
        """Refuse, before anything loads, a resolution whose buckets (each has a side of at least the
        resolution) need more tokens along a side than the denoiser has positions for: the first
        training step would fail after the whole cache fill.

        Raises:
            ValueError: naming the limit and the largest resolution within it.
        """
        limit = self.positions_per_side()
        if limit is None:
            return
        most, key = limit
        step = (self.vae_scale_from_folder() or FAMILY_GRID_DEFAULT) * self.latent_patch_from_folder()
        sizes: dict[str, float] = {
            f"datasets[{i}].resolution": d.resolution
            for i, d in enumerate(self.config.datasets or [])
            if d.resolution is not None
        }
        sizes["resolution"] = self.config.resolution  # last: unset, it is the largest dataset's, named above
        for name, size in sizes.items():
            if size // step > most:
                raise ValueError(
                    f"{name} {size} needs {size // step} tokens along a side ({step} px each), but the {self.family} "
                    f"denoiser in {self.model_path} has positions for {most} ({key} in its config): use a resolution "
                    f"of at most {most * step}, or a model made for larger images"
                )

    def check_token_routing(self) -> None:
        """Refuse, before anything loads, ``tread_config`` routes that do not fit the denoiser's blocks (counted from
        its ``config.json``; a hub id's are checked when it loads: ``tread.install_token_routing``).

        Raises:
            ValueError: one line per route that does not fit, naming it and the fix.
        """
        if self.config.tread_config is None:
            return
        config = self._component_config(self.denoiser_name) or {}
        layout = tread.LAYOUTS.get(config.get("_class_name", ""))
        num_blocks = tread.num_blocks_in(config, layout) if layout is not None else None
        if num_blocks is None:  # a hub id, or a class the folder check refuses
            return
        where = f"the {self.family} transformer in {self.model_path}"
        problems = tread.route_problems(self.config.tread_config.routes, num_blocks, where)
        if problems:
            raise ValueError("\n".join(problems))

    # --- safe loading --------------------------------------------------------------------
    @property
    def local_root(self) -> Path | None:
        """The model folder when ``pretrained_model_name_or_path`` is a local folder, else None (a hub id)."""
        root = Path(self.model_path).expanduser()
        return root if root.is_dir() else None

    def check_model_folder(self) -> None:
        """Refuse a local folder whose ``model_index.json`` names, for a component this family
        loads, a class off the allow-list, or whose weights are pickle files only; and a separate
        VAE that does not fit (:meth:`check_separate_vae`).

        Runs before anything loads; reads only JSON and file names. A hub id is checked by
        the libraries themselves (every load passes ``use_safetensors=True``).

        Raises:
            ValueError: naming the folder, the component and the fix.
        """
        self.check_separate_vae()
        root = self.local_root
        if root is None:
            return
        index = self.model_index
        if index is not None:
            index_file = root / "model_index.json"
            for name, (_, library, allowed) in self.components.items():
                if name in index:
                    self._check_index_entry(index_file, name, index[name], library, allowed)
        for name, (kind, _, _) in self.components.items():
            if kind != "model":
                continue
            pickles = pickle_only_weights(root / name)
            if pickles:
                raise ValueError(
                    f"{root / name} holds only pickle weights ({', '.join(pickles)}) and no .safetensors. "
                    "simpletuner loads safetensors only, because unpickling a file can run any code in it. "
                    f"Convert it to safetensors once, on a machine where you trust the file: load it with "
                    f"from_pretrained({str(root)!r}, subfolder={name!r}) and write it back with "
                    "save_pretrained(..., safe_serialization=True)"
                )

    def check_separate_vae(self) -> None:
        """Refuse a separate VAE folder (``pretrained_vae_model_name_or_path``) whose ``config.json`` is missing or
        names a class off the family's VAE allow-list, whose weights are pickle files only, or whose latents have
        other channels than the denoiser's: the cache fill must never start with a VAE that does not fit. Reads
        JSON and file names only; a hub id the entry point did not resolve is left to the loaders.

        Raises:
            ValueError: one line naming the key, the folder and the fix.
        """
        location = self.vae_location()
        folder = location.local_folder
        if not location.is_separate or folder is None:
            return
        fix = "or remove the key to use the model's own VAE"
        config_file = folder / COMPONENT_CONFIG
        try:
            vae = json.loads(config_file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ValueError(
                f"{VAE_KEY}: {location.path} holds no VAE config (neither vae/config.json nor config.json): point it "
                f"at a diffusers VAE folder, {fix}"
            ) from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{VAE_KEY}: {config_file} cannot be read as JSON ({exc}); {fix}") from None
        _, library, allowed = self.components["vae"]
        class_name = vae.get("_class_name") if isinstance(vae, dict) else None
        if isinstance(allowed, re.Pattern):
            ok, expected = isinstance(class_name, str) and allowed.fullmatch(class_name) is not None, allowed.pattern
        else:
            ok, expected = class_name in allowed, " or ".join(sorted(allowed))
        if not ok:
            raise ValueError(
                f"{VAE_KEY}: {config_file} names {class_name!r}; model family {self.family!r} loads its VAE as "
                f"{library}.{expected} and nothing else: point it at a {self.family} VAE, {fix}"
            )
        pickles = pickle_only_weights(folder)
        if pickles:
            raise ValueError(
                f"{VAE_KEY}: {folder} holds only pickle weights ({', '.join(pickles)}) and no .safetensors; "
                "simpletuner loads safetensors only (unpickling a file can run any code in it): convert it once with "
                f"{class_name}.from_pretrained(...).save_pretrained(..., safe_serialization=True), {fix}"
            )
        channels, wanted = vae_latent_channels(vae), self.denoiser_latent_channels()
        if channels is not None and wanted is not None and channels != wanted:
            raise ValueError(
                f"{VAE_KEY}: the VAE in {folder} makes {channels}-channel latents, but the {self.family} denoiser of "
                f"{self.model_path} takes {wanted}-channel ones: point it at a VAE made for this model, {fix}"
            )

    @functools.cached_property
    def model_index(self) -> dict[str, Any] | None:
        """The local folder's ``model_index.json``, read once (by :meth:`check_model_folder`, when
        the spec is made); None for a hub id or a folder without one.

        Raises:
            ValueError: the file is not valid JSON, or not a JSON object.
        """
        root = self.local_root
        return None if root is None else read_model_index(root)

    def _check_index_entry(
        self, index_file: Path, name: str, entry: Any, library: str, allowed: frozenset[str] | re.Pattern
    ) -> None:
        if not (isinstance(entry, list) and len(entry) == 2):
            raise ValueError(f"{index_file}: {name!r} is {entry!r}, not [library, class name]")
        named_library, class_name = entry
        if isinstance(allowed, re.Pattern):
            ok = isinstance(class_name, str) and allowed.fullmatch(class_name) is not None
            expected = f"{library}.<{allowed.pattern}>"
        else:
            ok = class_name in allowed
            expected = f"{library}." + " or ".join(sorted(allowed))
        if named_library != library or not ok:
            raise ValueError(
                f"{index_file}: {name!r} names {named_library}.{class_name}; model family {self.family!r} loads "
                f"{name} as {expected} and nothing else. Point `pretrained_model_name_or_path` at a "
                f"{self.family} pipeline folder"
            )

    # --- loading -------------------------------------------------------------------------
    @abc.abstractmethod
    def load_noise_scheduler(self) -> Any:
        """The training noise scheduler (e.g. DDPMScheduler)."""

    @abc.abstractmethod
    def load_vae(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        """The image encoder/decoder, frozen, in eval mode."""

    @abc.abstractmethod
    def load_text_encoders(self, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
        """Tokenizers and text encoders, frozen, keyed by their pipeline names."""

    @abc.abstractmethod
    def load_denoiser(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        """The model that is trained (UNet or transformer)."""

    # --- identities used in cache keys ---------------------------------------------------
    @abc.abstractmethod
    def image_encoder_identity(self) -> str:
        """Changes whenever the VAE weights or config change."""

    @abc.abstractmethod
    def text_encoder_identity(self) -> str:
        """Changes whenever any tokenizer or text encoder changes."""

    # --- encoding (cache filling) --------------------------------------------------------
    @abc.abstractmethod
    def encode_images(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels in [-1, 1], shape [B, 3, H, W] -> scaled latents [B, C, h, w]."""

    @abc.abstractmethod
    def encode_prompts(self, text_encoders: dict[str, Any], captions: list[str]) -> list[dict[str, torch.Tensor]]:
        """One dict of conditioning tensors per caption (e.g. ``prompt_embeds``)."""

    # --- training ------------------------------------------------------------------------
    @abc.abstractmethod
    def training_loss(
        self,
        denoiser: nn.Module,
        latents: torch.Tensor,
        conditioning: dict[str, torch.Tensor],
        generator: torch.Generator,
        is_regularisation_data: bool = False,
    ) -> torch.Tensor:
        """Per-sample loss, shape [B] (the trainer sums and normalises over the window), of the
        config's ``loss_type``. ``is_regularisation_data``: the batch comes from a regularisation
        dataset; in an adapter run its target is the base model's prediction (adapters off)."""

    # --- output --------------------------------------------------------------------------
    @abc.abstractmethod
    def save_lora(self, output_dir: Path, denoiser: nn.Module) -> Path:
        """Write the adapter in the format the family's diffusers pipeline loads; returns the file."""

    @abc.abstractmethod
    def save_full(self, output_dir: Path, denoiser: nn.Module) -> Path:
        """Write the fully fine-tuned denoiser as a diffusers folder; returns it."""

    @abc.abstractmethod
    def build_pipeline(self, denoiser: nn.Module, vae: nn.Module, text_encoders: dict[str, Any]) -> Any:
        """A diffusers pipeline for sampling with the model being trained."""

    # --- memory estimate (optional) --------------------------------------------------------
    def batch_shapes(self, batch_size: int) -> tuple[tuple[int, ...], dict[str, tuple[int, ...]]]:
        """Shapes of one cached micro-batch at a square ``resolution`` bucket, read from the
        folder's configs only (no weights): the latents and each conditioning tensor
        ``encode_prompts`` caches, with the batch dimension first. Used by the memory estimator.

        Raises:
            NotImplementedError: the family does not describe its batch (no memory estimate).
        """
        raise NotImplementedError(f"model family {self.family!r} does not describe its batch shapes")

    def read_component_config(self, subfolder: str, filename: str = "config.json") -> dict[str, Any] | None:
        """A component's JSON config from the local folder it loads from (:meth:`component_location`: the model
        folder, or a separate VAE's); None when the file is absent.

        Raises:
            ValueError: that folder is not a local folder (a hub id).
        """
        location = self.component_location(subfolder)
        folder = location.local_folder
        if folder is None:
            raise ValueError(
                f"{location.path} is not a local folder: shapes are read from a local diffusers-format folder"
            )
        path = folder / filename
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None

    @property
    def lora_targets(self) -> list[str]:
        return list(self.config.lora_target_modules or self.default_lora_targets)

    # --- set-up the trainer and the estimator share -------------------------------------
    #: True for a model with several denoisers (Wan 2.2's experts), each with its own adapter.
    has_experts: ClassVar[bool] = False
    #: Whether a full run's checkpoints also hold :meth:`save_full`'s folder (a ControlNet's: the trained part is
    #: small beside the frozen base, and SimpleTuner's checkpoints hold it); otherwise ``trainable.safetensors`` only.
    checkpoints_hold_full_weights: ClassVar[bool] = False

    def denoiser_from_config(self) -> nn.Module:
        """The denoiser built from its config alone, without weights (the caller picks the device,
        e.g. ``meta`` for the memory estimate). Classes come from ``model_index.json`` through
        :func:`resolve_component_class`."""
        root, index = self.local_root, self.model_index
        if index is None:
            raise ValueError(
                f"{self.model_path} is not a local diffusers folder with a model_index.json (configs are enough)"
            )
        entry = index.get(self.denoiser_name)
        if not (isinstance(entry, list) and len(entry) == 2):
            raise ValueError(f"{root}/model_index.json names no [library, class] for {self.denoiser_name!r}")
        if entry[0] != "diffusers":
            raise ValueError(
                f"{self.denoiser_name} is {entry[0]}.{entry[1]}; only diffusers denoisers are built from configs"
            )
        library, class_name = entry
        cls = resolve_component_class(library, class_name, "model")
        return cls.from_config(cls.load_config(str(root), subfolder=self.denoiser_name))

    def prepare_denoiser(self, denoiser: nn.Module, weight_dtype: torch.dtype) -> nn.Module:
        """The trainer's set-up of a loaded denoiser (adapter or full training, precision,
        gradient checkpointing); the memory estimator runs the same on ``meta``."""
        return prepare_for_training(denoiser, self.lora_targets, self.config, weight_dtype)

    def named_parameter_groups(self, denoiser: nn.Module) -> dict[str, list[nn.Parameter]]:
        """Trainable parameters by optimizer group name (one group, ``default``, unless the family
        trains several parts with their own rates, like Wan 2.2's ``high_noise`` / ``low_noise``)."""
        return {"default": [p for p in denoiser.parameters() if p.requires_grad]}

    def apply_low_vram(self, denoiser: nn.Module) -> None:
        """``low_vram``: move parts of the denoiser that training never runs to CPU RAM (none by default)."""
        return None  # a hook: only a family with idle parts (Wan 2.2's experts) overrides it

    def idle_modules(self, denoiser: nn.Module) -> list[nn.Module]:
        """The modules :meth:`apply_low_vram` moved to CPU RAM (validation brings them to the GPU for a while)."""
        return []

    @property
    def needs_unused_parameter_detection(self) -> bool:
        """Whether a step may leave some trainable parameters without a gradient (DDP must be told)."""
        return False

    def save_adapter(self, output_dir: Path, denoiser: nn.Module) -> Path:
        """Write the trained adapter: diffusers format for ``lora_type: standard``
        (:meth:`save_lora`), LyCORIS' own format for ``lycoris``."""
        if self.config.lora_type == "lycoris":
            from simpletuner.models.adapters.lycoris import save_lycoris

            return save_lycoris(denoiser, Path(output_dir) / "pytorch_lora_weights.safetensors", self.config)
        return self.save_lora(output_dir, denoiser)

    def save_final(self, output_dir: Path, denoiser: nn.Module, full: bool, step: int | None = None) -> Path:
        """The run's final weights (:meth:`save_full` when ``full``, else :meth:`save_adapter`), with
        the same names and layout, written whole or not at all: into a temp folder inside
        ``output_dir``, then moved to its top, replacing earlier final weights whole. Free space
        is checked first (the tensors' bytes); a disk that fills during the write removes the
        temp folder. Returns the path the save method names, at its final place. ``step``: recorded
        in :data:`FINAL_RECORD` once the weights are in place.

        Raises:
            NoSpace: not enough room (nothing was moved into place; earlier weights are intact).
        """
        output_dir = Path(output_dir)
        remove_final_save_leftovers(output_dir)  # of a save killed midway (this run holds the folder's lock)
        what = "the final model" if full else "the final adapter"
        exports = [] if full else [fmt for fmt in self.config.output_formats if fmt != "diffusers"]
        needed = _weights_bytes(denoiser, full) * (1 + len(exports))
        require_space(output_dir, needed, what)
        temp = output_dir / f"{FINAL_SAVE_PREFIX}tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        temp.mkdir(parents=True)
        with disk_full_guard(output_dir, needed, what, cleanup=[temp]):
            written = self.save_full(temp, denoiser) if full else self.save_adapter(temp, denoiser)
            self.write_exports(temp, denoiser, exports)
            inject_fault("final_save")  # tests: a disk that fills before the weights are complete
            _fsync_files(temp)
        names = sorted(entry.name for entry in temp.iterdir())
        _move_into_place(temp, output_dir)
        if step is not None:
            _write_record(output_dir, {"step": step, "files": names})
        return output_dir / Path(written).relative_to(temp)

    def check_exports(self, denoiser: nn.Module) -> None:
        """Before training: refuse ``output_formats`` that this adapter's modules cannot be written in (a module a
        format's reader would map elsewhere, say), which the final save could otherwise only log.

        Raises:
            ValueError: one line per format, naming the modules and why.
        """
        from simpletuner.models.adapters.export import ExportError, denoiser_config_of, export_state_dict

        formats = [fmt for fmt in self.config.output_formats if fmt != "diffusers"]
        if not formats or self.config.training_type != "lora" or self.config.lora_type != "standard":
            return
        config = denoiser_config_of(getattr(denoiser, "config", None))
        problems = []
        for modules in self.export_modules(denoiser):
            for fmt in formats if modules else ():
                try:
                    export_state_dict(modules, self.family, fmt, config)
                except ExportError as exc:
                    problems.append(f"output_formats {fmt!r}: {exc}")
        if problems:
            raise ValueError("\n".join(dict.fromkeys(problems)))

    def export_modules(self, denoiser: nn.Module) -> list[dict[str, Any]]:
        """The peft LoRA modules of each adapter file the final save writes, named as in the file
        (``<component>.<module path>``; :func:`~simpletuner.models.adapters.export.modules_of`): one file, or one per
        Wan 2.2 expert (each a model of its own)."""
        from diffusers.models.modeling_utils import ModelMixin

        from simpletuner.models.adapters.export import modules_of

        parts = [denoiser] if isinstance(denoiser, ModelMixin) else list(denoiser.children())
        return [modules_of(part, self.denoiser_name, self.config.effective_lora_alpha) for part in parts]

    def write_exports(self, folder: Path, denoiser: nn.Module, formats: Sequence[str]) -> list[Path]:
        """Beside each diffusers-format adapter file in ``folder``, the same adapter under each of ``formats``' names
        (``output_formats``; models/adapters/export.py), ``<name>.<format>.safetensors``; returns the files written.
        One that cannot be written is logged with the reason and left out: the diffusers file is the run's result."""
        from simpletuner.models.adapters.export import ExportError, denoiser_config_of, export_file, export_name

        written = []
        sources = sorted(Path(folder).glob("*.safetensors"))
        config = denoiser_config_of(getattr(denoiser, "config", None))
        for fmt in formats:
            for source in sources:
                target = source.with_name(export_name(source.name, fmt))
                try:
                    written.append(export_file(source, target, self.family, fmt, config))
                except ExportError as exc:
                    logging.getLogger(__name__).error("output_formats %r: %s not written: %s", fmt, target.name, exc)
        return written


def _weights_bytes(denoiser: nn.Module, full: bool) -> int:
    """About the bytes the final save writes: every tensor of the state dict in its own dtype (a
    full save), or the trainable (adapter) parameters at 4 bytes each (saved as fp32 at most)."""
    if not full:
        return 4 * sum(p.numel() for p in denoiser.parameters() if p.requires_grad)
    storages = {
        (t.device, t.untyped_storage().data_ptr()): t.untyped_storage().nbytes()
        for t in denoiser.state_dict().values()
        if isinstance(t, torch.Tensor)
    }
    return sum(storages.values())  # tied weights counted once


def _write_record(output_dir: Path, record: dict[str, Any]) -> None:
    temp = output_dir / f"{FINAL_SAVE_PREFIX}tmp-{os.getpid()}-record"
    try:
        temp.write_text(json.dumps(record), encoding="utf-8")
        os.replace(temp, output_dir / FINAL_RECORD)
    except OSError as exc:  # the weights are in place: without the record a resume just takes them as final
        temp.unlink(missing_ok=True)
        logging.getLogger(__name__).warning("could not write %s: %s", output_dir / FINAL_RECORD, exc)


def final_weights_step(output_dir: Path) -> int | None:
    """The step the final weights at the top of ``output_dir`` were saved at (:data:`FINAL_RECORD`);
    None when not recorded (no final save yet, or one from before the record existed)."""
    try:
        step = json.loads((Path(output_dir) / FINAL_RECORD).read_text(encoding="utf-8"))["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) else None


def _fsync_files(folder: Path) -> None:
    """Flush every file under ``folder`` to disk before it is renamed into place."""
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _move_into_place(temp: Path, output_dir: Path) -> None:
    """Rename each entry of ``temp`` to the top of ``output_dir``. A file replaces its namesake in
    one rename; a folder cannot, so the earlier one is moved aside first and removed after."""
    for entry in sorted(temp.iterdir()):
        target = output_dir / entry.name
        aside = None
        if target.is_symlink() or (target.exists() and (target.is_dir() or entry.is_dir())):
            aside = output_dir / f"{FINAL_SAVE_PREFIX}old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.replace(target, aside)
        os.replace(entry, target)
        if aside is not None:
            _remove_path(aside)
    temp.rmdir()


def remove_final_save_leftovers(output_dir: Path) -> list[Path]:
    """Remove the temp and set-aside folders of final saves killed midway (:data:`FINAL_SAVE_PREFIX`);
    returns them. Only for the run that holds ``output_dir``."""
    leftovers = sorted(Path(output_dir).glob(FINAL_SAVE_PREFIX + "*")) if Path(output_dir).is_dir() else []
    for path in leftovers:
        _remove_path(path)
    return leftovers


def save_transformer_lora(
    pipeline_cls, output_dir, denoiser, weight_name: str = "pytorch_lora_weights.safetensors"
) -> Path:
    """Save a transformer LoRA through ``pipeline_cls.save_lora_weights`` with its adapter metadata.

    PEFT keys are kept as they are (``lora_A`` / ``lora_B``), as diffusers' own transformer LoRA
    scripts save them: ``convert_state_dict_to_diffusers`` would rename ``to_q`` keys to the old
    UNet ``lora.down`` form, which the SD3 / Flux / Wan loaders do not map back.
    """
    from peft.utils import get_peft_model_state_dict

    pipeline_cls.save_lora_weights(
        save_directory=str(output_dir),
        transformer_lora_layers=get_peft_model_state_dict(denoiser),
        transformer_lora_adapter_metadata=denoiser.peft_config["default"].to_dict(),
        weight_name=weight_name,
        safe_serialization=True,
    )
    ordinary_permissions(Path(output_dir) / weight_name)  # safetensors (under diffusers) writes 0600
    return Path(output_dir) / weight_name
