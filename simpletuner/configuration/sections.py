"""The nested parts of the training configuration: datasets, caches, GH200 options, augmentations,
LyCORIS options and TREAD routes, and what every config model shares (``_Strict``, the checked path types).
``schema.py`` holds the top-level ``TrainingConfig`` built from them.
"""

from __future__ import annotations

import re
from typing import Annotated, ClassVar, Literal, Optional

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from simpletuner.configuration.cache_paths import TEXT_TEMPLATE_NAMES, template_problem
from simpletuner.configuration.paths import folder_name_problem, path_problem
from simpletuner.configuration.rules import RAMP_RULES, Rule, check_rules


class _Strict(BaseModel):
    # allow_inf_nan=False: no setting means anything as nan or inf ("1e400" parses as inf).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _checked(problem):
    """An after-validator raising ``problem(value)``'s message, when there is one."""

    def check(value: str) -> str:
        message = problem(value)
        if message:
            raise ValueError(message)
        return value

    return AfterValidator(check)


#: A file or folder path: not empty, no NUL, each name within the filesystem's limit (255 bytes on
#: most), checked at config time instead of an ``OSError: File name too long`` later.
PathText = Annotated[str, _checked(path_problem)]
#: One folder name (it becomes a folder under output_dir): no separators, within 255 bytes.
FolderName = Annotated[str, _checked(folder_name_problem)]
#: A cache folder that may hold the place-holders of :mod:`.cache_paths` (``{model_family}``, ``{id}``, ...).
CacheFolderText = Annotated[PathText, _checked(template_problem)]
#: ``cache_config.text_cache_dir``: the same, without ``{id}`` (no dataset owns it).
TextCacheFolderText = Annotated[PathText, _checked(lambda value: template_problem(value, TEXT_TEMPLATE_NAMES))]

#: Bounds no real run comes near, so a typo (or 1e12) is refused instead of overflowing later.
MAX_RESOLUTION = 16384
MAX_LEARNING_RATE = 1.0


CaptionStrategy = Literal["textfile", "filename", "filename_cleaned", "instance_prompt", "parquet", "csv", "jsonl"]

#: Caption strategies that read a metadata file; each reads the dataset's sub-table of the same name.
METADATA_CAPTION_STRATEGIES = ("parquet", "csv", "jsonl")


def metadata_file_format(strategy: str, path: str) -> str:
    """How the metadata file of ``strategy`` at ``path`` is read: ``parquet``, ``jsonl`` (one JSON object a
    line), ``json`` (one JSON array of objects) or ``csv``. ``parquet`` goes by the file's extension
    (``.jsonl`` / ``.json`` are JSON, as in SimpleTuner; ``.csv`` is CSV; anything else is Parquet);
    ``csv`` and ``jsonl`` always read their own format."""
    if strategy != "parquet":
        return strategy
    suffix = path.lower().rsplit(".", 1)[-1] if "." in path else ""
    return {"jsonl": "jsonl", "json": "json", "csv": "csv"}.get(suffix, "parquet")


CacheType = Literal["disk", "memory", "unified_memory"]


class CacheConfig(_Strict):
    """Where VAE latents and text embeddings are cached."""

    cache_dir: PathText = Field(
        default="cache",
        description=(
            "Root folder of the latent and text-embedding caches. A relative path is taken from the config file's "
            "folder (not the working directory; `--set` values too)."
        ),
    )
    vae_cache_type: CacheType = Field(
        default="disk",
        description=(
            "Where latents are held: `disk` (read from disk each batch), `memory` (CPU RAM) or `unified_memory` "
            "(CUDA managed memory advised to stay in CPU RAM, prefetched to the GPU before use)."
        ),
    )
    text_cache_type: CacheType = Field(
        default="disk",
        description="As `vae_cache_type`, for text embeddings; `unified_memory` advises them to stay in GPU memory.",
    )
    persistent_cache: bool = Field(
        default=True,
        description="Also write `memory` / `unified_memory` caches to `cache_dir` and load them from there next run.",
    )
    text_cache_dir: Optional[TextCacheFolderText] = Field(
        default=None,
        description=(
            "Folder of the text-embedding cache instead of `<cache_dir>/<model_family>/text`; `{model_family}` "
            "and `{output_dir}` are replaced by their values."
        ),
    )
    verify_content: bool = Field(
        default=False,
        description=(
            "At start, hash the source file of every latent the run would reuse and re-encode the changed ones. "
            "Off: a cached latent is reused while its image keeps its path, size and modification time."
        ),
    )


