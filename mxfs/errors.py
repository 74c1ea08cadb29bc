"""Errors a user can cause: one line that names the problem and the fix."""

from __future__ import annotations


class MxfsError(Exception):
    """A problem the user can fix; the CLI prints it as one line and exits non-zero."""

    exit_code = 1

    def __init__(self, problem: str, fix: str | None = None) -> None:
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem}: {fix}" if fix else problem)


class UsageError(MxfsError):
    """A wrong flag or argument (exit code 2, like argparse)."""

    exit_code = 2
