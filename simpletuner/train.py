"""Entry file of ``accelerate launch simpletuner/train.py --config cfg.json`` and ``python -m simpletuner.train``:
runs ``simpletuner train`` (:mod:`simpletuner.cli.train`)."""

import os
import sys

if __name__ == "__main__":
    if __package__ in (None, ""):  # run as a script: its own folder would shadow packages; the root replaces it
        sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    from simpletuner.cli.train import end_process, main

    end_process(main())