class GH200Optimizations(_Strict):
    """Unified-memory hints, managed memory for weights and activations, and the gradient-accumulation ramp."""

    cross_field_rules: ClassVar[tuple[Rule, ...]] = RAMP_RULES

    enable_uvm_hints: Optional[bool] = Field(
        default=None,
        description=(
            "Force unified-memory placement hints on or off. Unset: the environment variable "
            "SIMPLETUNER_GH200_UVM_HINTS (1/0), else on when a cache is `unified_memory`, else off."
        ),
    )
    enable_batch_size_rampup: bool = Field(
        default=False,
        description="Ramp the effective batch from `initial_effective_batch_size` to `target_effective_batch_size`.",
    )
    initial_effective_batch_size: Optional[int] = Field(
        default=None,
        ge=1,
        description="Effective batch (samples per optimizer step, all processes) at the start of the ramp.",
    )
    target_effective_batch_size: Optional[int] = Field(
        default=None,
        ge=1,
        description="Effective batch at the end of the ramp; a multiple of train_batch_size x processes.",
    )
    batch_rampup_steps: int = Field(
        default=0,
        ge=0,
        description="Micro-batches over which the ramp goes from initial to target (0: target at once).",
    )

    managed_memory: Literal["caches", "frozen_weights", "all"] = Field(
        default="caches",
        description=(
            "What lives in CUDA managed memory (GH200 / GB10): `caches` (only `unified_memory` caches), "
            "`frozen_weights` (also the frozen weights) or `all` (every training allocation). The last two are "
            "refused on a discrete GPU unless `force_managed_memory` is true."
        ),
    )
    oversubscription_ratio: Optional[float] = Field(
        default=None,
        gt=0,
        description=(
            "managed_memory `all` only: the managed pool may grow to this many times the GPU's memory (HBM); "
            "refused at start when the machine cannot back it (free HBM + available CPU memory on GH200, "
            "available memory on GB10). Unset: as much as the machine can back, less a 10% reserve."
        ),
    )
    force_managed_memory: bool = Field(
        default=False,
        description=(
            "Consent to managed_memory `frozen_weights` / `all` on a GPU that is not unified-memory (a PCIe card): "
            "it runs, but pages that do not fit the card move over PCIe and training can slow by orders of "
            "magnitude."
        ),
    )
    prefetch_blocks_ahead: int = Field(
        default=1,
        ge=0,
        le=8,
        description=(
            "managed_memory `frozen_weights`: how many blocks ahead of the one running the frozen weights are "
            "prefetched to the GPU (forward in order, backward in reverse). 0: no prefetch; the GPU reads the "
            "weights in place over NVLink-C2C."
        ),
    )

    @model_validator(mode="after")
    def _ramp_complete(self) -> "GH200Optimizations":
        return check_rules(self)


class Augmentations(_Strict):
    """Random changes to training images before they are encoded (all off by default)."""

    flip_probability: float = Field(default=0.0, ge=0, le=1, description="Chance of a horizontal flip.")
    crop_jitter: float = Field(
        default=0.0,
        ge=0,
        lt=0.5,
        description=(
            "Move the crop window by up to this fraction of the bucket side (the image is scaled up just enough to "
            "allow it)."
        ),
    )
    color_jitter: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="Change brightness, contrast and saturation each by a random factor in [1 - x, 1 + x].",
    )

    @property
    def is_enabled(self) -> bool:
        return bool(self.flip_probability or self.crop_jitter or self.color_jitter)


class LycorisModuleOptions(_Strict):
    """The LyCORIS settings of the layers one `apply_preset.module_algo_map` / `name_algo_map` entry covers;
    what is left out comes from the `lycoris` table, `lora_rank` and `lora_alpha`."""

    algo: Optional[Literal["locon", "loha", "lokr"]] = Field(default=None, description="The algo for these layers.")
    factor: Optional[int] = Field(default=None, description="LoKr: the Kronecker factor for these layers.")
    full_matrix: Optional[bool] = Field(default=None, description="LoKr: a full larger factor for these layers.")
    dim: Optional[int] = Field(default=None, ge=1, description="The rank for these layers (default `lora_rank`).")
    alpha: Optional[float] = Field(default=None, gt=0, description="The alpha for these layers (default `lora_alpha`).")


