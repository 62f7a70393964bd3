"""Checkpoint files that load without executing code: ``torch.distributed.checkpoint`` with JSON metadata.

``torch.distributed.checkpoint`` (DCP) does the distributed work: each rank writes the pieces it holds
(replicated pieces once), and a load reads whatever pieces the loading program's placements need, so a
checkpoint saved under one plan or mesh loads under another. Its stock file format, though, unpickles
on load (the ``.metadata`` file, and ``torch.load(weights_only=False)`` for non-tensor values). The
storage here keeps DCP's planning and replaces the format:

- ``.metadata.json``: what DCP's ``Metadata`` holds (every tensor's dtype, size and chunks; where each
  chunk lies), as JSON;
- ``rank<i>.bin``: the raw bytes of rank i's chunks, back to back, and non-tensor values (a step
  count, an LR scheduler's state, hyperparameters) as JSON text.

``save(state, path)`` / ``load(state, path)`` are ``dcp.save`` / ``dcp.load`` with this storage and
its planners; ``load`` fills ``state`` in place, like ``dcp.load``. Values must be tensors (DTensors
included) or JSON-able (None, bool, numbers, strings, and lists, tuples and string-keyed dicts of
them); anything else is a ``CheckpointError`` at save time naming the key.

>>> save({"model": cm.state_dict(), "optim": cm.optimizer_state_dict(opt), "step": 100}, "ckpt/100")   # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import numbers
import os
import uuid
import warnings
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from autoshard.passes.errors import CheckpointError

__all__ = ["save", "load", "JsonFileWriter", "JsonFileReader", "JsonSavePlanner", "JsonLoadPlanner",
           "METADATA_FILE", "encode_value", "decode_value"]

METADATA_FILE = ".metadata.json"
FORMAT = "autoshard.checkpoint"
VERSION = 1
_TUPLE, _DICT = "__tuple__", "__dict__"
PathLike = Union[str, os.PathLike]


# ---- non-tensor values as JSON -------------------------------------------------------------------

def encode_value(value: Any, where: str = "value") -> Any:
    """``value`` as JSON data (tuples tagged, so they come back as tuples); CheckpointError otherwise."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, tuple):
        return {_TUPLE: [encode_value(v, where) for v in value]}
    if isinstance(value, list):
        return [encode_value(v, where) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        body = {k: encode_value(v, f"{where}.{k}") for k, v in value.items()}
        return {_DICT: body} if _TUPLE in value or _DICT in value else body
    raise CheckpointError(f"{where} is a {type(value).__name__}; a checkpoint holds tensors and JSON-able values "
                          "(None, bool, numbers, strings, and lists, tuples and string-keyed dicts of them) so that "
                          "loading it runs no code: convert it (e.g. a state_dict()) or leave it out")


def decode_value(data: Any) -> Any:
    if isinstance(data, list):
        return [decode_value(v) for v in data]
    if isinstance(data, dict):
        if set(data) == {_TUPLE}:
            return tuple(decode_value(v) for v in data[_TUPLE])
        if set(data) == {_DICT}:
            data = data[_DICT]
        return {k: decode_value(v) for k, v in data.items()}
    return data


def _check_storable(state: Any, where: str = "state") -> None:
    """Walk ``state`` as DCP flattens it; every leaf must be a tensor or encode as JSON."""
    if isinstance(state, torch.Tensor):
        return
    if isinstance(state, dict):
        for k, v in state.items():
            _check_storable(v, f"{where}[{k!r}]")
        return
    if isinstance(state, list) and any(isinstance(v, (torch.Tensor, dict, list)) for v in state):
        for i, v in enumerate(state):
            _check_storable(v, f"{where}[{i}]")
        return
    encode_value(state, where)


# ---- planners: non-tensor values as JSON instead of torch.save --------------------------------------

class JsonSavePlanner(dcp.DefaultSavePlanner):
    """DCP's default save planner, writing non-tensor values as JSON text instead of pickling them."""

    def transform_object(self, write_item, object: Any):
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(json.dumps(encode_value(object, write_item.index.fqn)).encode("utf-8"))
        return object


class JsonLoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values back from JSON (never unpickling)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = decode_value(json.loads(value.read().decode("utf-8")))
        if self.flatten_state_dict:
            _set_path(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _set_path(root: Any, path: tuple, value: Any) -> None:
    """``root[path[0]][path[1]]... = value``, creating the dicts and lists on the way."""
    cur = root
    for key, nxt in zip(path[:-1], path[1:]):
        if isinstance(cur, list):
            cur.extend([None] * (key + 1 - len(cur)))
            if cur[key] is None:
                cur[key] = [] if isinstance(nxt, int) else {}
            cur = cur[key]
        else:
            cur = cur.setdefault(key, [] if isinstance(nxt, int) else {})
    last = path[-1]
    if isinstance(cur, list):
        cur.extend([None] * (last + 1 - len(cur)))
    cur[last] = value


# ---- storage --------------------------------------------------------------------------------------

def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise CheckpointError(f"checkpoint names dtype {name!r}, which is no torch dtype; the metadata is damaged")
    return value


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class JsonFileWriter(StorageWriter):
    """Writes a checkpoint directory: ``rank<i>.bin`` per rank and ``.metadata.json`` (see the module
    docstring). ``sync_files``: fsync each file."""

    def __init__(self, path: PathLike, sync_files: bool = True):
        super().__init__()
        self.path, self.sync_files = str(path), sync_files
        self.save_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: Optional[PathLike] = None) -> None:
        if checkpoint_id:
            self.path = str(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan):
        os.makedirs(self.path, exist_ok=True)
        return plan

    def prepare_global_plan(self, plans: list) -> list:
        return [dataclasses.replace(p, storage_data=f"rank{i}.bin") for i, p in enumerate(plans)]

    def write_data(self, plan, planner) -> Future:
        file = plan.storage_data
        results = []
        with open(os.path.join(self.path, file), "wb") as f:
            for item in plan.items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    raw, extra = data.getvalue(), {}
                else:
                    raw = _tensor_bytes(data)
                    extra = {"dtype": _dtype_name(data.dtype), "shape": list(data.shape)}
                pos = f.tell()
                f.write(raw)
                results.append(WriteResult(index=item.index, size_in_bytes=len(raw),
                                           storage_data={"file": file, "pos": pos, "length": len(raw), **extra}))
            if self.sync_files:
                f.flush()
                os.fsync(f.fileno())
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list) -> None:
        storage = [{"fqn": wr.index.fqn, "offset": None if wr.index.offset is None else list(wr.index.offset),
                    "index": wr.index.index, **wr.storage_data} for rank in results for wr in rank]
        tensors, byte_values = {}, []
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                tensors[fqn] = {"dtype": _dtype_name(md.properties.dtype), "size": list(md.size),
                                "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks]}
            else:
                byte_values.append(fqn)
        planner_data = metadata.planner_data
        doc = {"format": FORMAT, "version": VERSION, "dcp_version": metadata.version, "tensors": tensors,
               "bytes": byte_values, "storage": storage,
               "planner_data": ({k: list(v) for k, v in planner_data.items()} if isinstance(planner_data, dict)
                                else None),
               "save_id": self.save_id}
        tmp = os.path.join(self.path, METADATA_FILE + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f)
            if self.sync_files:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.path, METADATA_FILE))

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


