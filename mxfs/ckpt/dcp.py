"""A torch.distributed.checkpoint storage backend: DCP plans, mxfs files and commit.

`dcp.save(state, storage_writer=Writer(path))` has every rank write one
safetensors-compatible file into the checkpoint's hidden folder through the
direct path (staged into an aligned buffer, each range written to all members
at once as soon as it is staged, committed with checksums); `finish` on the
coordinator is the commit: it writes the manifest, holding DCP's metadata as
JSON (never pickle), and renames the folder into place.  `Reader` verifies
every block it reads.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import math
import os
import uuid
from collections import defaultdict
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as md
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from mxfs.ckpt import catalog
from mxfs.ckpt.catalog import CheckpointError
from mxfs.ckpt.host_buffer import ImageWindows
from mxfs.ckpt.image import dtype_named, plan
from mxfs.ckpt.reader import CheckpointCorrupt, read_ranges
from mxfs.ckpt.tree import flatten, unflatten
from mxfs.ckpt.writing import write_windows

log = logging.getLogger("mxfs.ckpt")

# Bytes of one file a load reads (and verifies) at once: it holds that much besides the
# state it fills (the whole file at once held a rank's shard twice).
READ_BATCH = 256 << 20
# Bytes of a file a save gathers at once (two such buffers: one filled, one written).
WINDOW = 64 << 20

# ---- DCP metadata <-> JSON -----------------------------------------------------------


def _index(i: md.MetadataIndex) -> list[Any]:
    return [i.fqn, list(i.offset) if i.offset is not None else None, i.index]


def _unindex(v: list[Any]) -> md.MetadataIndex:
    return md.MetadataIndex(v[0], torch.Size(v[1]) if v[1] is not None else None, v[2])


def _batches(reqs: list[Any], storage_data: dict[Any, Any]) -> list[list[Any]]:
    """`reqs` of one file in file order, in batches of about READ_BATCH bytes: a load
    holds one batch of the file besides the state it fills, not the whole file."""
    def where(r: Any) -> tuple[int, int]:
        d = storage_data[r.storage_index]
        return int(d["offset"]), int(d["length"])

    out: list[list[Any]] = []
    held = 0
    for r in sorted(reqs, key=where):
        n = where(r)[1]
        if not out or held + n > READ_BATCH:
            out.append([])
            held = 0
        out[-1].append(r)
        held += n
    return out


def _dtype(name: str) -> torch.dtype:
    return dtype_named(name, CheckpointCorrupt, "the DCP metadata")


def metadata_to_json(m: md.Metadata) -> dict[str, Any]:
    sd: dict[str, Any] = {}
    for fqn, item in m.state_dict_metadata.items():
        if isinstance(item, md.TensorStorageMetadata):
            sd[fqn] = {"kind": "tensor", "dtype": str(item.properties.dtype).removeprefix("torch."),
                       "requires_grad": item.properties.requires_grad, "size": list(item.size),
                       "chunks": [[list(c.offsets), list(c.sizes)] for c in item.chunks]}
        else:
            sd[fqn] = {"kind": "bytes"}
    storage = [[_index(k), v] for k, v in (m.storage_data or {}).items()]
    meta = m.storage_meta
    return {"state_dict": sd, "storage": storage, "version": m.version,
            "planner": flatten(m.planner_data)[0],
            "storage_meta": None if meta is None else {
                "checkpoint_id": str(meta.checkpoint_id) if meta.checkpoint_id else None,
                "save_id": meta.save_id, "load_id": meta.load_id,
                "modules": list(getattr(meta, "modules", []))}}


def metadata_from_json(j: dict[str, Any]) -> md.Metadata:
    sd: dict[str, md.STORAGE_TYPES] = {}
    for fqn, item in j["state_dict"].items():
        if item["kind"] == "tensor":
            props = md.TensorProperties(dtype=_dtype(item["dtype"]),
                                        requires_grad=bool(item["requires_grad"]))
            chunks = [md.ChunkStorageMetadata(torch.Size(o), torch.Size(s))
                      for o, s in item["chunks"]]
            sd[fqn] = md.TensorStorageMetadata(props, torch.Size(item["size"]), chunks)
        else:
            sd[fqn] = md.BytesStorageMetadata()
    sm = j.get("storage_meta")
    return md.Metadata(
        state_dict_metadata=sd,
        planner_data=unflatten(j["planner"], {}),
        storage_data={_unindex(k): v for k, v in j["storage"]},
        storage_meta=None if sm is None else md.StorageMeta(
            checkpoint_id=sm["checkpoint_id"], save_id=sm["save_id"], load_id=sm["load_id"],
            modules=sm.get("modules", [])),
        version=j.get("version"))


def _narrow(t: torch.Tensor, offsets: torch.Size, lengths: torch.Size) -> torch.Tensor:
    """The part of a stored chunk that a read asks for."""
    for dim, (off, n) in enumerate(zip(offsets, lengths, strict=True)):
        if (off, n) != (0, t.size(dim)):
            t = t.narrow(dim, off, n)
    return t


def _key(i: md.MetadataIndex) -> str:
    """A tensor's name in a rank file: its FQN, plus the chunk offsets of a shard."""
    return i.fqn if not i.offset else f"{i.fqn}@{','.join(map(str, i.offset))}"


