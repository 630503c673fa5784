"""Watching the model train: sample images on the main process (:class:`Validator`), and a
repeatable loss on fixed batches (:class:`EvalLoss`)."""

from __future__ import annotations

import functools
import io
import logging
import os
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from PIL import Image

from simpletuner.configuration.families import NO_NEGATIVE_PROMPT_FAMILIES
from simpletuner.data_backend import BucketSampler
from simpletuner.data_backend.images import load_rgb
from simpletuner.diskspace import disk_full_guard, inject_fault
from simpletuner.faults import fault_point
from simpletuner.gh200.managed_weights import place_frozen_weights
from simpletuner.training import offload

logger = logging.getLogger(__name__)


def make_grid(rows: list[list[Image.Image]]) -> Image.Image:
    """One image of ``rows`` (one list of images per prompt), tiled without gaps.

    Every tile takes the size of the largest image (smaller ones sit at its top left on black),
    so the grid is ``columns * width`` by ``len(rows) * height`` pixels.
    """
    width = max(img.width for row in rows for img in row)
    height = max(img.height for row in rows for img in row)
    columns = max(len(row) for row in rows)
    grid = Image.new("RGB", (columns * width, len(rows) * height))
    for r, row in enumerate(rows):
        for c, img in enumerate(row):
            grid.paste(img.convert("RGB"), (c * width, r * height))
    return grid


def save_png(image: Image.Image, path: Path) -> None:
    """Write ``image`` as a PNG at ``path`` whole or not at all.

    Encoded in memory, written to a temp name beside ``path`` and renamed over it, so a failed
    write leaves no empty or truncated PNG under the final name. (PIL's own ``save(path)`` keeps a
    0-byte file when the disk fills, as a small image is buffered whole and the error surfaces on
    close.) A full disk ends as :class:`~simpletuner.diskspace.NoSpace` with the temp file removed.
    """
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    data = buffer.getvalue()
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with disk_full_guard(path.parent, len(data), f"validation image {path.name}", cleanup=[temp]):
        with open(temp, "wb") as f:
            f.write(data)
            inject_fault("validation_image")  # tests: a disk that fills during the write
        os.replace(temp, path)


@functools.cache
def tensorboard_can_write_video() -> bool:
    """Whether ``SummaryWriter.add_video`` can encode here: torch's encodes with moviepy 1.x's
    ``moviepy.editor`` (gone in moviepy 2) and, without it, prints a line and records a value with
    no video, which TensorBoard does not show. Warns once when it cannot."""
    try:
        from moviepy import editor  # noqa: F401
    except Exception:  # ImportError, or moviepy 1.x missing its own dependencies (imageio)
        logger.warning(
            "TensorBoard gets no validation videos: torch's SummaryWriter.add_video encodes them with moviepy 1.x "
            '(moviepy.editor), which cannot be imported here; install it with `pip install "moviepy<2"` to see '
            "them in TensorBoard. The clips are still saved beside the validation PNGs, and TensorBoard still gets "
            "their first frames"
        )
        return False
    return True


def _wandb_video(wandb, path: Path, frames: list[Image.Image], fps: int, caption: str):
    """A ``wandb.Video`` of a saved clip: the file itself when W&B takes its format (mp4, gif), else
    (animated .webp, which W&B does not play) the frames as a GIF in memory."""
    if path.suffix in (".mp4", ".gif"):
        return wandb.Video(str(path), caption=caption, fps=fps, format=path.suffix[1:])
    return wandb.Video(io.BytesIO(encode_video(frames, fps, "gif")), caption=caption, fps=fps, format="gif")


