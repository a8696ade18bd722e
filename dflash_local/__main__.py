"""`python -m dflash_local` runs the CLI."""

from .cli import main

main()
