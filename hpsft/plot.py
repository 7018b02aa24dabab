"""`python -m hpsft.plot`: the command is hpsft/commands/plot.py."""

import sys

from hpsft.commands.plot import main

if __name__ == "__main__":
    sys.exit(main())
