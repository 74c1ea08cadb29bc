"""Clients of a running daemon's control socket (no FUSE, trio or torch here)."""

from mxfs.client.control import ControlClient, ControlError

__all__ = ["ControlClient", "ControlError"]