# ---- writing --------------------------------------------------------------------------


class Writer(StorageWriter):
    """`dcp.save(..., storage_writer=Writer(path))`: DCP checkpoints on mxfs (or any folder)."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        super().__init__()
        self.path = os.path.abspath(path) if path is not None else None
        self.save_id = ""
        self.is_coordinator = False
        self.partial: catalog.Partial | None = None  # the coordinator's, then every rank's

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.path.abspath(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, str | os.PathLike)

    def storage_meta(self) -> md.StorageMeta | None:
        return md.StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.path is None:
            raise CheckpointError("no checkpoint path given",
                                  "pass Writer(path) or checkpoint_id=path")
        self.is_coordinator = is_coordinator
        if kwargs.get("use_collectives") is False and torch.distributed.is_available() \
                and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            # (each rank would plan alone: the coordinator published its own shard as
            # the whole checkpoint, without waiting for the others, and DCP loaded it
            # without a word, the other ranks' tensors left as they were)
            raise CheckpointError("a DCP save with use_collectives=False: each rank plans "
                                  "alone, and no rank knows the others' files",
                                  "save with use_collectives=True (the default)")
        if is_coordinator:
            if os.path.lexists(self.path):
                raise CheckpointError(f"checkpoint {self.path} already exists",
                                      "save under a new name, or remove it: mxfs ckpt rm PATH")
            self.partial = catalog.claim_partial(self.path)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Each rank's file gets its number here, where every plan is seen, and the folder
        # the coordinator made: each rank writes into that folder or fails.
        if any(not p.usable for p in plans):
            # (DCP's plan caching: a rank whose plan did not change finishes with the plan
            # of the first save, naming that save's folder, never this one's)
            if self.partial is not None:
                catalog.drop_partial(self.partial)
            raise CheckpointError("DCP's plan caching reuses an earlier save's plan, which "
                                  "names that save's folder",
                                  "save with DefaultSavePlanner(enable_plan_caching=False) "
                                  "(the default)")
        return [SavePlan(p.items, storage_data=(i, self.partial), planner_data=p.planner_data,
                         usable=p.usable)
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        assert self.path is not None
        rank, made = plan.storage_data
        assert isinstance(made, catalog.Partial)
        # The folder the coordinator made, found under this rank's path (another node
        # mounts the pool elsewhere) and checked to be it.
        partial = dataclasses.replace(made, path=catalog.partial_path(self.path))
        fname = f"rank-{int(rank):05}.safetensors"
        named: list[tuple[str, torch.Tensor]] = []
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                assert isinstance(data, io.BytesIO)
                raw = data.getvalue()
                named.append((_key(item.index), torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                              if raw else torch.empty(0, dtype=torch.uint8)))
            else:
                assert isinstance(data, torch.Tensor)
                named.append((_key(item.index), data.detach()))
        p = plan_file(named)
        # DCP keeps these tensors unchanged until write_data returns (its async_save hands
        # over its own staged copy): gathered a window at a time, not staged whole.
        folder = catalog.open_partial(partial)
        try:
            info = write_windows(os.path.join(partial.path, fname), p.size,
                                 ImageWindows(p, named).fill, WINDOW, folder)
        except BaseException:
            # The save cannot be published now: what its ranks wrote goes (a full pool
            # stayed full of them, and a save under the same name was refused while the
            # coordinator lived); a rank still writing there fails as this one did.
            catalog.drop_partial(partial)
            raise
        finally:
            os.close(folder)
        slots = {s.name: s for s in p.slots}
        results = []
        for n, item in enumerate(plan.items):
            s = slots[_key(item.index)]
            entry: dict[str, Any] = {"file": fname, **s.manifest()}
            if n == 0:
                entry["file_info"] = info
            results.append(WriteResult(index=item.index, size_in_bytes=s.nbytes,
                                       storage_data=entry))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: md.Metadata, results: list[list[WriteResult]]) -> None:
        """The commit: manifest with DCP's metadata, then the folder renamed into place."""
        assert self.path is not None
        files: dict[str, Any] = defaultdict(lambda: {"tensors": {}})
        storage: dict[md.MetadataIndex, Any] = {}
        for rank_results in results:
            for r in rank_results:
                d = dict(r.storage_data)
                f = files[d["file"]]
                if "file_info" in d:
                    f.update(d.pop("file_info"))
                f["tensors"][_key(r.index)] = {k: d[k] for k in ("dtype", "shape", "offset",
                                                                 "length")}
                storage[r.index] = d
        metadata.storage_data = storage
        manifest = catalog.new_manifest(dict(files), kind="dcp",
                                        dcp=metadata_to_json(metadata))
        assert self.partial is not None
        try:
            warning = catalog.publish(self.partial, self.path, manifest)
        except BaseException:  # (not published: its folder, with every rank's file, goes)
            catalog.drop_partial(self.partial)
            raise
        if warning is not None:  # (published: `latest` alone stayed as it was)
            log.warning("%s", warning)