def _log_to_trackers(
    trackers,
    images: list[Image.Image],
    grid: Image.Image,
    prompts: list[str],
    step: int,
    tag: str = "",
    videos: Sequence[tuple[list[Image.Image], Path, str]] = (),
    fps: int = 16,
) -> None:
    """TensorBoard gets the single images (tag ``validation``) and the grid (``validation_grid``);
    W&B gets the grid (``validation_grid``, captioned with the prompts row by row). ``tag`` follows
    each name (``_WxH`` when validation renders several sizes).

    ``videos`` (a video family's clips: frames, saved file, caption) go to TensorBoard as one
    ``add_video`` (``validation_video``: a [N, T, C, H, W] uint8 batch, which TensorBoard tiles into
    one clip; only when :func:`tensorboard_can_write_video`) and to W&B as a list of ``wandb.Video``
    (``validation_video``, one per clip, captioned with its prompt), both at ``fps``.
    """
    import numpy as np

    for tracker in trackers:
        if tracker.name == "tensorboard":
            if len({img.size for img in images}) == 1:  # add_images needs one shape
                stacked = np.stack([np.asarray(img.convert("RGB")) for img in images])
                tracker.writer.add_images(f"validation{tag}", stacked, step, dataformats="NHWC")
            tracker.writer.add_image(f"validation_grid{tag}", np.asarray(grid), step, dataformats="HWC")
            shapes = {(len(frames), frames[0].size) for frames, _, _ in videos}
            if len(shapes) == 1 and tensorboard_can_write_video():  # one batch needs one shape
                clips = np.stack([np.stack([np.asarray(f.convert("RGB")) for f in frames]) for frames, _, _ in videos])
                batch = torch.from_numpy(clips).permute(0, 1, 4, 2, 3)  # [N, T, H, W, C] -> [N, T, C, H, W]
                tracker.writer.add_video(f"validation_video{tag}", batch, step, fps=fps)
        elif tracker.name == "wandb":
            import wandb

            caption = " | ".join(f"row {i}: {p}" for i, p in enumerate(prompts))
            logged = {f"validation_grid{tag}": wandb.Image(grid, caption=caption)}
            if videos:
                logged[f"validation_video{tag}"] = [
                    _wandb_video(wandb, path, frames, fps, caption) for frames, path, caption in videos
                ]
            tracker.log(logged, step=step)


#: Families whose sampling takes no negative prompt (Flux: guidance-distilled, no true CFG here).
NO_NEGATIVE_PROMPT = NO_NEGATIVE_PROMPT_FAMILIES


def pipeline_arguments(family: str, config, width: int, height: int) -> dict:
    """The keyword arguments of one validation call (the prompt and generator aside) for ``family``.

    A key the config leaves at its default is not passed, so an unchanged config makes the call it
    always made: ``negative_prompt`` (not for Flux), ``guidance_rescale`` (sd / sdxl; the config
    refuses it elsewhere) and ``num_frames`` (video families) only when set.
    """
    kwargs = {
        "num_images_per_prompt": config.num_validation_images,
        "num_inference_steps": config.validation_num_inference_steps,
        "guidance_scale": config.validation_guidance_scale,
        "height": height,
        "width": width,
    }
    if config.validation_negative_prompt is not None and family not in NO_NEGATIVE_PROMPT:
        kwargs["negative_prompt"] = config.validation_negative_prompt
    if config.validation_guidance_rescale:
        kwargs["guidance_rescale"] = config.validation_guidance_rescale
    if config.validation_num_video_frames not in (None, 1):
        kwargs["num_frames"] = config.validation_num_video_frames
    if config.t5_max_length is not None:  # sd3 only (a config rule): prompts encoded as in training
        kwargs["max_sequence_length"] = config.t5_max_length
    return kwargs


def _weight_variants(config, ema) -> list[tuple[str, Callable[[], AbstractContextManager[Any]]]]:
    """The weights each validation renders, as (file-name suffix, context that puts them in the
    model): the trained weights, the EMA's (``ema_only``), or both (``comparison``: EMA files end in ``_ema``)."""
    if ema is None or config.ema_validation == "none":
        return [("", nullcontext)]
    if config.ema_validation == "ema_only":
        return [("", ema.applied)]
    return [("", nullcontext), ("_ema", ema.applied)]


def _even_sides(frame: Image.Image):
    """``frame`` as an RGB array with even sides (H.264 in yuv420p halves the colour planes): an odd
    side grows by one pixel, a copy of the last row / column."""
    import numpy as np

    pixels = np.asarray(frame.convert("RGB"))
    height, width = pixels.shape[:2]
    return np.pad(pixels, ((0, height % 2), (0, width % 2), (0, 0)), mode="edge")


