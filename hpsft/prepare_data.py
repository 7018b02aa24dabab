"""`python -m hpsft.prepare_data`: the command is hpsft/commands/prepare_data.py."""

import sys

from hpsft.commands.prepare_data import main

if __name__ == "__main__":
    sys.exit(main())