class JsonFileReader(StorageReader):
    """Reads what ``JsonFileWriter`` wrote; parses JSON and raw bytes only."""

    def __init__(self, path: PathLike):
        super().__init__()
        self.path = str(path)
        self.storage: dict = {}
        self.load_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: Optional[PathLike] = None) -> None:
        if checkpoint_id:
            self.path = str(checkpoint_id)
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args, **kwargs) -> Metadata:
        where = os.path.join(self.path, METADATA_FILE)
        if not os.path.exists(where):
            raise CheckpointError(f"{self.path} holds no autoshard checkpoint ({METADATA_FILE} is missing): is the "
                                  "path right, and did the save finish?")
        try:
            with open(where, encoding="utf-8") as f:
                doc = json.load(f)
            if doc.get("format") != FORMAT or doc.get("version") != VERSION:
                raise CheckpointError(f"{where} is not an autoshard checkpoint of version {VERSION}")
            sd_meta: dict = {fqn: TensorStorageMetadata(
                TensorProperties(dtype=_dtype(t["dtype"])), torch.Size(t["size"]),
                [ChunkStorageMetadata(torch.Size(c["offsets"]), torch.Size(c["sizes"])) for c in t["chunks"]])
                for fqn, t in doc["tensors"].items()}
            sd_meta.update({fqn: BytesStorageMetadata() for fqn in doc["bytes"]})
            storage = {}
            for s in doc["storage"]:
                index = MetadataIndex(s["fqn"], None if s["offset"] is None else torch.Size(s["offset"]), s["index"])
                storage[index] = {k: s[k] for k in ("file", "pos", "length", "dtype", "shape") if k in s}
            planner_data = doc.get("planner_data")
            if planner_data is not None:
                planner_data = {k: tuple(v) for k, v in planner_data.items()}
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{where} is malformed ({type(e).__name__}: {e})") from e
        return Metadata(state_dict_metadata=sd_meta, planner_data=planner_data, storage_data=storage,
                        storage_meta=StorageMeta(checkpoint_id=self.path, save_id=doc.get("save_id"),
                                                 load_id=self.load_id),
                        version=doc.get("dcp_version"))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self.storage = metadata.storage_data

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans: list) -> list:
        return plans

    def read_data(self, plan, planner) -> Future:
        by_file: dict[str, list] = {}
        for req in plan.items:
            by_file.setdefault(self.storage[req.storage_index]["file"], []).append(req)
        for file, reqs in by_file.items():
            if os.path.basename(file) != file:
                raise CheckpointError(f"checkpoint metadata points outside {self.path}: {file!r}")
            with open(os.path.join(self.path, file), "rb") as f:
                for req in sorted(reqs, key=lambda r: self.storage[r.storage_index]["pos"]):
                    info = self.storage[req.storage_index]
                    f.seek(info["pos"])
                    raw = f.read(info["length"])
                    if len(raw) != info["length"]:
                        raise CheckpointError(f"{file} in {self.path} is truncated")
                    if req.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(req, io.BytesIO(raw))
                        continue
                    stored = self._tensor(raw, info)
                    for d, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                        stored = stored.narrow(d, start, length)
                    target = planner.resolve_tensor(req).detach()
                    if target.shape != stored.shape:
                        raise CheckpointError(f"{req.dest_index.fqn}: the checkpoint's piece has shape "
                                              f"{tuple(stored.shape)}, the destination {tuple(target.shape)}")
                    target.copy_(stored)
                    planner.commit_tensor(req, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @staticmethod
    def _tensor(raw: bytes, info: dict) -> torch.Tensor:
        dtype, shape = _dtype(info["dtype"]), tuple(info["shape"])
        if not raw:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


# ---- the front ------------------------------------------------------------------------------------

def save(state: dict, path: PathLike, *, process_group=None) -> None:
    """``dcp.save(state)`` into directory ``path`` in the JSON format above; every rank calls it."""
    _check_storable(state)
    with _alone_quietly():
        dcp.save(state, storage_writer=JsonFileWriter(path), planner=JsonSavePlanner(), process_group=process_group,
                 no_dist=not dist.is_initialized())


def load(state: dict, path: PathLike, *, process_group=None) -> None:
    """``dcp.load(state)`` from directory ``path``: fills ``state``'s tensors in place (resharding to
    their placements) and replaces its non-tensor values; every rank calls it. Runs no pickle."""
    with _alone_quietly():
        dcp.load(state, storage_reader=JsonFileReader(path), planner=JsonLoadPlanner(), process_group=process_group,
                 no_dist=not dist.is_initialized())


@contextlib.contextmanager
def _alone_quietly():
    """Without a process group DCP warns that it assumes one process; that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
