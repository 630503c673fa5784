"""Trainer overhead per model family, and adapter file sizes, on the tiny zoo models.

For each family (sd, sdxl, sd3, flux, wan, Wan 2.2's two experts, Wan 2.2 I2V A14B and TI2V-5B, qwen_image,
Qwen-Image-Edit on edit pairs) this
builds the real Trainer on a small captioned dataset and compares, on the same prepared model, in one process:

- ours: the trainer's hot path, the batch read from the latent/text caches + ``Trainer.train_step``
  (window-normalised loss, clipping, non-finite check, scheduler, progress counters);
- minimal: a hand-written Accelerate loop over pre-read batches: the family's ``training_loss``,
  backward, clip, its own AdamW step.

The loss math is the same code in both, so the ratio measures the trainer's own overhead. Both
loops train on exactly the same batches, noise and timesteps (the sampler and the generator are
rewound between them); runs alternate, and alternate which goes first, so machine noise hits both
alike; medians of ``--repeats``. Target: ours >= 0.95x minimal. The adapter
sizes come from one ``Trainer.train()`` of ``max_train_steps: 2`` per family.

    python scripts/bench_family_overhead.py [--steps 40] [--repeats 5] [--families sd,flux]
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_trainer_overhead import run_ours  # noqa: E402  (the same "ours" loop as the sd-only bench)

from simpletuner.configuration import validate_config  # noqa: E402
from simpletuner.state import StateTracker  # noqa: E402
from simpletuner.testing.demo_data import write_edit_pairs, write_shapes_dataset  # noqa: E402
from simpletuner.testing.zoo import write_tiny_model  # noqa: E402
from simpletuner.training.trainer import Trainer  # noqa: E402

#: Benchmark name -> (zoo model, model_family). Wan 2.2 is the "wan" family on a two-expert folder.
FAMILIES = {
    "sd": ("sd", "sd"),
    "sdxl": ("sdxl", "sdxl"),
    "sd3": ("sd3", "sd3"),
    "flux": ("flux", "flux"),
    "wan": ("wan", "wan"),
    "wan22": ("wan22", "wan"),
    "wan22_i2v": ("wan22_i2v", "wan"),
    "wan22_ti2v": ("wan22_ti2v", "wan"),
    "qwen_image": ("qwen_image", "qwen_image"),
    "qwen_image_edit": ("qwen_image_edit", "qwen_image"),
}
#: Families that train on edit pairs (demo.write_edit_pairs) instead of the shapes dataset.
EDIT_PAIRS = {"qwen_image_edit"}
#: Config keys a benchmark needs beyond the shared ones (TI2V-5B's VAE is /16: buckets of 32 px).
EXTRA_CONFIG = {"wan22_ti2v": {"aspect_bucket_alignment": 32}}
TARGET = 0.95
WARMUP_STEPS = 5


@dataclass
class FamilyResult:
    """One family's runs (steps/s) and its saved adapter files (name -> bytes)."""

    name: str
    ours: list[float] = field(default_factory=list)
    minimal: list[float] = field(default_factory=list)
    adapters: dict[str, int] = field(default_factory=dict)
    num_trainable: int = 0

    @property
    def ratio(self) -> float:
        return statistics.median(self.ours) / statistics.median(self.minimal)


def make_raw(name: str, root: Path, data: Path, batch_size: int, max_train_steps: int, output: str) -> dict:
    """The family's config: the tests' settings (64 px, alignment 16, LoRA rank 16), no validation,
    no checkpoints; the model folder is written once under ``root``."""
    zoo, family = FAMILIES[name]
    model = root / name / "model"
    if not (model / "model_index.json").exists():
        write_tiny_model(zoo, model)
    return {
        "pretrained_model_name_or_path": str(model),
        "model_family": family,
        "output_dir": str(root / name / output),
        "resolution": 64,
        "aspect_bucket_alignment": 16,
        "train_batch_size": batch_size,
        "max_train_steps": max_train_steps,
        "learning_rate": 1e-3,
        "lr_scheduler": "constant",
        "lora_rank": 16,
        "logging_steps": max_train_steps,
        "checkpointing_steps": None,
        "validation_prompt": None,
        "seed": 123,
        "cache_config": {"cache_dir": str(root / name / "cache")},
        "datasets": [_dataset(name, root, data)],
        **EXTRA_CONFIG.get(name, {}),
    }


def _dataset(name: str, root: Path, data: Path) -> dict:
    """The shapes dataset, or for an edit model as many edit pairs of the shapes (written once under ``root``)."""
    if name not in EDIT_PAIRS:
        return {"id": "shapes", "type": "local", "instance_data_dir": str(data), "caption_strategy": "textfile"}
    num_images = len(list(data.glob("*.png")))
    images, sources = write_edit_pairs(root / "edit_pairs", num_pairs=num_images)
    return {"id": "edits", "type": "local", "instance_data_dir": str(images), "conditioning_data_dir": str(sources)}


