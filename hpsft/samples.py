"""`python -m hpsft.samples`: the command is hpsft/commands/samples.py."""

import sys

from hpsft.commands.samples import main

if __name__ == "__main__":
    sys.exit(main())
