"""`python -m partial_fc_mx COMMAND ...`: the command line (cli/; see --help)."""

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
