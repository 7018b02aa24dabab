"""`python -m hpsft.train_ray`: the command is hpsft/commands/train_ray.py."""

import sys

from hpsft.commands.train_ray import main

if __name__ == "__main__":
    sys.exit(main())
