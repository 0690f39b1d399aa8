"""The ``akv`` command line (outside the library's import graph: nothing in akv imports it)."""

from akv.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
