"""The `ssdlocal` command line (Typer): wiring from options to library calls.

The entry point is `ssdlocal.cli.app:main`.
"""
