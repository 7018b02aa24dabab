"""`python -m hpsft.train`: the command is hpsft/commands/train.py."""

import sys

from hpsft.commands.train import main

if __name__ == "__main__":
    sys.exit(main())
