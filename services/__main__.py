"""`python -m services node ...` is `moemesh node ...`: one command line (orchestrator/cli.py),
reachable where the `moemesh` script is not installed."""

import sys

from orchestrator.cli import main

sys.exit(main(sys.argv[1:]))
