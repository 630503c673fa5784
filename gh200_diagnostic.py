"""GH200 / GB10 diagnostic: versions, device, unified memory, host, environment (see --help)."""
import sys

from simpletuner.gh200.diagnostic import main

sys.exit(main())
