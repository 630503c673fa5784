"""Memory planning: hardware detection, the peak-FLOPS table, MFU (and the estimator beside them).

- :mod:`.hardware`: ``detect_hardware``, ``HardwareInfo``, ``GPU_SPECS`` / ``GpuSpec``,
  ``lookup_gpu``, ``resolve_gpu_name``, ``hardware_for_gpu``, ``mfu``, ``achieved_tflops``.
- :mod:`.autoconfig`: ``plan_batch`` (largest micro-batch that fits, accumulation for the
  effective batch), ``EstimateCache``, ``Plan``, ``DoesNotFit``.
- :mod:`.advice`: what dominates a config that does not fit, and the switches that would help.
- :mod:`.presets`: ``load_preset`` / ``load_presets`` (``config/presets/*.json``), ``Preset``,
  ``apply_preset`` (merge one into a raw config: the config's keys win).
- :mod:`.apply`: ``apply_updates`` (write keys into a JSON config: backup, atomic, diff).
- :mod:`.profile`: ``profile_training`` (real steps on a GPU vs the estimate).
- :mod:`.estimator`, :mod:`.measure`: the estimate and its check against a real CPU step;
  :mod:`.report`: one ``estimate`` result, rendered as text or JSON; :mod:`.preflight`,
  :mod:`.oom`: the trainer's two questions (does the run fit; what to say after an OOM).
- :mod:`.cli` (``simpletuner estimate``'s options) and :mod:`.estimate_command` (its work).

Import the module you need (``from simpletuner.memory.hardware import detect_hardware``): this
package imports none of them, so ``simpletuner estimate --help`` loads no torch.
"""
