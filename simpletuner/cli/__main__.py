"""``python -m simpletuner.cli``: the ``simpletuner`` command."""

import sys

from simpletuner.cli import main

sys.exit(main(sys.argv[1:]))
