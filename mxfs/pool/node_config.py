"""A reading node's pool config: what `mxfs node add` writes and `mxfs mount` reads.

A node that holds no member of the pool needs only the metadata server's URL, the pool
key (copied from the writer node) and a name of its own; the members are named by the
store and read through their owner's chunk service.  The file is a TOML pool config
like one listing members (`mountpoint` and `options` too), told apart by `node`:

    pool = "UUID"
    node = "gpu-07"
    meta = "postgresql://db/mxfs?host=..."
    key = "/etc/mxfs/models.key"      # root's, 0600
    state = "/var/lib/mxfs/models"    # this node's lock
    members = ["/srv/nvme0"]          # members of the pool it holds (mxfs node add --member)

Root's and 0600: the URL may carry what reaches the server.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tomllib
from dataclasses import dataclass, field
from typing import Any

from mxfs.errors import MxfsError
from mxfs.pool.safe_file import check_private_folder, write_new

NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")  # a node's name in its pool


@dataclass(frozen=True)
class NodeConfig:
    path: str
    pool: str
    node: str
    meta: str
    key: str
    state: str
    label: str = ""
    members: list[str] = field(default_factory=list)  # the folders of the members it holds


def read_node_config(path: str) -> NodeConfig | None:
    """The node config at `path`; None if it is a pool config of another kind (members)."""
    try:
        with open(path, "rb") as f:
            conf: dict[str, Any] = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return None  # (read_pool_config says what is wrong with it)
    if "node" not in conf:
        return None
    missing = [k for k in ("pool", "node", "meta", "key", "state")
               if not isinstance(conf.get(k), str) or not conf[k]]
    if missing:
        raise MxfsError(f"node config {path} lacks {', '.join(missing)}",
                        "write it again with mxfs node add")
    st = os.stat(path)
    if st.st_mode & 0o077 or st.st_uid != os.geteuid():
        raise MxfsError(f"node config {path} may be read by others "
                        f"(mode {stat.S_IMODE(st.st_mode):o}, uid {st.st_uid})",
                        f"chown root {path} && chmod 600 {path}")
    members = conf.get("members", [])
    if not isinstance(members, list) or not all(isinstance(m, str) for m in members):
        raise MxfsError(f"node config {path}: members is not a list of folders",
                        "write it again with mxfs node add")
    return NodeConfig(path, conf["pool"], conf["node"], conf["meta"], conf["key"],
                      conf["state"], str(conf.get("label", "")), members)


def write_node_config(conf: NodeConfig) -> None:
    """Write `conf` to its path, 0600, whole or not at all."""
    lines = [f"{k} = {json.dumps(getattr(conf, k))}"
             for k in ("pool", "label", "node", "meta", "key", "state", "members")]
    check_private_folder(os.path.dirname(conf.path) or ".", "the node's config")
    write_new(conf.path, ("\n".join(lines) + "\n").encode(), 0o600)
