"""What machine this is: host and device facts, read once here for training, memory, gh200 and the commands.

- :mod:`.host`: CPU counts, RAM from ``/proc/meminfo``, CPU-less NUMA nodes, whether an NVIDIA GPU is present.
- :mod:`.gpus`: the GPU table (datasheet memory, dense peak FLOPS, sources), name lookup, MFU arithmetic.
- :mod:`.machine`: ``HardwareInfo``, ``detect_hardware`` (this machine), ``hardware_for_gpu`` (a
  hypothetical one for ``estimate --gpu``), ``collect_device`` (the device section of ``diagnose``).

Import the module you need; this package imports none of them, so reading the host stays light.
"""
