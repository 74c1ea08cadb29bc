"""How a load moves bytes (`LoadOptions`) and what it did (`LoadReport`).

Options come from an engine's own loader config (vLLM's
`--model-loader-extra-config`) with environment variables as the fallback, so a
serving command line says everything and a plain script needs no code change:

  key        env               values
  mode       MXFS_LOAD_MODE    auto | map | read | stream | gds
  staging    MXFS_STAGING      bytes of host staging for stream mode ("64MiB" or 67108864)
  odirect    MXFS_ODIRECT      auto | always | never
  gds        MXFS_GDS          auto | off | force
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from mxfs.errors import MxfsError
from mxfs.load.staging import STAGING
from mxfs.units import parse_size

MODES = ("auto", "map", "read", "stream", "gds")
CHOICES: dict[str, tuple[str, ...]] = {"mode": MODES, "odirect": ("auto", "always", "never"),
                                       "gds": ("auto", "off", "force")}
ENV = {"mode": "MXFS_LOAD_MODE", "staging": "MXFS_STAGING", "odirect": "MXFS_ODIRECT",
       "gds": "MXFS_GDS"}


@dataclass(frozen=True)
class LoadOptions:
    """The knobs of one load; every value checked when the options are made."""

    mode: str = "auto"
    staging: int = STAGING
    odirect: str = "auto"
    gds: str = "auto"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LoadOptions:
        """Defaults, overridden by whichever MXFS_* variables are set."""
        env = os.environ if env is None else env
        given = {key: env[name] for key, name in ENV.items() if env.get(name)}
        return cls().merged(given, source="environment", names=ENV)

    def merged(self, given: Mapping[str, object], source: str = "options",
               names: Mapping[str, str] | None = None) -> LoadOptions:
        """These options with `given` on top; an unknown key or a bad value is one
        MxfsError naming it, where it came from and what it may be."""
        unknown = sorted(set(given) - set(ENV))
        if unknown:
            raise MxfsError(f"{source}: unknown mxfs load option(s) {', '.join(unknown)}",
                            f"the options are {', '.join(ENV)}")
        changes: dict[str, object] = {}
        for key, value in given.items():
            label = names[key] if names else key
            if key == "staging":
                changes[key] = _staging(value, f"{source}: {label}")
            elif value not in CHOICES[key]:
                raise MxfsError(f"{source}: {label}={value!r} is not a choice",
                                f"use one of {', '.join(CHOICES[key])}")
            else:
                changes[key] = value
        return replace(self, **changes)  # type: ignore[arg-type]


def _staging(value: object, label: str) -> int:
    """Staging bytes from an int or a size string; at least one 4 KiB page."""
    try:
        n = parse_size(value) if isinstance(value, str) else value
    except MxfsError:
        n = None
    if isinstance(n, bool) or not isinstance(n, int) or n < 4096:
        raise MxfsError(f"{label}={value!r} is not a staging size",
                        "give bytes of at least 4096, as a number or like '64MiB'")
    return n


@dataclass
class FileLoad:
    """One file of a load: its data bytes, how they moved, why not by GDS."""

    path: str
    nbytes: int
    mode: str
    gds_why_not: str | None = None


@dataclass
class LoadReport:
    """What a load did, file by file, for one summary line in an engine's log."""

    files: list[FileLoad] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    def path_taken(self) -> str:
        """The modes used ("map", "stream+gds" ...) and each reason GDS was not used."""
        modes = sorted({f.mode for f in self.files}) or ["nothing"]
        why = sorted({f.gds_why_not for f in self.files if f.gds_why_not})
        return "+".join(modes) + (f" (GDS not used: {'; '.join(why)})" if why else "")

    def summary(self, seconds: float) -> str:
        gb = self.nbytes / 1e9
        return (f"{gb:.2f} GB in {seconds:.2f} s ({gb / max(seconds, 1e-9):.2f} GB/s), "
                f"{len(self.files)} file(s), path {self.path_taken()}")
