"""The one table of ai-toolkit's trainer-process keys: what each becomes here (``same``, ``approximated`` with what
differs, ``ignored``, ``unsupported`` with what to do). Keys a row writes with more than a rename carry an ``apply``
(:mod:`simpletuner.configuration.aitoolkit.translate` calls it); keys ai-toolkit reads that no row names are the
generated tail (:func:`tail_row`): ignored at ai-toolkit's default, unsupported otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

from simpletuner.configuration.aitoolkit.facts import AIT_KEYS, ait_default
from simpletuner.configuration.simpletuner.reading import Kind

#: The parts of a job file: the job itself, the trainer process's own keys, and its sections.
Section = Literal["job", "process", "network", "save", "dataset", "train", "model", "sample"]

SECTIONS: tuple[Section, ...] = ("job", "process", "network", "save", "dataset", "train", "model", "sample")


@dataclass(frozen=True)
class AitKey:
    """One key of an ai-toolkit job: what plays its part here."""

    section: Section
    key: str
    kind: Kind
    ours: Optional[str] = None  # our key (dotted for a nested one); None: read with others or not at all
    note: str = ""
    #: read by the translator's own code (a value map, a default, several keys read together) rather than renamed
    special: bool = False


def _r(section: Section, key: str, kind: Kind, ours: Optional[str] = None, note: str = "", special=False) -> AitKey:
    return AitKey(section, key, kind, ours, note, special)


_BUCKETS = (
    "each resolution of the list is a dataset of its own, as ai-toolkit splits it (config_modules.py:1095-1113); "
    "bucket sizes differ: ai-toolkit's bucket holds at most resolution² pixels, and about the image's own area "
    "when the image is smaller (toolkit/buckets.py:17-48: 1200x800 at 512 -> 576x448 there, 640x448 here; a 300x200 "
    "image trains at 320x192 there, is enlarged to 640x448 here)"
)

_TARGETS = (
    "ai-toolkit adapts every Linear layer of the denoiser's blocks (toolkit/lora_special.py); here the family's "
    "attention projections: list more in `lora_target_modules`"
)

_ROWS: tuple[AitKey, ...] = (
    # --- the job ---
    _r(
        "job",
        "job",
        "same",
        None,
        "`extension` with one trainer process (`sd_trainer`, `ui_trainer`, "
        "`diffusion_trainer`); any other job or process type stops, naming it",
        special=True,
    ),
    _r(
        "job",
        "config.name",
        "same",
        "output_dir",
        "the run's folder: `training_folder/name` (ai-toolkit BaseTrainProcess saves there)",
        special=True,
    ),
    _r(
        "job",
        "config.process",
        "same",
        None,
        "exactly one process; several stop (train them one job each)",
        special=True,
    ),
    _r("job", "meta", "ignored", None, "metadata ai-toolkit writes into its saved files"),
    # --- the process's own keys ---
    _r("process", "type", "same", None, "a trainer process (see `job`)", special=True),
    _r("process", "training_folder", "same", "output_dir", "with `config.name` appended", special=True),
    _r(
        "process",
        "name",
        "same",
        "output_dir",
        "the run's folder inside `training_folder`, in place of `config.name` (which still names the run)",
        special=True,
    ),
    _r("process", "device", "ignored", None, "Accelerate picks the device"),
    _r("process", "performance_log_every", "ignored", None, "step timings are logged every `logging_steps`"),
    _r(
        "process",
        "trigger_word",
        "approximated",
        "datasets[].instance_prompt",
        "put before every caption here (`prepend_instance_prompt`); ai-toolkit adds it only to captions that do not "
        "hold it and replaces `[trigger]` in them (prompt_utils.py:720-742)",
        special=True,
    ),
    _r("process", "logging", "ignored", None, "progress is logged every `logging_steps`"),
    _r(
        "process",
        "dataset",
        "approximated",
        "datasets",
        "the GH200 fork's one-dataset spelling (seed 001, 8.3), read as `datasets: [it]`; stock ai-toolkit reads "
        "only `datasets` (BaseSDTrainProcess.py:144) and the fork's code is not published, so its meaning there is "
        "the seed's word",
        special=True,
    ),
    _r(
        "process",
        "optimizer",
        "approximated",
        "optimizer",
        "the GH200 fork's spelling (seed 001, 8.3 and 6.1): `name` is read as `train.optimizer`, the other keys as "
        "`train.optimizer_params`; stock ai-toolkit has no such block (only `train.optimizer`, "
        "config_modules.py:387-388) and the fork's code is not published",
        special=True,
    ),
    # --- network ---
    _r(
        "network",
        "type",
        "approximated",
        "lora_type",
        "`lora`: a peft LoRA; `lokr` / `locon`: LyCORIS (`lycoris.algo`); " + _TARGETS,
        special=True,
    ),
    _r(
        "network",
        "linear",
        "same",
        "lora_rank",
        "default 4 (config_modules.py:172-182), written when unset",
        special=True,
    ),
    _r("network", "rank", "same", "lora_rank", "the older name of `linear`", special=True),
    _r(
        "network",
        "linear_alpha",
        "same",
        "lora_alpha",
        "default `alpha`, itself 1.0 (config_modules.py:184-185), written when unset",
        special=True,
    ),
    _r("network", "alpha", "same", "lora_alpha", "read where `linear_alpha` is unset", special=True),
    _r("network", "dropout", "same", "lora_dropout", "null: none"),
    _r(
        "network",
        "lokr_factor",
        "approximated",
        "lycoris.factor",
        "with `type: lokr`; -1 (the default, config_modules.py:210-211): the divisor pair nearest the square root, as "
        "LyCORIS's -1 (lokr.py:46-61); a factor that divides a layer side and exceeds its square root sizes the "
        "Kronecker factor `w1` by the factor there (lokr.py:42-45), by side / factor here (LyCORIS puts the smaller "
        "first)",
        special=True,
    ),
    _r(
        "network",
        "lokr_full_rank",
        "approximated",
        None,
        "with `type: lokr`: full-rank LoKr blocks there (the default: rank and alpha set to 9999999999, "
        "config_modules.py:204-209); here `lycoris.full_matrix`",
        special=True,
    ),
    _r("network", "transformer_only", "ignored", None, "only the denoiser gets an adapter here"),
    _r("network", "split_multistage_loras", "ignored", None, "Wan 2.2 writes one adapter file per expert here"),
    # --- save ---
    _r(
        "save",
        "save_every",
        "approximated",
        "checkpointing_steps",
        "a resumable checkpoint every N optimizer steps "
        "(holding the adapter); ai-toolkit writes the adapter file and its optimizer state. Default 1000, written",
        special=True,
    ),
    _r("save", "max_step_saves_to_keep", "same", "checkpoints_total_limit", "default 5, written", special=True),
    _r(
        "save",
        "dtype",
        "approximated",
        None,
        "adapters are saved in their training precision (fp32) here; ai-toolkit casts the saved file to this dtype",
    ),
    _r(
        "save",
        "save_format",
        "same",
        None,
        "`safetensors` (the default); `diffusers` (a whole pipeline) stops",
        special=True,
    ),
    _r("save", "push_to_hub", "same", "push_to_hub"),
    _r("save", "hf_repo_id", "same", "hub_model_id"),
    _r("save", "hf_private", "same", "model_card_private", "default false there (true here), written", special=True),
    # --- datasets[] ---
    _r(
        "dataset",
        "folder_path",
        "same",
        "instance_data_dir",
        "a relative path from the working directory, as ai-toolkit reads it",
        special=True,
    ),
    _r(
        "dataset",
        "caption_ext",
        "same",
        "caption_strategy",
        "`txt`: each image's .txt file, whole (ai-toolkit's "
        "clean_caption keeps line breaks: `caption_strategy: textfile` with `disable_multiline_split: true`); "
        "another extension stops",
        special=True,
    ),
    _r(
        "dataset",
        "caption_dropout_rate",
        "same",
        "caption_dropout_probability",
        "the empty caption with this "
        "chance; one top-level probability here, so datasets that differ stop; 0 when `cache_text_embeddings` is on, "
        "as ai-toolkit then never drops (dataloader_mixins.py:403)",
        special=True,
    ),
    _r(
        "dataset",
        "shuffle_tokens",
        "approximated",
        "datasets[].caption_shuffle",
        "ai-toolkit shuffles the "
        "comma-separated tags anew at each use; here 8 shuffled copies of each caption are encoded once and one is "
        "drawn per use",
        special=True,
    ),
    _r(
        "dataset",
        "cache_latents_to_disk",
        "approximated",
        "cache_config.vae_cache_type",
        "latents are cached here whatever it says: `disk` (the default)",
        special=True,
    ),
    _r(
        "dataset",
        "cache_latents",
        "approximated",
        "cache_config.vae_cache_type",
        "latents are cached here whatever it says, on disk unless `cache_latents_to_disk` is false (then `memory`)",
        special=True,
    ),
    _r("dataset", "resolution", "approximated", "datasets[].resolution", _BUCKETS, special=True),
    _r(
        "dataset", "num_repeats", "same", "repeats", "N passes of the dataset per epoch: `repeats: N - 1`", special=True
    ),
    _r(
        "dataset",
        "num_frames",
        "approximated",
        "num_frames",
        "1: images; more: a video dataset of that many frames (ai-toolkit spreads them evenly over the whole clip "
        "with its default `shrink_video_to_frames`, config_modules.py:1059 and dataloader_mixins.py:563-566; here "
        "they are consecutive: set `frame_stride`)",
        special=True,
    ),
    _r(
        "dataset",
        "default_caption",
        "approximated",
        "instance_prompt",
        "the caption of an image whose caption file is missing or empty (dataloader_mixins.py:358-363)",
    ),
    _r(
        "dataset",
        "trigger_word",
        "approximated",
        "instance_prompt",
        "as the process's `trigger_word`, for this dataset",
        special=True,
    ),
    _r(
        "dataset",
        "control_path",
        "approximated",
        "conditioning_data_dir",
        "the source images of an edit model (Qwen-Image-Edit, Flux Kontext), paired by file name; one folder only",
        special=True,
    ),
    _r(
        "dataset",
        "cache_text_embeddings",
        "ignored",
        None,
        "text embeddings are always cached here (it also turns caption dropout off: see `caption_dropout_rate`)",
    ),
    _r("dataset", "buckets", "same", None, "aspect bucketing, always on here; `false` stops", special=True),
    _r(
        "dataset",
        "bucket_tolerance",
        "approximated",
        "aspect_bucket_alignment",
        "bucket sides are multiples of it; one top-level value here (default 64 both)",
        special=True,
    ),
    _r("dataset", "num_workers", "ignored", None, "`dataloader_num_workers` decodes images here"),
    _r("dataset", "cache_latents_num_workers", "ignored", None, "`dataloader_num_workers` decodes images here"),
    _r("dataset", "prefetch_factor", "ignored", None, "batches come from the latent cache"),
    _r(
        "dataset",
        "augmentations_cache_mode",
        "approximated",
        "augmentations_cache_mode",
        "the GH200 fork's key (seed 001, 4.1 and 4.3: `disable_cache`, `static`, `refresh_each_epoch`), not in stock "
        "ai-toolkit; here this trainer's own modes of that name, one top-level value for all datasets; the fork's "
        "code is not published, so what its modes do beyond the seed's words is not known",
        special=True,
    ),
    _r("dataset", "type", "same", None, "`image` (the default); another type stops", special=True),
    # --- train ---
    _r("train", "batch_size", "same", "train_batch_size", "default 1"),
    _r("train", "steps", "same", "max_train_steps", "default 1000, written", special=True),
    _r("train", "lr", "same", "learning_rate", "default 1e-6, written", special=True),
    _r("train", "unet_lr", "same", "learning_rate", "the denoiser's rate; default `lr`", special=True),
    _r("train", "text_encoder_lr", "same", "text_encoder_lr", "with `train_text_encoder`", special=True),
    _r(
        "train",
        "optimizer",
        "approximated",
        "optimizer",
        "`adamw` / `adam` (torch, eps 1e-6) and `adamw8bit` (bitsandbytes' AdamW8bit, eps 1e-6) are the class and "
        "arguments ai-toolkit builds (optimizer.py:70-71, 76-79); `prodigy` (eps 1e-6, lr 1.0 below 0.1 as there) "
        "differs in one step size per param group here; `automagic` is this trainer's own (the same defaults and "
        "sign rule; its first step, bias correction and stored lr differ: see its warning); `adafactor` is torch's "
        "(ai-toolkit's own steps by lr alone, torch's by "
        "min(lr, 1/sqrt(step)) times the parameter's RMS); each warns; other names stop",
        special=True,
    ),
    _r(
        "train",
        "optimizer_params",
        "same",
        "optimizer_config",
        "`weight_decay`, `betas`, `eps` become our keys; "
        "automagic's `lr_bump` / `min_lr` / `max_lr` and the GH200 fork's per-expert `high_noise_*` / `low_noise_*` "
        "become the top-level keys of the same names; the rest `optimizer_config`",
        special=True,
    ),
    _r(
        "train",
        "lr_scheduler",
        "approximated",
        "lr_scheduler",
        "`constant` (the default) is the same; `cosine` "
        "decays to 0 over the run as torch's CosineAnnealingLR does; other names and `lr_scheduler_params` stop",
        special=True,
    ),
    _r(
        "train",
        "gradient_accumulation_steps",
        "approximated",
        "gradient_accumulation_steps",
        "the legacy spelling: ai-toolkit then counts `steps` (and `save_every`, `sample_every`) in batches, one "
        "optimizer step every N of them (BaseSDTrainProcess.py:2604-2615, 2806); here `max_train_steps` counts "
        "optimizer steps, so the run sees N times the batches: write `gradient_accumulation` (the same there) or "
        "divide `steps` by N. -1 (a whole epoch) stops",
        special=True,
    ),
    _r("train", "gradient_accumulation", "same", "gradient_accumulation_steps", "the newer name", special=True),
    _r(
        "train", "gradient_checkpointing", "same", "gradient_checkpointing", "default true there, written", special=True
    ),
    _r(
        "train",
        "noise_scheduler",
        "same",
        None,
        "`flowmatch` for flow-matching families, `ddpm` for sd / sdxl (the "
        "family's own schedule here); the other one stops",
        special=True,
    ),
    _r(
        "train",
        "timestep_type",
        "same",
        "timestep_sampling",
        "flow families: `sigmoid` (the default) draws "
        "sigma = sigmoid(N(0, 1)), `linear` sigma uniform, both unshifted (`flow_shift: 1`); `shift` / `flux_shift` "
        "warn (the model's own shift here); `weighted`, `lognorm_blend`, `next_sample` and the step types stop",
        special=True,
    ),
    _r(
        "train",
        "content_or_style",
        "same",
        None,
        "`balanced` (the default): timesteps as `timestep_type` draws them; `content` / `style` (cubic sampling) stop",
        special=True,
    ),
    _r(
        "train",
        "dtype",
        "approximated",
        "mixed_precision",
        "the autocast precision here (adapters train in fp32); "
        "ai-toolkit also loads the frozen weights in it. Default fp32 (`no`)",
        special=True,
    ),
    _r(
        "train",
        "mixed_precision",
        "approximated",
        "mixed_precision",
        "the GH200 fork's key (seed 001, 10.3: `fp16` or `bf16`), not in stock ai-toolkit (its precision is "
        "`train.dtype`, config_modules.py:395); read here as our autocast precision, as `train.dtype` is",
        special=True,
    ),
    _r(
        "train",
        "ema_config",
        "approximated",
        "use_ema",
        "`use_ema`, `ema_decay` (default 0.999 there, config_modules.py:828, written); ai-toolkit's EMA uses the "
        "decay from the first step (its use_num_updates off: BaseSDTrainProcess.py:798-803, ema.py:117-124; "
        "`ema_warmup_steps: 1` here)",
        special=True,
    ),
    _r("train", "train_unet", "same", None, "true: the denoiser trains (always, here); false stops", special=True),
    _r(
        "train",
        "train_text_encoder",
        "approximated",
        "train_text_encoder",
        "sd / sdxl: a LoRA on the CLIP encoders' attention projections here",
    ),
    _r("train", "max_grad_norm", "same", "max_grad_norm", "clip the gradients' total norm; default 1.0 both"),
    _r(
        "train",
        "noise_offset",
        "approximated",
        "noise_offset",
        "sd / sdxl: on every step (`noise_offset_probability: 1`)",
        special=True,
    ),
    _r(
        "train",
        "min_snr_gamma",
        "approximated",
        "snr_gamma",
        "with `loss_weighting: min_snr` (sd / sdxl)",
        special=True,
    ),
    _r("train", "snr_gamma", "approximated", "snr_gamma", "with `loss_weighting: min_snr` (sd / sdxl)", special=True),
    _r(
        "train",
        "loss_type",
        "same",
        "loss_type",
        "`mse` (the default) is `l2`; `pseudo_huber` warns (huber); others stop",
        special=True,
    ),
    _r(
        "train",
        "skip_first_sample",
        "approximated",
        None,
        "validation here renders at the start, every `validation_steps` and at the end",
        special=True,
    ),
    _r("train", "disable_sampling", "same", None, "true: no validation prompts are written", special=True),
    _r(
        "train",
        "cache_text_embeddings",
        "ignored",
        None,
        "text embeddings are always cached here (it also turns caption dropout off: see `caption_dropout_rate`)",
        special=True,
    ),
    _r(
        "train",
        "unload_text_encoder",
        "approximated",
        None,
        "ai-toolkit then trains every image on the trigger word alone (SDTrainer.py:1679-1688): "
        "`caption_strategy: instance_prompt` here; without a trigger word (the empty prompt there) it stops; with "
        "`cache_text_embeddings` the captions train, as there (SDTrainer.py:1673-1677)",
        special=True,
    ),
    _r(
        "train",
        "switch_boundary_every",
        "approximated",
        None,
        "Wan 2.2 with both experts: ai-toolkit trains one "
        "expert at a time, switching every N steps, each on its own timesteps; here each sample goes to the expert "
        "its timestep belongs to",
        special=True,
    ),
    _r("train", "xformers", "ignored", None, "attention uses PyTorch's scaled_dot_product_attention"),
    _r("train", "sdp", "ignored", None, "attention uses PyTorch's scaled_dot_product_attention"),
    _r("train", "attention_backend", "ignored", None, "attention uses PyTorch's scaled_dot_product_attention"),
    # --- model ---
    _r(
        "model",
        "name_or_path",
        "same",
        "pretrained_model_name_or_path",
        "a local diffusers folder or a hub id",
        special=True,
    ),
    _r(
        "model",
        "arch",
        "same",
        "model_family",
        "flux, flex1, flux_kontext, sd1, sd2, sdxl, sd3, wan21, wan22_14b, "
        "wan22_5b, qwen_image, qwen_image_edit; others stop",
        special=True,
    ),
    *(
        _r("model", switch, "same", "model_family", "read where `arch` is unset", special=True)
        for switch in ("is_flux", "is_xl", "is_v3", "is_v2")
    ),
    _r(
        "model",
        "quantize",
        "approximated",
        "base_model_precision",
        "with `qtype` (default qfloat8, config_modules.py:685-687): the frozen weights through optimum-quanto "
        "(`float8` is torchao's float8 weight-only there, quantize.py:42-49, quanto's qfloat8 here); an "
        'accuracy-recovery adapter (`qtype: "uint4|..."`, config_modules.py:742-743) stops',
        special=True,
    ),
    _r("model", "qtype", "approximated", "base_model_precision", "read with `quantize`", special=True),
    _r("model", "quantize_te", "ignored", None, "text encoders run once, to fill the text cache"),
    _r("model", "qtype_te", "ignored", None, "text encoders run once, to fill the text cache"),
    _r(
        "model",
        "low_vram",
        "approximated",
        "low_vram",
        "idle parts wait in CPU memory here (the idle Wan 2.2 expert, encoders kept for validation)",
    ),
    _r(
        "model",
        "model_kwargs",
        "same",
        "train_stages",
        "Wan 2.2: `train_high_noise` / `train_low_noise` (default "
        "both, wan22_14b_model.py:196-197) pick `train_stages`; other keys stop",
        special=True,
    ),
    _r("model", "vae_path", "same", "pretrained_vae_model_name_or_path"),
    _r("model", "is_v_pred", "same", "prediction_type", "true: `v_prediction`", special=True),
    _r("model", "dtype", "ignored", None, "the frozen weights follow `mixed_precision` here"),
    _r("model", "extras_name_or_path", "same", None, "its default, `name_or_path`; another folder stops", special=True),
    # --- sample ---
    _r(
        "sample",
        "prompts",
        "same",
        "validation_prompts",
        "`[trigger]` becomes the trigger word; the text before the first `--` is the prompt and `--ctrl_img PATH` "
        "its `validation_image`; the other flags ai-toolkit reads (`--w`, `--seed`, `--n`...) stop",
        special=True,
    ),
    _r(
        "sample",
        "samples",
        "approximated",
        "validation_prompts",
        "each item's `prompt` (read as `prompts` are) and `ctrl_img` (`validation_image`); its other keys stop",
        special=True,
    ),
    _r("sample", "sample_every", "same", "validation_steps", "default 100, written", special=True),
    _r("sample", "sample_steps", "same", "validation_num_inference_steps", "default 20, written", special=True),
    _r("sample", "guidance_scale", "same", "validation_guidance_scale", "default 7, written", special=True),
    _r("sample", "width", "same", "validation_resolution", "with `height`, default 512x512, written", special=True),
    _r("sample", "height", "same", "validation_resolution", "with `width`", special=True),
    _r("sample", "neg", "same", "validation_negative_prompt", "empty or false: none", special=True),
    _r("sample", "seed", "same", "validation_seed", "default 0, written", special=True),
    _r(
        "sample",
        "walk_seed",
        "approximated",
        None,
        "ai-toolkit adds the prompt's index to the seed; here every prompt starts from `validation_seed`",
    ),
    _r("sample", "sampler", "ignored", None, "validation samples with the model's own scheduler"),
    _r(
        "sample",
        "num_frames",
        "same",
        "validation_num_video_frames",
        "video families; a count not of the form 4k+1 becomes the count ai-toolkit renders (40: 41 frames, 37 "
        "with `low_vram`, whose pipeline skips diffusers' rounding)",
        special=True,
    ),
    _r("sample", "fps", "ignored", None, "validation videos are saved at the family's frame rate"),
    _r("sample", "guidance_rescale", "same", "validation_guidance_rescale"),
    _r("sample", "sample_start_step", "ignored", None, "validation renders from the start"),
    _r("sample", "format", "ignored", None, "validation images are PNG"),
)


def tail_row(section: Section, key: str) -> Optional[AitKey]:
    """The row of a key ai-toolkit reads (``AIT_KEYS``) that the table does not name: unsupported, unless written
    at ai-toolkit's default (then ignored: :func:`is_tail_inert`)."""
    ait_section = "dataset" if section == "dataset" else section
    if key not in AIT_KEYS.get(ait_section, {}):
        return None
    default = ait_default(ait_section, key)
    at = f" (its default, {default!r}, does nothing)" if default not in (None, "<expr>") else ""
    return AitKey(section, key, "unsupported", None, f"not trained here: remove it{at}")


def is_tail_inert(section: Section, key: str, value: Any) -> bool:
    """A tail key written at its ai-toolkit default, or off (false, null, empty): it changes nothing."""
    default = ait_default(section, key)
    if value is None or value is False or value == [] or value == {} or value == "":
        return True
    return default is not None and value == default


def _table() -> tuple[AitKey, ...]:
    named = {(row.section, row.key) for row in _ROWS}
    tail = tuple(
        row
        for section in SECTIONS
        for key in AIT_KEYS.get(section, {})
        if (section, key) not in named and (row := tail_row(section, key)) is not None
    )
    return _ROWS + tail


#: Every key of an ai-toolkit trainer job this trainer knows, by section.
AIT_DIALECT: tuple[AitKey, ...] = _table()

_BY_KEY: dict[tuple[str, str], AitKey] = {(row.section, row.key): row for row in AIT_DIALECT}


def row_for(section: Section, key: str) -> Optional[AitKey]:
    """The table's row for ai-toolkit's ``key`` in ``section``."""
    return _BY_KEY.get((section, key))
