"""Start-up: seconds from the command to the first optimizer step with warm caches.

Runs a fresh interpreter per measurement (so imports are really paid), split into imports
(torch; accelerate, peft, transformers, diffusers; simpletuner),
the trainer's start-up phases (accelerator, datasets, cache check, model load, optimizer) and
the first step. Reports medians over several runs.

    python scripts/bench_startup.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import time, json, sys
t0 = time.perf_counter()
import torch, orjson
t_torch = time.perf_counter()
# The libraries the run needs, imported up front so "model" measures loading, not importing; in the
# order a run imports them: simpletuner.models first (it keeps unused torchao out, see library_probes).
try:
    import simpletuner.models.library_probes
except ImportError:  # a tree from before library_probes
    pass
import accelerate, peft, transformers
from diffusers import AutoencoderKL, UNet2DConditionModel, DDPMScheduler
t_libs = time.perf_counter()
from simpletuner.configuration import load_config
from simpletuner.state import StateTracker
from simpletuner.training.trainer import Trainer
t_imports = time.perf_counter()
loaded = load_config(sys.argv[1], ["validation_prompt=null", "checkpointing_steps=null", "max_train_steps=1"])
trainer = Trainer(StateTracker(loaded.config, loaded.raw))
trainer.setup()
batches = trainer.data.iterate(trainer.sampler, trainer.accelerator.device)
t_setup = time.perf_counter()
trainer.train_step([next(batches)]).loss.item()
t_step = time.perf_counter()
print("BENCH" + json.dumps({"imports_torch": t_torch - t0, "imports_libs": t_libs - t_torch,
                            "imports_simpletuner": t_imports - t_libs,
                            **trainer.startup_seconds, "first_step": t_step - t_setup,
                            "imports_total": t_imports - t0, "beyond_imports": t_step - t_imports,
                            "torchao_imported": float("torchao" in sys.modules)}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--threads",
        choices=("env", "run"),
        default="env",
        help="env: each run gets the caller's OMP_NUM_THREADS, else 1; run: none, so the run chooses its CPU threads",
    )
    args = parser.parse_args()
    # ROOT first, then the caller's PYTHONPATH (a site folder of carried wheels, say)
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(
        os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), HF_HUB_OFFLINE="1", PYTHONPATH=pythonpath
    )
    if args.threads == "run":  # as a user's shell: the run picks its count (simpletuner/training/cpu_threads.py)
        env.pop("OMP_NUM_THREADS")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        sys.path.insert(0, str(ROOT))
        from simpletuner.cli.demo import write_demo

        config = write_demo(Path(tmp))
        for i in range(args.repeats + 1):  # the first run fills the caches and is not counted
            out = subprocess.run(
                [sys.executable, "-c", CHILD, str(config)], capture_output=True, text=True, env=env, check=True
            )
            line = next(ln for ln in out.stdout.splitlines() if ln.startswith("BENCH"))
            if i:
                runs.append(json.loads(line[5:]))
    keys = list(runs[0])
    print(f"start-up with warm caches, tiny SD demo config, median of {args.repeats} fresh interpreters (seconds)")
    print("| " + " | ".join(keys) + " |")
    print("|" + "---:|" * len(keys))
    print("| " + " | ".join(f"{statistics.median(r[k] for r in runs):.2f}" for k in keys) + " |")
    print(
        f"machine: {platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, python {platform.python_version()}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
