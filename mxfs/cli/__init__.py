"""The admin command line (`mxfs`)."""

from mxfs.cli.main import main

__all__ = ["main"]