def encode_video(frames: list[Image.Image], fps: int, fmt: str) -> bytes:
    """``frames`` encoded as ``fmt``: ``mp4`` (H.264, yuv420p, through PyAV; odd sides padded by
    :func:`_even_sides`), ``webp`` (animated, Pillow) or ``gif`` (animated, Pillow); both animations
    loop forever and show each frame ``1000 / fps`` ms (a GIF counts in 10 ms units)."""
    buffer = io.BytesIO()
    if fmt == "mp4":
        import av

        arrays = [_even_sides(f) for f in frames]
        with av.open(buffer, mode="w", format="mp4") as container:
            stream = container.add_stream("h264", rate=fps)
            stream.height, stream.width = arrays[0].shape[:2]
            stream.pix_fmt = "yuv420p"
            if stream.codec_context.name == "libx264":
                stream.options = {"crf": "18"}  # near-transparent quality; x264's default (23) smears fine detail
            for array in arrays:
                container.mux(stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")))
            container.mux(stream.encode())  # flush the encoder
        return buffer.getvalue()
    first, *rest = [f.convert("RGB") for f in frames]
    options = {"quality": 90} if fmt == "webp" else {}
    first.save(
        buffer, format=fmt.upper(), save_all=True, append_images=rest, duration=round(1000 / fps), loop=0, **options
    )
    return buffer.getvalue()


@functools.cache
def video_format() -> str:
    """The format validation clips are saved in: ``mp4`` when PyAV (the ``video`` extra) can encode
    H.264 here, else ``webp`` when this Pillow writes animated WebP, else ``gif``. Probed once by
    encoding a 2-frame clip; a fallback is logged once, with what would give the better format."""
    probe = [Image.new("RGB", (16, 16), color) for color in ("black", "white")]
    try:
        encode_video(probe, 16, "mp4")
        return "mp4"
    except Exception as error:  # no PyAV, or a PyAV build without an H.264 encoder
        why = f"PyAV cannot encode H.264 here ({type(error).__name__}: {error})"
    try:
        animation = Image.open(io.BytesIO(encode_video(probe, 16, "webp")))
        if getattr(animation, "n_frames", 1) == 2:  # a still image (no animation support) has no n_frames
            logger.warning(
                "validation videos are saved as animated .webp: %s; for .mp4 install the video extra "
                '(`pip install -e ".[video]"`, or `pip install av`)',
                why,
            )
            return "webp"
    except Exception:  # a Pillow built without libwebp (or its animation support)
        pass
    logger.warning(
        "validation videos are saved as animated .gif: %s, and this Pillow cannot write animated WebP; for .mp4 "
        'install the video extra (`pip install -e ".[video]"`, or `pip install av`)',
        why,
    )
    return "gif"


def save_video(frames: list[Image.Image], path: Path, fps: int) -> Path:
    """Write ``frames`` beside ``path`` (its stem, the suffix of :func:`video_format`), whole or not
    at all (encoded in memory, written to a temp name, renamed); returns the file's path."""
    fmt = video_format()
    data = encode_video(frames, fps, fmt)
    path = path.with_suffix(f".{fmt}")
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with disk_full_guard(path.parent, len(data), f"validation video {path.name}", cleanup=[temp]):
        with open(temp, "wb") as f:
            f.write(data)
        os.replace(temp, path)
    return path


def validation_images(spec, config, datasets=()) -> list[Image.Image] | None:
    """The image each validation prompt renders from (one per prompt of ``config.validation_prompt_list``),
    or None when ``spec``'s model takes none: ``validation_image`` (one file for every prompt, or one per
    prompt); unset, an edit model's first training pair's source (said once in the log), an
    image-to-video model's sampler's own mid-grey frame (None).

    Raises:
        ValueError: a ``validation_image`` list whose length is neither 1 nor the number of prompts, or a file
            that is not a readable image.
    """
    if not spec.takes_validation_image:
        return None
    prompts = config.validation_prompt_list
    paths = config.validation_image
    if paths is None:
        if not spec.conditions_on_image:
            return None
        pairs = sorted((s.key, s.source) for ds in datasets for s in ds.samples if s.source is not None)
        if not pairs:
            return None
        logger.info(
            "validation edits the source image of the first training pair (%s, %s) for every prompt; set "
            "validation_image to choose another",
            pairs[0][0],
            pairs[0][1],
        )
        paths = [pairs[0][1]]
    paths = [paths] if isinstance(paths, str) else list(paths)
    if len(paths) not in (1, len(prompts)):
        raise ValueError(
            f"validation_image lists {len(paths)} images for {len(prompts)} validation prompts: give one image for "
            "every prompt, or one per prompt in the order of validation_prompt then validation_prompts"
        )
    images = []
    for path in paths:
        try:
            with open(Path(path).expanduser(), "rb") as handle:
                images.append(load_rgb(handle.read()))
        except (OSError, ValueError) as exc:
            raise ValueError(f"validation_image {path} cannot be read as an image ({exc}); give an image file") from exc
    return images * len(prompts) if len(images) == 1 else images


@torch.no_grad()
def generate_validation_images(  # noqa: PLR0913
    spec, denoiser, vae, text_encoders, config, step: int, out_dir: Path, trackers=(), ema=None, images=None
) -> list[Path]:
    """Render ``num_validation_images`` for each validation prompt at each validation size, save them as
    PNGs (``step_NNNNNN[_WxH]_K[_ema].png``) and one grid per size (a row per prompt), log them to
    ``trackers``, and return the PNGs' paths. File names, sizes, EMA variants and video clips are as
    documentation/CONFIG.md describes ``validation_prompts``, ``validation_resolution``, ``ema_validation``
    and ``validation_num_video_frames``.

    Each prompt's generator starts from ``validation_seed`` (else ``seed``), so every validation step starts
    from the same noise. ``ema``: the run's :class:`~simpletuner.training.ema.EMA`; ``images``
    (:func:`validation_images`): the image prompt ``p`` renders from, passed to the sampler as ``image``.
    """
    variants = _weight_variants(config, ema)
    rendered = _render(spec, denoiser, vae, text_encoders, config, variants, images)
    out_dir.mkdir(parents=True, exist_ok=True)
    is_video = config.validation_num_video_frames not in (None, 1)
    writer = _StepWriter(out_dir, step, config.validation_prompt_list, trackers, spec.video_fps, is_video)
    sizes = config.validation_sizes
    paths = []
    for size in sizes:
        tag = f"_{size[0]}x{size[1]}" if len(sizes) > 1 else ""
        paths += writer.save(tag, [(suffix, rendered[(suffix, size)]) for suffix, _ in variants])
    return paths


def _render(spec, denoiser, vae, text_encoders, config, variants, images) -> dict[tuple[str, tuple[int, int]], list]:
    """Every prompt's sampler output, by (weights' file-name suffix, size): one list of outputs per prompt.
    The denoiser samples in eval mode and is put back as it was."""
    prompts = config.validation_prompt_list
    seed = config.validation_seed if config.validation_seed is not None else config.seed
    was_training = denoiser.training
    denoiser.eval()
    rendered: dict[tuple[str, tuple[int, int]], list] = {}
    try:
        pipe = spec.build_pipeline(denoiser, vae, text_encoders)
        pipe.set_progress_bar_config(disable=True)
        for suffix, weights in variants:
            with weights():
                for width, height in config.validation_sizes:
                    kwargs = pipeline_arguments(spec.family, config, width, height)
                    outputs = []
                    for p, prompt in enumerate(prompts):
                        fault_point("validation:prompt")  # tests: a signal while a validation renders
                        # A generator of its own, so validation never shifts the training RNG streams.
                        generator = torch.Generator(device="cpu").manual_seed(seed)
                        image = {} if images is None else {"image": images[p]}
                        outputs.append(pipe(prompt, generator=generator, **kwargs, **image))
                    rendered[(suffix, (width, height))] = outputs
    finally:
        denoiser.train(was_training)
    return rendered


@dataclass
class _StepWriter:
    """Writes one validation step's renders, size by size: the PNGs, a video's clips, the grid, the trackers."""

    out_dir: Path
    step: int
    prompts: list[str]
    trackers: Any
    fps: int
    is_video: bool

    def save(self, tag: str, renders: list[tuple[str, list]]) -> list[Path]:
        """Save one size's outputs (``renders``: per weights' suffix, one output per prompt); returns the PNGs."""
        rows: list[list[Image.Image]] = [[] for _ in self.prompts]
        paths: list[Path] = []
        images: list[Image.Image] = []
        videos: list[tuple[list[Image.Image], Path, str]] = []  # (frames, file, caption) per clip
        for suffix, outputs in renders:
            k = 0
            for p, output in enumerate(outputs):
                rows[p] += output.images
                for i, image in enumerate(output.images):
                    path = self.out_dir / f"step_{self.step:06d}{tag}_{k}{suffix}.png"
                    save_png(image, path)
                    paths.append(path)
                    images.append(image)
                    clip = getattr(output, "frames", None)  # only a video pipeline's output has frames
                    if self.is_video and clip is not None:
                        frames = list(clip[i])
                        caption = self.prompts[p] + (" (EMA weights)" if suffix else "")
                        videos.append((frames, save_video(frames, path, self.fps), caption))
                    k += 1
        grid = make_grid(rows)
        grid_path = self.out_dir / f"step_{self.step:06d}{tag}_grid.png"
        save_png(grid, grid_path)
        _log_to_trackers(self.trackers, images, grid, self.prompts, self.step, tag, videos, self.fps)
        logger.info(
            "validation images for step %d%s: %s; grid (a row per prompt): %s%s",
            self.step,
            f" at {tag[1:]}" if tag else "",
            ", ".join(str(p) for p in paths),
            grid_path,
            f"; videos ({self.fps} fps): " + ", ".join(str(v[1]) for v in videos) if videos else "",
        )
        return paths


class Validator:
    """Rank 0's validation renders: the VAE and text encoders kept from the cache fill, and where
    they wait between renders (CPU RAM with ``low_vram``, else the training device)."""

    def __init__(self, spec, config, encoders, output_dir: Path, datasets=()):
        """``encoders`` (the cache fill's, with ``get_vae()`` / ``get_text()``) load what the fill did not;
        ``datasets`` give an edit model's default validation source (:func:`validation_images`)."""
        self.spec, self.config, self.output_dir = spec, config, output_dir
        self.images = validation_images(spec, config, datasets)
        self.vae, self.text_encoders = encoders.get_vae(), encoders.get_text()
        self.offloaded: tuple = ()  # low_vram: what waits in CPU RAM between validations
        # low_vram: in CPU RAM until a validation needs them (the VAE too, unless it re-encodes while training)
        if config.low_vram:
            reencodes = config.augmentations.is_enabled and config.augmentations_cache_mode != "static"
            self.offloaded = (self.text_encoders,) if reencodes else (self.vae, self.text_encoders)
            offload.to_device(self.offloaded, torch.device("cpu"))
        if config.gh200_optimizations.managed_memory == "frozen_weights":  # resident in CPU memory, read in place
            for module in offload.modules_of((self.vae, self.text_encoders)):
                place_frozen_weights(module)
        if config.validation_negative_prompt is not None and spec.family in NO_NEGATIVE_PROMPT:
            logger.warning(
                "validation_negative_prompt is ignored for model_family %r: its guidance-distilled sampling takes "
                "no negative prompt (remove the key to silence this)",
                spec.family,
            )

    def render(self, model, step: int, accelerator, ema=None) -> list[Path]:
        """Images of ``model`` (unwrapped) at ``step`` in ``output_dir/validation``; returns their paths.
        ``ema``: the run's EMA, rendered as ``ema_validation`` says."""
        device, idle = accelerator.device, self.spec.idle_modules(model)
        with offload.on_device_while(self.config.low_vram, device, self.offloaded, idle), accelerator.autocast():
            return generate_validation_images(
                self.spec,
                model,
                self.vae,
                self.text_encoders,
                self.config,
                step,
                self.output_dir / "validation",
                accelerator.trackers,
                ema=ema,
                images=self.images,
            )


class EvalLoss:
    """``eval_loss``: the mean loss over ``eval_iters`` fixed micro-batches, with the same noise and
    timesteps every time, averaged over the ranks."""

    def __init__(self, spec, data, samples, config, accelerator):
        """The batches come from a sampler of their own, so the training order is untouched."""
        self.spec, self.accelerator = spec, accelerator
        self.seed = config.seed + 104729 + accelerator.process_index
        rank = (accelerator.num_processes, accelerator.process_index)
        sampler = BucketSampler(samples, config.train_batch_size, *rank, config.seed + 1)
        batches = iter(sampler)
        self.batches = [
            data.batch(next(batches), accelerator.device) for _ in range(min(config.eval_iters, len(sampler)))
        ]

    @torch.no_grad()
    def __call__(self, model) -> float:
        acc = self.accelerator
        generator = torch.Generator().manual_seed(self.seed)
        model.eval()
        try:
            with acc.autocast():
                losses = [
                    self.spec.training_loss(model, b.latents, b.conditioning, generator).mean() for b in self.batches
                ]
        finally:
            model.train()
        local = torch.stack(losses).mean().reshape(1).to(acc.device)
        return acc.gather(local).mean().item()