def plan_file(named: list[tuple[str, torch.Tensor]]) -> Any:
    return plan(named, {"format": "pt", "mxfs": "dcp"})


# ---- reading --------------------------------------------------------------------------


class Reader(StorageReader):
    """`dcp.load(..., storage_reader=Reader(path))`: every block read is checksum-verified."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        super().__init__()
        self.path = os.path.abspath(path) if path is not None else None
        self.storage_data: dict[md.MetadataIndex, Any] = {}
        self.manifest: dict[str, Any] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.path.abspath(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, str | os.PathLike)

    def read_metadata(self, *args: Any, **kwargs: Any) -> md.Metadata:
        if self.path is None:
            raise CheckpointError("no checkpoint path given",
                                  "pass Reader(path) or checkpoint_id=path")
        self.manifest = catalog.read_manifest(self.path)
        if self.manifest.get("kind") != "dcp":
            raise CheckpointError(f"{self.path} was saved by mxfs.ckpt.save, not DCP",
                                  "load it with mxfs.ckpt.load(path)")
        try:
            return metadata_from_json(self.manifest["dcp"])
        except (KeyError, TypeError, ValueError, IndexError, RecursionError) as e:
            raise CheckpointCorrupt(f"{self.path}: DCP metadata in the manifest is damaged "
                                    f"({e})", "load an older checkpoint (mxfs ckpt ls)") from None

    def set_up_storage_reader(self, metadata: md.Metadata, is_coordinator: bool,
                              *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data
        if not self.manifest and self.path is not None:
            self.manifest = catalog.read_manifest(self.path)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self.path is not None
        per_file: dict[str, list[Any]] = defaultdict(list)
        for req in plan.items:
            try:  # (each entry's place checked before any is sorted or read by it)
                int(self._entry(req, "offset")), int(self._entry(req, "length"))
            except (TypeError, ValueError) as e:
                raise self._damaged(req, e) from None
            per_file[str(self._entry(req, "file"))].append(req)
        for fname, reqs in per_file.items():
            info = self.manifest["files"].get(fname)
            if info is None:  # (its names were checked: `catalog.read_manifest`)
                raise CheckpointCorrupt(f"{self.path}: DCP metadata names the file {fname!r}, "
                                        "which the manifest lacks",
                                        "load an older checkpoint (mxfs ckpt ls)")
            for some in _batches(reqs, self.storage_data):
                self._load(planner, os.path.join(self.path, fname), info, some)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _entry(self, req: Any, key: str) -> Any:
        """`key` of the manifest's storage entry of `req`; its lack is damage."""
        try:
            return self.storage_data[req.storage_index][key]
        except (KeyError, TypeError) as e:
            raise self._damaged(req, e) from None

    def _damaged(self, req: Any, e: BaseException) -> CheckpointCorrupt:
        return CheckpointCorrupt(f"{self.path}: the DCP entry of {req.storage_index.fqn} "
                                 f"in the manifest is damaged ({e})",
                                 "load an older checkpoint (mxfs ckpt ls)")

    def _load(self, planner: LoadPlanner, path: str, info: dict[str, Any],
              reqs: list[Any]) -> None:
        """Read `reqs`' ranges of one file (verified) and hand each to the planner."""
        fname = os.path.basename(path)
        wanted = [(int(self._entry(r, "offset")), int(self._entry(r, "length")))
                  for r in reqs]
        got = read_ranges(path, info, wanted)
        for req, raw in zip(reqs, got, strict=True):
            d = self.storage_data[req.storage_index]
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(bytes(raw.numpy())))
                continue
            try:  # (a shape or dtype the bytes do not fit: damaged, said in one line;
                # none read for a shape that holds some: uninitialised memory loaded)
                dtype, shape = _dtype(d["dtype"]), [int(n) for n in d["shape"]]
                if math.prod(shape) * dtype.itemsize != raw.numel():
                    raise ValueError(f"shape {shape} of {dtype} is not its {raw.numel()} "
                                     "bytes")
                t = raw.view(dtype).view(shape) if raw.numel() else \
                    torch.empty(shape, dtype=dtype)
                t = _narrow(t, req.storage_offsets, req.lengths)
            except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as e:
                raise self._damaged(req, e) from None
            target = planner.resolve_tensor(req).detach()
            if target.size() != t.size():
                raise CheckpointCorrupt(f"{fname}: {req.storage_index.fqn} has shape "
                                        f"{tuple(t.size())}, the plan wants "
                                        f"{tuple(target.size())}",
                                        "load with the state dict it was saved from")
            target.copy_(t)
            planner.commit_tensor(req, target)
