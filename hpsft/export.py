"""`python -m hpsft.export`: the command is hpsft/commands/export.py."""

import sys

from hpsft.commands.export import main

if __name__ == "__main__":
    sys.exit(main())