def adapter_sizes(raw: dict) -> dict[str, int]:
    """Train ``raw`` through ``Trainer.train()`` (fills the caches too); bytes of each saved adapter."""
    trainer = Trainer(StateTracker(validate_config(raw), raw))
    result = trainer.train()
    out = result.output_path.parent
    return {p.name: p.stat().st_size for p in sorted(out.glob("*.safetensors"))}


class MinimalLoop:
    """A hand-written Accelerate loop on the trainer's prepared model, with its own AdamW. It draws noise
    and timesteps from the trainer's generator, which the benchmark rewinds between the two loops."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.acc = trainer.accelerator
        self.model = trainer.model
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = self.acc.prepare(torch.optim.AdamW(self.params, lr=trainer.config.learning_rate))

    def run(self, steps: int) -> float:
        trainer, acc, model, opt = self.trainer, self.acc, self.model, self.opt
        batches = trainer.data.iterate(trainer.sampler, acc.device)
        data = [next(batches) for _ in range(steps)]  # reading is not counted for the minimal loop
        pending = []
        start = time.perf_counter()
        for b in data:
            loss = trainer.spec.training_loss(model, b.latents, b.conditioning, trainer.generator).mean()
            acc.backward(loss)
            acc.clip_grad_norm_(self.params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            pending.append(loss.detach())
        torch.stack(pending).tolist()
        return steps / (time.perf_counter() - start)


def bench_family(name: str, root: Path, data: Path, args) -> FamilyResult:
    """Adapter sizes from a 2-step run, then alternating timed runs of both loops on one trainer."""
    result = FamilyResult(name)
    t0 = time.perf_counter()
    result.adapters = adapter_sizes(make_raw(name, root, data, args.batch_size, 2, "adapter"))
    total = 2 * (WARMUP_STEPS + args.repeats * args.steps)  # the scheduler's horizon covers every step
    raw = make_raw(name, root, data, args.batch_size, total, "bench")
    trainer = Trainer(StateTracker(validate_config(raw), raw))
    trainer.setup()
    result.num_trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    minimal = MinimalLoop(trainer)
    loops = {"ours": lambda n: run_ours(trainer, n), "minimal": minimal.run}
    for run in loops.values():  # warm-up
        run(WARMUP_STEPS)
    for i in range(args.repeats):
        order = ["ours", "minimal"] if i % 2 == 0 else ["minimal", "ours"]
        position, rng = trainer.sampler.state_dict(), trainer.generator.get_state()
        for j, which in enumerate(order):
            if j:  # the same batches, noise and timesteps (so the same Wan 2.2 experts) for both loops
                trainer.sampler.load_state_dict(position)
                trainer.generator.set_state(rng)
            getattr(result, which).append(loops[which](args.steps))
    print(
        f"{name}: {time.perf_counter() - t0:.0f}s, ours {_fmt(result.ours)}, minimal {_fmt(result.minimal)}",
        file=sys.stderr,
        flush=True,
    )
    return result


def _short(filename: str) -> str:
    """``pytorch_lora_weights_high_noise.safetensors`` -> ``high_noise``."""
    return filename.removesuffix(".safetensors").removeprefix("pytorch_lora_weights").lstrip("_") or filename


def _fmt(values: list[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


def machine() -> str:
    return (
        f"{platform.system()} {platform.machine()} ({platform.processor() or 'unknown CPU'}), "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}, torch {torch.__version__}, "
        f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, "
        f"device {'cuda: ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}"
    )


def report(results: list[FamilyResult], args, seconds: float) -> str:
    lines = [
        f"command: `python {' '.join([sys.argv[0], *sys.argv[1:]])}`",
        f"machine: {machine()}",
        f"LoRA rank 16, batch {args.batch_size}, 64 px, {args.steps} steps x {args.repeats} runs per loop, "
        f"median steps/s; total {seconds:.0f}s",
        "",
        f"| family | ours (steps/s) | minimal Accelerate loop (steps/s) | ratio | target >= {TARGET}x | "
        "trainable params | adapter file(s) (KB) |",
        "|---|---:|---:|---:|---|---:|---|",
    ]
    for r in results:
        named = len(r.adapters) > 1  # Wan 2.2: one file per expert
        files = ", ".join(f"{size / 1024:.1f}" + (f" ({_short(n)})" if named else "") for n, size in r.adapters.items())
        lines.append(
            f"| {r.name} | {statistics.median(r.ours):.1f} | {statistics.median(r.minimal):.1f} | "
            f"{r.ratio:.3f}x | {'met' if r.ratio >= TARGET else 'NOT met'} | {r.num_trainable:,} | {files} |"
        )
    lines.append("")
    lines += [f"all runs {r.name}: ours {_fmt(r.ours)}; minimal {_fmt(r.minimal)}" for r in results]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per run")
    parser.add_argument("--repeats", type=int, default=5, help="runs per loop (median reported)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument(
        "--families", default=",".join(FAMILIES), help=f"comma-separated subset of {', '.join(FAMILIES)}"
    )
    args = parser.parse_args()
    names = [n.strip() for n in args.families.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    logging.basicConfig(level=logging.WARNING)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = write_shapes_dataset(root / "data", num_images=24)
        results = [bench_family(name, root, data, args) for name in names]
    print(report(results, args, time.perf_counter() - start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
