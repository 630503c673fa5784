"""The model card (README.md) an upload to the Hugging Face Hub carries: text only, built from the run's config.

:func:`model_card` returns the whole file: YAML metadata the Hub reads (``base_model`` when the base is a Hub id,
tags, ``pipeline_tag``, ``library_name``, a ``widget`` entry per validation image so the Hub shows the gallery),
then Markdown: what the weights are, the note, validation prompts and settings, training settings, datasets with
their instance prompts, and a diffusers snippet that loads the weights as they were saved (diffusers LoRA, LyCORIS
file, or full fine-tune folders; Wan 2.2's one file per expert). :class:`CardFacts` carries what the config does
not know: the repo, the resolved base model, the step, and the paths of the files the upload holds.
"""

from __future__ import annotations

import json
import posixpath
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from huggingface_hub import ModelCardData

from simpletuner.configuration.export_formats import export_format_of
from simpletuner.configuration.families import FAMILIES

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig

#: A Hub tag per model family (the names the Hub's own cards use for these families).
FAMILY_TAGS = {
    "sd": "stable-diffusion",
    "sdxl": "stable-diffusion-xl",
    "sd3": "sd3",
    "flux": "flux",
    "wan": "wan",
    "qwen_image": "qwen-image",
}
#: Wan 2.2's expert of a saved adapter file, read from its name (``models/wan22.py`` ``LORA_FILES``), and the
#: pipeline component it loads into.
EXPERT_FILE = re.compile(r"_(high|low)_noise\.safetensors$")
EXPERT_COMPONENTS = {"high": "transformer", "low": "transformer_2"}
#: Frames per second of a video family's clips (``ModelSpec.video_fps``).
VIDEO_FPS = 16
_TORCH_DTYPES = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "no": "torch.float32"}
_ALGO_NAMES = {"locon": "LoCon", "loha": "LoHa", "lokr": "LoKr"}
_PLACEHOLDER_BASE = "PATH/TO/BASE-MODEL"


@dataclass(frozen=True)
class CardFacts:
    """What the card says that the config does not hold. Paths are inside the repo, relative to the card's folder
    (the repo's root, or ``checkpoint-<step>/`` for a checkpoint's card), with ``/`` separators."""

    repo_id: str  # the full repo id "org/name" the card lives in
    base_model: str | None  # the base model's Hub id when the run loaded one (else None: a local folder)
    step: int  # optimizer steps trained
    num_processes: int
    weight_files: tuple[str, ...]  # the weights
    images: tuple[tuple[str, str], ...] = ()  # (path, prompt) of each validation PNG
    grid: str | None = None  # the validation grid (a row per prompt)
    ema_files: tuple[str, ...] = ()  # the EMA weights, when the run kept an EMA
    checkpoint: bool = False  # the card of checkpoint-<step>/ (step is the checkpoint's)

    @property
    def folder(self) -> str:
        """The card's folder in the repo: ``""`` (the root) or ``checkpoint-<step>``."""
        return f"checkpoint-{self.step}" if self.checkpoint else ""


def model_card(config: TrainingConfig, facts: CardFacts) -> str:
    """The README.md for ``facts.repo_id``: YAML front matter, then the Markdown card (module docstring)."""
    sections = [
        _intro(config, facts),
        _validation(config, facts),
        _training(config, facts),
        _datasets(config),
        _usage(config, facts),
        _ema(config, facts),
    ]
    body = "\n\n".join(s for s in sections if s)
    return f"---\n{_metadata(config, facts).to_yaml()}\n---\n\n{body}\n"


# --- metadata --------------------------------------------------------------------------------------------------
def pipeline_tag(config: TrainingConfig) -> str:
    """``text-to-video`` for a video family, else ``text-to-image``."""
    return "text-to-video" if FAMILIES[config.model_family].video else "text-to-image"


def card_tags(config: TrainingConfig) -> list[str]:
    """The card's tags: the libraries, the kind of weights, the family, the pipeline and the audience."""
    tags = ["diffusers", "simpletuner"]
    if config.training_type == "full":
        tags.append("full")
    elif config.lora_type == "lycoris":
        tags.append("lycoris")
    else:
        tags += ["lora", "template:sd-lora"]
    tags += [FAMILY_TAGS[config.model_family], pipeline_tag(config)]
    tags.append("safe-for-work" if config.model_card_safe_for_work else "not-for-all-audiences")
    return tags


