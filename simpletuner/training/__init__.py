"""The training loop and what it is built from.

- :mod:`.trainer`: ``Trainer`` (``setup()``'s builders, ``train()``, ``train_step()``); :mod:`.progress`:
  the counters, ``StepOutcome`` and the non-finite policy; :mod:`.accumulation`: the window policy.
- :mod:`.batches`: batches served from the caches; :mod:`.optim` and :mod:`.optimizers`: optimizers and
  schedules; :mod:`.ema`; :mod:`.offload` (``low_vram``); :mod:`.knobs` (TF32, allocator, compile);
  :mod:`.cpu_threads`.
- :mod:`.checkpoint` (``Checkpointer``, resume), :mod:`.checkpoint_verify`, :mod:`.sharded_state` (FSDP2),
  :mod:`.rng`, :mod:`.run_identity`, :mod:`.run_folder` (one output_dir, one run).
- :mod:`.launch` (process checks, the Accelerator), :mod:`.reliability` (signals, OOM), :mod:`.runlog` and
  :mod:`.metrics` (what a run logs), :mod:`.validation` (sample images, eval loss).
- :mod:`.publish` (Hub uploads: ``push_to_hub``, ``simpletuner push``) and :mod:`.model_card` (the card's text).
"""
