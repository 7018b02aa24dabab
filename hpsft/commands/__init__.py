"""The subcommands of `hpsft` (hpsft/cli.py), one module each with a thin main(argv) -> int;
what they do lives in the library (data/, models/, trainer/, ray/)."""

import argparse


def command_parser(prog: str, doc: str, **kwargs) -> argparse.ArgumentParser:
    """A subcommand's parser: its module docstring (usage lines, then what it does) as --help, as written."""
    return argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter,
                                   **kwargs)
