"""The subcommands of `hpsft` (hpsft/cli.py), one module each with a thin main(argv) -> int;
what they do lives in the library (data/, models/, trainer/, ray/)."""
