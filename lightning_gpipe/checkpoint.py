"""Checkpoint files of a pipeline: written atomically, either gathered into one file or sharded by stage.

* ``full`` (default): the first stage gathers the whole model and optimizer state and writes one
  ordinary Lightning file. Portable: one device loads it without this package, any K resumes it.
  Needs the whole model in the first stage's host memory while saving.
* ``sharded``: every stage writes its own tensors with ``torch.distributed.checkpoint`` (DCP) into a
  directory, keyed by the original parameter names, plus a ``meta.pt`` with the rest of Lightning's
  state. Nothing is gathered, so it suits models too big for one host; any K resumes it, because
  each stage reads back the names it holds. All ranks must see the same filesystem.
  :func:`consolidate` turns it into a full file offline.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

__all__ = ["atomic_write", "save_sharded", "load_sharded", "consolidate", "is_sharded", "META"]

META = "meta.pt"
_TENSORS = ("state_dict", "optimizer_states")


def is_sharded(path: str | os.PathLike) -> bool:
    """A sharded checkpoint is a directory with DCP's metadata and ``meta.pt``."""
    return os.path.isdir(path) and os.path.exists(os.path.join(path, META))


def _replace(src: str, dst: str) -> None:
    """Move ``src`` to ``dst`` in one rename; a directory that replaces another takes two, and between
    them the old one survives as ``<dst>.old-*``."""
    if os.path.isdir(src) and os.path.exists(dst):
        old = f"{dst}.old-{uuid.uuid4().hex[:8]}"
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)


def atomic_write(write: Callable[[str], None], path: str) -> None:
    """``write`` to a temporary name beside ``path``, then rename it into place.

    A crash during the write leaves the last good checkpoint at ``path`` untouched: the rename is
    atomic on one filesystem, and the half-written file keeps its temporary name.
    """
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    write(tmp)
    _replace(tmp, path)


def _as_dcp(checkpoint: dict[str, Any]) -> dict[str, Any]:
    # DCP keys nested dicts by path; optimizer states become a dict keyed by position (lists of tensors
    # would be keyed by index too, but dicts keep every path a string)
    return {"state_dict": checkpoint["state_dict"],
            "optimizer_states": {str(i): s for i, s in enumerate(checkpoint.get("optimizer_states", []))}}


def save_sharded(checkpoint: dict[str, Any], path: str, writer: bool) -> None:
    """Write this stage's tensors of ``checkpoint`` into the directory ``path``; collective over all ranks.

    Replicated entries (layers outside the backbone) are written once. ``writer`` (one rank) also
    writes ``meta.pt`` with everything that is not a tensor of the model or the optimizers, and
    moves the finished directory into place.
    """
    tmp = path + ".tmp"
    if writer and os.path.exists(tmp):
        shutil.rmtree(tmp)
    if dist.is_initialized():
        dist.barrier()
    dcp.save(_as_dcp(checkpoint), checkpoint_id=tmp)
    if writer:
        torch.save({k: v for k, v in checkpoint.items() if k not in _TENSORS}, os.path.join(tmp, META))
        _replace(tmp, path)


def _nested(paths: Mapping[tuple, Any]) -> dict[str, Any]:
    """Nested containers from DCP's key paths; integer keys (DCP's list positions) make lists again."""
    root: dict[Any, Any] = {}
    for keys, value in paths.items():
        node = root
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value

    def lists(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        if node and all(isinstance(k, int) for k in node):
            return [lists(node[k]) for k in sorted(node)]
        return {k: lists(v) for k, v in node.items()}

    return lists(root)


def load_sharded(path: str, wanted: Callable[[tuple], bool]) -> dict[str, Any]:
    """Read back the entries of a sharded checkpoint whose key path ``wanted`` accepts, plus ``meta.pt``.

    A stage asks for the names it holds, so a checkpoint written with another split loads too.
    """
    reader = dcp.FileSystemReader(path)
    metadata = reader.read_metadata()
    target: dict[tuple, Any] = {}
    for fqn, keys in metadata.planner_data.items():
        if not wanted(tuple(keys)):
            continue
        stored = metadata.state_dict_metadata[fqn]
        if isinstance(stored, dcp.metadata.TensorStorageMetadata):
            target[tuple(keys)] = torch.empty(stored.size, dtype=stored.properties.dtype)
        else:
            target[tuple(keys)] = None  # a pickled value, filled in by the load
    nested = _nested(target)
    dcp.load(nested, checkpoint_id=path, no_dist=not dist.is_initialized())
    checkpoint = torch.load(os.path.join(path, META), weights_only=False)
    checkpoint["state_dict"] = nested.get("state_dict", {})
    optimizers = nested.get("optimizer_states", {})
    checkpoint["optimizer_states"] = [optimizers[k] for k in sorted(optimizers, key=int)]
    return checkpoint


def consolidate(path: str) -> dict[str, Any]:
    """A sharded checkpoint as one in-memory Lightning checkpoint, without processes.

    Its ``state_dict`` is the whole model's, so ``torch.save`` it and ``Model.load_from_checkpoint``
    works on one device; its optimizer states stay keyed by parameter name, which this package's
    strategy resumes from with any number of stages.
    """
    checkpoint = load_sharded(path, wanted=lambda keys: True)
    order = checkpoint.get("gpipe", {}).get("state_dict_keys")
    if order:
        checkpoint["state_dict"] = {k: checkpoint["state_dict"][k] for k in order}
    return checkpoint
