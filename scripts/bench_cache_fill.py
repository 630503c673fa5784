"""Cache fill throughput: one process vs two processes filling one cache folder together.

Writes the tiny SD model and ``--num-images`` shape images (with captions) once, then for each
setup and repeat starts fresh interpreters that run the trainer's start-up on an empty cache
folder (every latent and text embedding missing) and reports, for the slowest rank, the latent
fill (images decoded and encoded, shards written, the other ranks' shards indexed) and the whole
``caches`` phase (that plus loading the encoders, the text embeddings and the checks around
them). Setups, all on the same data:

- 1 process, OMP_NUM_THREADS=1 (the baseline for the speed-up),
- 1 process, OMP_NUM_THREADS=<cores> (what one process gets from intra-op threads),
- 2 processes through ``accelerate launch`` (gloo, CPU), OMP_NUM_THREADS=1 each.

    python scripts/bench_cache_fill.py [--num-images 512] [--size 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys
from simpletuner.configuration import load_config
from simpletuner.state import StateTracker
from simpletuner.training.trainer import Trainer
loaded = load_config(sys.argv[1])
trainer = Trainer(StateTracker(loaded.config, loaded.raw))
trainer.setup()
acc = trainer.accelerator
latents = trainer.data.fill_reports["latents"]
print("BENCH" + json.dumps({"rank": acc.process_index, **trainer.startup_seconds,
                            "fill": latents.seconds, "computed": latents.num_computed}), flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_inputs(root: Path, num_images: int, size: int) -> Path:
    """The tiny model, the images and a config (cache and output folders set per run); returns the config."""
    from simpletuner.testing.demo_data import write_demo, write_shapes_dataset

    config_path = write_demo(root, max_train_steps=1, num_images=1)
    config = json.loads(config_path.read_text())
    wide, tall = (size * 3 // 2, size), (size, size * 3 // 2)
    data = write_shapes_dataset(root / "fill_data", num_images=num_images, sizes=((size, size), wide, tall))
    config.update(
        resolution=size,
        validation_prompt=None,
        checkpointing_steps=None,
        resume_from_checkpoint=None,
        dataloader_num_workers=0,
    )
    config["datasets"][0]["instance_data_dir"] = str(data)
    path = root / "fill.json"
    path.write_text(json.dumps(config))
    return path


def run_once(config: Path, work: Path, num_processes: int, threads: int) -> dict:
    """One start-up on an empty cache folder: the longest rank's ``caches`` phase and latent fill
    (``FillReport.seconds``: from the fill's start until every rank has written its part and indexed
    the others'), and the entries computed."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    raw = json.loads(config.read_text())
    raw["cache_config"] = {"cache_dir": str(work / "cache")}
    raw["output_dir"] = str(work / "output")
    cfg = work / "cfg.json"
    cfg.write_text(json.dumps(raw))
    child = work / "child.py"
    child.write_text(CHILD)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", ACCELERATE_USE_CPU="1")
    if num_processes == 1:
        cmd = [sys.executable, str(child), str(cfg)]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
               str(num_processes), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(_free_port()), str(child), str(cfg)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    ranks = [json.loads(found) for found in re.findall(r"BENCH(\{[^{}]*\})", proc.stdout)]  # ranks may interleave
    assert len(ranks) == num_processes, proc.stdout
    return {
        "caches": max(r["caches"] for r in ranks),
        "fill": max(r["fill"] for r in ranks),
        "computed": ranks[0]["computed"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-images", type=int, default=512)
    parser.add_argument("--size", type=int, default=128, help="shorter image side and training resolution (px)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--root", type=Path, default=None, help="where model and data go (default: a temp folder)")
    args = parser.parse_args()
    root = args.root or Path(tempfile.mkdtemp(prefix="bench_fill_"))
    config = write_inputs(root, args.num_images, args.size)
    cores = os.cpu_count() or 1
    setups = [
        ("1 process, 1 thread", 1, 1),
        (f"1 process, {cores} threads", 1, cores),
        ("2 processes, 1 thread each", 2, 1),
    ]
    medians = {}
    for name, procs, threads in setups:
        runs = [run_once(config, root / "runs" / f"{procs}-{threads}-{r}", procs, threads) for r in range(args.repeats)]
        assert all(run["computed"] == args.num_images for run in runs), runs
        medians[name] = {key: statistics.median(run[key] for run in runs) for key in ("fill", "caches")}
        fills = ", ".join(f"{run['fill']:.2f}" for run in runs)
        print(f"{name}: latent fills {fills} s", file=sys.stderr)
    base = medians["1 process, 1 thread"]
    print(f"\n{platform.processor() or platform.machine()}, {cores} cores; {args.num_images} images of {args.size} px, "
          f"median of {args.repeats}\n")  # fmt: skip
    print("| setup | latent fill s | images/s | vs 1 process, 1 thread | whole `caches` phase s | vs 1 process |")
    print("|---|---|---|---|---|---|")
    for name, m in medians.items():
        print(
            f"| {name} | {m['fill']:.2f} | {args.num_images / m['fill']:.0f} | {base['fill'] / m['fill']:.2f}x "
            f"| {m['caches']:.2f} | {base['caches'] / m['caches']:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