class LycorisPreset(_Strict):
    """Which layers get a LyCORIS module, as LyCORIS' `apply_preset` says it (SimpleTuner's
    `lycoris_config.json` carries one): module classes whose Linear / Conv layers are all adapted, and
    layer names; each with optional per-class / per-name settings. Names and classes that match nothing in
    the denoiser stop the run before training, naming them and the denoiser's block classes."""

    target_module: list[str] = Field(
        default_factory=list,
        description=(
            "Module class names (`Attention`, `FeedForward`, `BasicTransformerBlock`, ...): every Linear and Conv "
            "layer inside a module of these classes gets a LyCORIS module."
        ),
    )
    target_name: list[str] = Field(
        default_factory=list,
        description=(
            "Layer names (module paths such as `conv_in` or `blocks.0.attn1.to_q`), or patterns: regular "
            "expressions matched at the start of the path, or shell-style with `use_fnmatch`."
        ),
    )
    module_algo_map: dict[str, LycorisModuleOptions] = Field(
        default_factory=dict,
        description=(
            "Module class -> settings (`algo`, `factor`, `full_matrix`, `dim`, `alpha`) for the layers inside "
            "modules of that class; a class named here is a target too. The innermost such class wins."
        ),
    )
    name_algo_map: dict[str, LycorisModuleOptions] = Field(
        default_factory=dict,
        description="Layer name or pattern -> settings for that layer; a name here is a target too.",
    )
    exclude_name: list[str] = Field(
        default_factory=list, description="Layer names or patterns that get no LyCORIS module."
    )
    use_fnmatch: bool = Field(
        default=False,
        description="Match name patterns shell-style (`blocks.*.attn1`) instead of as regular expressions.",
    )
    enable_conv: bool = Field(
        default=True,
        description="Adapt Conv layers with a kernel larger than 1x1 too (1x1 convolutions are adapted as linear).",
    )

    @model_validator(mode="after")
    def _names_something(self) -> "LycorisPreset":
        if not (self.target_module or self.target_name or self.module_algo_map or self.name_algo_map):
            raise ValueError(
                "apply_preset names no layers: give `target_module` (module class names such as Attention) or "
                "`target_name` (layer names), or remove apply_preset to adapt `lora_target_modules`"
            )
        if not self.use_fnmatch:
            for key in ("target_name", "name_algo_map", "exclude_name"):
                for pattern in getattr(self, key):
                    try:
                        re.compile(pattern)
                    except re.error as exc:
                        raise ValueError(
                            f"apply_preset.{key}: {pattern!r} is not a regular expression ({exc}); fix it, or set "
                            "use_fnmatch true for shell-style patterns"
                        ) from None
        return self


class LycorisOptions(_Strict):
    """The LyCORIS adapter (`lora_type: lycoris`, needs the `lycoris` extra): on the layers `lora_target_modules`
    names, rank `lora_rank`, alpha `lora_alpha`, dropout `lora_dropout`; saved in LyCORIS' own key format
    (`lycoris_<layer>.*`, loadable by LyCORIS-aware tools), not diffusers' `load_lora_weights`."""

    algo: Literal["locon", "loha", "lokr"] = Field(
        default="lokr",
        description=(
            "`locon` (LoRA on linear and conv layers), `loha` (Hadamard product of two low-rank pairs), `lokr` "
            "(Kronecker product)."
        ),
    )
    factor: int = Field(
        default=-1,
        description=(
            "LoKr: the size of the smaller Kronecker factor of each weight dimension (-1: as square a split as "
            "possible)."
        ),
    )
    full_matrix: bool = Field(
        default=False,
        description="LoKr: train the larger Kronecker factor as a full matrix instead of a low-rank pair.",
    )
    apply_preset: Optional[LycorisPreset] = Field(
        default=None,
        description=(
            "LyCORIS' preset of target classes and names with per-class settings (the `apply_preset` of "
            "SimpleTuner's `lycoris_config.json`); when given it decides which layers are adapted and "
            "`lora_target_modules` is not used. Unset: the layers `lora_target_modules` names."
        ),
    )
    multiplier: float = Field(
        default=1.0,
        gt=0,
        description="Scale of every LyCORIS module's output while training (LyCORIS' `multiplier`); keep 1.0.",
    )
    bypass_mode: bool = Field(
        default=True,
        description=(
            "Compute each adapted layer as `layer(x) + adapter(x)` (no weight-sized delta; works on an 8-bit base). "
            "false: merge the delta into the weight at every forward, as LyCORIS does by default (needs "
            "`base_model_precision` `no_change`)."
        ),
    )
    conv_dim: Optional[int] = Field(
        default=None,
        ge=1,
        description="Rank of Conv layers with a kernel larger than 1x1 (LyCORIS' `conv_dim`; default `lora_rank`).",
    )
    conv_alpha: Optional[float] = Field(
        default=None,
        gt=0,
        description="Alpha of Conv layers with a kernel larger than 1x1 (LyCORIS' `conv_alpha`; default `lora_alpha`).",
    )


class TreadRoute(_Strict):
    """One TREAD route: the blocks from `start_layer_idx` to `end_layer_idx` (both included) see only the tokens
    each sample keeps."""

    selection_ratio: float = Field(
        ge=0,
        lt=1,
        description=(
            "The share of each sample's image tokens that skip the route's blocks (0.5: half of them go around); "
            "drawn at random per sample and step. 0 routes nothing."
        ),
    )
    start_layer_idx: int = Field(
        description=(
            "The first block of the route, 0-based over the transformer's blocks (Flux: the double-stream blocks, "
            "then the single-stream ones); negative counts from the end (-1: the last block)."
        )
    )
    end_layer_idx: int = Field(
        description="The last block of the route (included); negative counts from the end (-2: the one before last)."
    )


class TreadConfig(_Strict):
    """TREAD token routing (sd3, flux, wan, qwen_image; SimpleTuner's `tread_config`): while training, a random share
    of each sample's image tokens skips a range of transformer blocks and rejoins the sequence after it unchanged, so
    those blocks compute on fewer tokens. Validation and eval see every token; the loss covers every token."""

    routes: list[TreadRoute] = Field(
        description=(
            "The routes, in block order, none overlapping another (checked against the transformer's blocks when "
            "the model folder is read); an empty list routes nothing."
        )
    )
