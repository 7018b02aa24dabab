"""`python -m hpsft.inspect_data`: the command is hpsft/commands/inspect_data.py."""

import sys

from hpsft.commands.inspect_data import main

if __name__ == "__main__":
    sys.exit(main())
