"""GH200 / GB10 diagnostic: versions, device, unified memory, host, environment (see --help).

The checkout's spelling of `simpletuner diagnose`: both run simpletuner.cli.diagnose,
with the same flags, output and exit codes.
"""

import sys

from simpletuner.cli.diagnose import main

sys.exit(main())
