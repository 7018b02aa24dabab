"""`python -m hpsft.prepare_model`: the command is hpsft/commands/prepare_model.py."""

import sys

from hpsft.commands.prepare_model import main

if __name__ == "__main__":
    sys.exit(main())
