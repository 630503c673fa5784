"""GH200 / GB10 diagnostic: versions, device, unified memory, host, environment (see --help).

The checkout's spelling of `simpletuner diagnose`: both run simpletuner.gh200.diagnostic.main,
with the same flags, output and exit codes.
"""

import sys

from simpletuner.gh200.diagnostic import main

sys.exit(main())