def _metadata(config: TrainingConfig, facts: CardFacts) -> ModelCardData:
    extra: dict[str, Any] = {}
    if facts.base_model:
        extra["base_model_relation"] = "finetune" if config.training_type == "full" else "adapter"
    hub_datasets = sorted({d.dataset_name for d in config.datasets or () if d.type == "huggingface"})
    if facts.images:
        extra["widget"] = [{"text": prompt, "output": {"url": path}} for path, prompt in facts.images]
    return ModelCardData(
        base_model=facts.base_model or None,
        datasets=hub_datasets or None,
        library_name="diffusers",
        pipeline_tag=pipeline_tag(config),
        tags=card_tags(config),
        **extra,
    )


# --- Markdown ---------------------------------------------------------------------------------------------------
def _code(text: str) -> str:
    """``text`` as inline code on one line, fenced with more backticks than it holds."""
    flat = " ".join(text.split())
    longest = max((len(run) for run in re.findall(r"`+", flat)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if flat.startswith("`") or flat.endswith("`") or not flat else ""
    return f"{fence}{pad}{flat}{pad}{fence}"


def _py(value: Any) -> str:
    """``value`` as a Python literal: a string in double quotes (a JSON string is a Python one), else ``repr``."""
    return json.dumps(value, ensure_ascii=False) if isinstance(value, str) else repr(value)


def _link(path: str) -> str:
    return quote(path, safe="/")


def _what(config: TrainingConfig) -> str:
    if config.training_type == "full":
        return "A full fine-tune"
    if config.lora_type == "lycoris":
        return f"A LyCORIS {_ALGO_NAMES[config.lycoris.algo]} adapter"
    return "A DoRA adapter" if config.lora_use_dora else "A LoRA"


def _experts(files: tuple[str, ...]) -> list[str]:
    """Wan 2.2 experts (``high`` / ``low``) the files are for, as their names show; [] when none does."""
    return [m.group(1) for f in files if (m := EXPERT_FILE.search(posixpath.basename(f)))]


def _intro(config: TrainingConfig, facts: CardFacts) -> str:
    family = FAMILIES[config.model_family]
    base = f"[{facts.base_model}](https://huggingface.co/{facts.base_model})" if facts.base_model else "a local model"
    lines = [
        f"# {facts.repo_id}",
        "",
        f"{_what(config)} of {base} ({family.summary}; `model_family: {config.model_family}`) trained for "
        f"{facts.step} steps with simpletuner.",
    ]
    experts = _experts(facts.weight_files)
    if experts:
        named = " and ".join(f"the {e}-noise expert (`{EXPERT_COMPONENTS[e]}`)" for e in experts)
        lines += ["", f"Wan 2.2 has two experts; these weights are for {named}."]
    if facts.checkpoint:
        lines += [
            "",
            f"This folder is the run's checkpoint after {facts.step} steps; the run's final weights go to the "
            "repo's root.",
        ]
    triggers = trigger_words(config)
    if triggers:
        lines += ["", "Instance prompt (trigger): " + ", ".join(_code(t) for t in triggers)]
    if config.model_card_note:
        lines += ["", f"**Note:** {config.model_card_note}"]
    return "\n".join(lines)


def trigger_words(config: TrainingConfig) -> list[str]:
    """The datasets' instance prompts that are in their captions (the whole caption, or put before each), once
    each; an instance prompt that is only the fallback of missing caption files is not one."""
    found = [
        d.instance_prompt
        for d in config.datasets or ()
        if d.instance_prompt and (d.caption_strategy == "instance_prompt" or d.prepend_instance_prompt)
    ]
    return list(dict.fromkeys(found))


def call_arguments(config: TrainingConfig) -> dict[str, Any]:
    """The keyword arguments of the snippet's pipeline call (prompt and generator aside): those validation passes
    (``validation.pipeline_arguments``) at the first validation size, one image per prompt."""
    width, height = config.validation_sizes[0]
    kwargs: dict[str, Any] = {
        "num_inference_steps": config.validation_num_inference_steps,
        "guidance_scale": config.validation_guidance_scale,
        "height": height,
        "width": width,
    }
    if config.validation_negative_prompt is not None and FAMILIES[config.model_family].negative_prompt:
        kwargs["negative_prompt"] = config.validation_negative_prompt
    if config.validation_guidance_rescale:
        kwargs["guidance_rescale"] = config.validation_guidance_rescale
    if config.validation_num_video_frames not in (None, 1):
        kwargs["num_frames"] = config.validation_num_video_frames
    if config.t5_max_length is not None:
        kwargs["max_sequence_length"] = config.t5_max_length
    return kwargs


def _seed(config: TrainingConfig) -> int:
    return config.validation_seed if config.validation_seed is not None else config.seed


def _validation(config: TrainingConfig, facts: CardFacts) -> str:
    prompts = config.validation_prompt_list
    if not prompts and not facts.images:
        return "## Validation\n\nNo validation images were rendered during training."
    lines = ["## Validation", ""]
    if prompts:
        lines += ["Prompts (the grid's rows, in order):", "", *(f"- {_code(p)}" for p in prompts), "", "Settings:", ""]
    kwargs = call_arguments(config)
    sizes = ", ".join(f"{w}x{h}" for w, h in config.validation_sizes)
    lines += [
        f"- Guidance scale: {kwargs['guidance_scale']:g}",
        f"- Steps: {kwargs['num_inference_steps']}",
        f"- Seed: {_seed(config)}",
        f"- Size{'s' if len(config.validation_sizes) > 1 else ''}: {sizes}",
        f"- Images per prompt: {config.num_validation_images}",
    ]
    if "negative_prompt" in kwargs:
        lines.append(f"- Negative prompt: {_code(kwargs['negative_prompt'])}")
    if "guidance_rescale" in kwargs:
        lines.append(f"- Guidance rescale: {kwargs['guidance_rescale']:g}")
    if "num_frames" in kwargs:
        lines.append(f"- Frames: {kwargs['num_frames']}")
    if facts.grid:
        lines += ["", f"![Validation grid, a row per prompt]({_link(facts.grid)})"]
    if facts.images:
        lines += ["", "<Gallery />"]
    return "\n".join(lines)


def _training(config: TrainingConfig, facts: CardFacts) -> str:
    micro, accumulation = config.train_batch_size, config.gradient_accumulation_steps
    lr = (
        f"- Learning rate: {config.learning_rate:g}, `{config.lr_scheduler}` schedule, "
        f"{config.lr_warmup_steps} warm-up steps"
    )
    lines = ["## Training settings", "", f"- Steps: {facts.step}", lr]
    for expert in ("high", "low"):
        rate = getattr(config, f"{expert}_noise_learning_rate")
        if rate is not None:
            lines.append(f"  - {expert}-noise expert: {rate:g}")
    ramp = config.gh200_optimizations
    lines += [
        f"- Effective batch: {micro * accumulation * facts.num_processes} (micro-batch {micro} x gradient "
        f"accumulation {accumulation} x {facts.num_processes} process{'es' if facts.num_processes > 1 else ''})",
    ]
    if ramp.enable_batch_size_rampup:
        lines.append(
            f"  - ramped from {ramp.initial_effective_batch_size} to {ramp.target_effective_batch_size} over "
            f"{ramp.batch_rampup_steps} micro-batches"
        )
    optimizer = f"- Optimizer: {config.optimizer}"
    if config.optimizer_config:
        optimizer += f" ({_code(json.dumps(config.optimizer_config))})"
    lines += [optimizer, f"- Mixed precision: {config.mixed_precision}"]
    if config.base_model_precision != "no_change":
        lines.append(f"- Base model precision: {config.base_model_precision}")
    lines += _adapter_lines(config)
    lines.append(_text_encoder_line(config))
    lines += [
        f"- Resolution: {config.resolution}",
        f"- Caption dropout: {config.caption_dropout_probability:g}",
    ]
    if config.use_ema:
        lines.append(f"- EMA: decay {config.ema_decay:g}")
    return "\n".join(lines)


def _adapter_lines(config: TrainingConfig) -> list[str]:
    if config.training_type == "full":
        return ["- Training: every denoiser weight (full fine-tune)"]
    alpha = f"{config.effective_lora_alpha:g}"
    if config.lora_type == "lycoris":
        options = config.lycoris
        line = f"- LyCORIS: {options.algo}, rank {config.lora_rank}, alpha {alpha}"
        if options.algo == "lokr":
            line += f", factor {options.factor}"
        if options.conv_dim is not None:
            line += f", conv rank {options.conv_dim}"
        lines = [line]
    else:
        lines = [f"- LoRA: rank {config.lora_rank}, alpha {alpha}" + (", DoRA" if config.lora_use_dora else "")]
    if config.lora_type == "lycoris" and config.lycoris.apply_preset is not None:
        lines.append("- Targets: LyCORIS preset (`lycoris.apply_preset`)")
    elif config.lora_target_modules:
        lines.append("- Targets: " + ", ".join(_code(t) for t in config.lora_target_modules))
    else:
        lines.append("- Targets: the family's default (attention projections)")
    if config.lora_dropout:
        lines.append(f"- Dropout: {config.lora_dropout:g}")
    return lines


def _text_encoder_line(config: TrainingConfig) -> str:
    """Whether the text encoders were trained (SimpleTuner's cards say it too): with ``train_text_encoder`` the
    adapter file holds their LoRA, which the pipeline must load with the UNet's."""
    if not config.train_text_encoder:
        return "- Text encoders: not trained (the base model's are used as they are)"
    rate = config.text_encoder_lr if config.text_encoder_lr is not None else config.learning_rate
    return (
        f"- Text encoders: trained, a LoRA on each at learning rate {rate:g}; the adapter file holds it beside the "
        "UNet's and `load_lora_weights` loads both: without the trained text encoders, results differ"
    )


def _datasets(config: TrainingConfig) -> str:
    if not config.datasets:
        return ""
    lines = ["## Datasets", ""]
    for d in config.datasets:
        source = f"`{d.type}`"
        if d.type == "huggingface":
            source += f" ([{d.dataset_name}](https://huggingface.co/datasets/{d.dataset_name}), split `{d.split}`)"
        parts = [f"{d.dataset_type}s", f"captions: `{d.caption_strategy}`"]
        if d.instance_prompt:
            prepended = ", prepended to every caption" if d.prepend_instance_prompt else ""
            parts.append(f"instance prompt {_code(d.instance_prompt)}{prepended}")
        if d.repeats:
            parts.append(f"repeats {d.repeats}")
        if d.is_regularisation_data:
            parts.append("regularisation data")
        lines.append(f"- {_code(d.id)}: {source}, " + ", ".join(parts))
    return "\n".join(lines)


# --- the diffusers snippet --------------------------------------------------------------------------------------
def _repo_path(facts: CardFacts, path: str) -> tuple[str | None, str]:
    """(subfolder in the repo or None, file name) of ``path`` (relative to the card's folder)."""
    folder, name = posixpath.split(posixpath.join(facts.folder, path))
    return folder or None, name


def _denoiser(config: TrainingConfig) -> str:
    return "unet" if "unet" in FAMILIES[config.model_family].components else "transformer"


def adapter_lines(config: TrainingConfig, facts: CardFacts, files: tuple[str, ...]) -> list[str]:
    """The snippet's lines that put the weights ``files`` into ``pipe`` (after it is loaded)."""
    lines = []
    for path in files:
        folder, name = _repo_path(facts, path)
        expert = m.group(1) if (m := EXPERT_FILE.search(name)) else None
        target = EXPERT_COMPONENTS[expert] if expert else _denoiser(config)
        if config.lora_type == "lycoris":
            where = f"{folder}/{name}" if folder else name
            lines += [
                f"adapter = hf_hub_download(repo, {_py(where)})",
                f"network, _ = create_lycoris_from_weights(1.0, adapter, pipe.{target})",
                "network.merge_to()  # into the weights: the pipeline runs as fast as the base",
            ]
            continue
        args = ["repo", f"weight_name={_py(name)}"]
        if folder:
            args.append(f"subfolder={_py(folder)}")
        if expert:
            args.append(f"adapter_name={_py(expert)}")
        if expert == "low":
            args.append("load_into_transformer_2=True")
        lines.append(f"pipe.load_lora_weights({', '.join(args)})")
    return lines


def component_lines(config: TrainingConfig, facts: CardFacts, files: tuple[str, ...]) -> list[str]:
    """A full fine-tune's lines that load each saved component folder among ``files`` (``unet = ...``)."""
    found: dict[str, str] = {}
    for path in files:
        folder, _ = _repo_path(facts, path)
        if folder:
            found.setdefault(posixpath.basename(folder), folder)
    dtype = _TORCH_DTYPES[config.mixed_precision]
    return [
        f"{name} = AutoModel.from_pretrained(repo, subfolder={_py(folder)}, torch_dtype={dtype})"
        for name, folder in sorted(found.items())
    ]


def _prompt(config: TrainingConfig, facts: CardFacts) -> str:
    prompts = config.validation_prompt_list or [p for _, p in facts.images]
    if prompts:
        return prompts[0]
    triggers = [d.instance_prompt for d in config.datasets or () if d.instance_prompt]
    return triggers[0] if triggers else "a photo"


def diffusers_snippet(config: TrainingConfig, facts: CardFacts) -> str | None:
    """Python that loads the base model with the weights and renders the first validation prompt; None for a full
    fine-tune's checkpoint (resumable training state, not a diffusers folder)."""
    full = config.training_type == "full"
    if full and facts.checkpoint:
        return None
    dtype = _TORCH_DTYPES[config.mixed_precision]
    video = FAMILIES[config.model_family].video
    imports = [
        "import torch",
        "from diffusers import " + ("AutoModel, DiffusionPipeline" if full else "DiffusionPipeline"),
    ]
    if video:
        imports.append("from diffusers.utils import export_to_video")
    if not full and config.lora_type == "lycoris":
        imports += ["from huggingface_hub import hf_hub_download", "from lycoris import create_lycoris_from_weights"]
    if facts.base_model:
        base_line = f"base = {_py(facts.base_model)}  # the base model this was trained from"
    else:
        base_line = f"base = {_py(_PLACEHOLDER_BASE)}  # trained from a local folder: put its path (or Hub id) here"
    lines = [*imports, "", base_line, f"repo = {_py(facts.repo_id)}"]
    load_args = ["base"]
    if facts.base_model and config.revision:
        load_args.append(f"revision={_py(config.revision)}")
    if full:
        components = component_lines(config, facts, facts.weight_files)
        lines += components
        load_args += [f"{name}={name}" for name in (line.split(" = ", 1)[0] for line in components)]
    lines.append(f"pipe = DiffusionPipeline.from_pretrained({', '.join(load_args)}, torch_dtype={dtype})")
    if not full:  # the diffusers files: the kohya / ComfyUI copies beside them (output_formats) hold the same
        lines += adapter_lines(config, facts, tuple(f for f in facts.weight_files if export_format_of(f) is None))
    lines += [
        'pipe.to("cuda" if torch.cuda.is_available() else "cpu")',
        "",
        "result = pipe(",
        f"    {_py(_prompt(config, facts))},",
        *(f"    {key}={_py(value)}," for key, value in call_arguments(config).items()),
        f'    generator=torch.Generator("cpu").manual_seed({_seed(config)}),',
        ")",
    ]
    if video:
        lines += ["frames = result.frames[0]", f'export_to_video(frames, "output.mp4", fps={VIDEO_FPS})']
    else:
        lines += ["image = result.images[0]", 'image.save("output.png")']
    return "\n".join(lines)


def _usage(config: TrainingConfig, facts: CardFacts) -> str:
    files = ", ".join(_code(f) for f in facts.weight_files)
    snippet = diffusers_snippet(config, facts)
    if snippet is None:
        return (
            "## Use it\n\n"
            f"This checkpoint is a full fine-tune's resumable training state ({files}), not a diffusers folder: "
            "download the folder and set `resume_from_checkpoint` to it to continue training. The run's final "
            "weights are a diffusers folder at the repo's root."
        )
    lines = ["## Use it with diffusers", ""]
    if facts.weight_files:
        lines += [f"Weights: {files}.", ""]
    exports = [f for f in facts.weight_files if export_format_of(f) is not None]
    if exports:
        named = ", ".join(f"{_code(f)} ({export_format_of(f)})" for f in exports)
        lines += [f"The same adapter with the key names other tools load: {named}.", ""]
    if config.training_type != "full" and config.lora_type == "lycoris":
        lines += ["The adapter is in LyCORIS' own format: `pip install lycoris-lora` to apply it.", ""]
    lines += ["```python", snippet, "```"]
    return "\n".join(lines)


def _ema(config: TrainingConfig, facts: CardFacts) -> str:
    if not facts.ema_files:
        return ""
    files = ", ".join(_code(f) for f in facts.ema_files)
    lines = [
        "## EMA weights",
        "",
        f"The exponential moving average of the trained weights ({files}), in the same format. It is often "
        "smoother but less trained than the weights above.",
        "",
    ]
    if config.training_type == "full" and facts.checkpoint:
        return "\n".join(lines)
    if config.training_type == "full":
        changed = component_lines(config, facts, facts.ema_files)
    else:
        changed = adapter_lines(config, facts, facts.ema_files)
    lines += ["To use them, load them in the snippet instead:", "", "```python", *changed, "```"]
    return "\n".join(lines)
