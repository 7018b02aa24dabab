"""`python -m hpsft.generate`: the command is hpsft/commands/generate.py."""

import sys

from hpsft.commands.generate import main

if __name__ == "__main__":
    sys.exit(main())
