"""Checkpoint files of a pipeline: written atomically, either gathered into one file or sharded by stage.

* ``full`` (default): the first stage gathers the whole model and optimizer state and writes one
  ordinary Lightning file. Portable: one device loads it without this package, any K resumes it.
  Needs the whole model in the first stage's host memory while saving.
* ``sharded``: every stage writes its own tensors with ``torch.distributed.checkpoint`` (DCP) into a
  directory, keyed by the original parameter names, plus the rest of Lightning's state as JSON
  and a weights-only tensor file (:mod:`lightning_gpipe.checkpointing.metadata`: nothing in it is unpickled).
  Nothing is gathered, so it suits models too big for one host; any K resumes it, because
  each stage reads back the names it holds. All ranks must see the same filesystem.
  :func:`consolidate` turns it into a full file offline.

Both are durable: the written files are fsynced before the rename and the folder after it, so a
power loss does not leave a renamed but empty checkpoint; a failed write removes its temporary copy.
"""

from __future__ import annotations

import io
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element  # private: what DCP's own planner uses

from lightning_gpipe.checkpointing.metadata import JSON_FILE, MetadataError, encode, load_metadata, save_metadata
from lightning_gpipe.checkpointing.optim_state import from_named
from lightning_gpipe.engine.distributed import is_distributed

__all__ = [
    "stage_selector",
    "atomic_write",
    "save_sharded",
    "load_sharded",
    "sharded_model_keys",
    "consolidate",
    "is_sharded",
    "META",
    "MetadataError",
]

META = JSON_FILE
_TENSORS = ("state_dict", "optimizer_states")


def is_sharded(path: str | os.PathLike) -> bool:
    """A sharded checkpoint is a directory with DCP's metadata and :data:`META`."""
    return os.path.isdir(path) and os.path.exists(os.path.join(path, META))


def _fsync(path: str) -> None:
    """Flush ``path`` (a file, or a folder's entries) to the disk; folders cannot be opened on Windows."""
    if os.path.isdir(path) and os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: str) -> None:
    """Flush a written file, or every file of a written directory and the directory itself."""
    if os.path.isdir(path):
        for root, _, files in os.walk(path):
            for name in files:
                _fsync(os.path.join(root, name))
            _fsync(root)
    else:
        _fsync(path)


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def _replace(src: str, dst: str) -> None:
    """Move ``src`` to ``dst`` in one rename, then flush the folder so that the rename itself is durable.

    A directory that replaces another takes two renames; between them the old one survives as
    ``<dst>.old-*``.
    """
    if os.path.isdir(src) and os.path.exists(dst):
        old = f"{dst}.old-{uuid.uuid4().hex[:8]}"
        os.replace(dst, old)
        os.replace(src, dst)
        _fsync(os.path.dirname(os.path.abspath(dst)))
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)
        _fsync(os.path.dirname(os.path.abspath(dst)))


def atomic_write(write: Callable[[str], None], path: str) -> None:
    """``write`` to a temporary name beside ``path``, flush it, then rename it into place.

    A crash during the write leaves the last good checkpoint at ``path`` untouched: the rename is
    atomic on one filesystem, and the half-written file keeps its temporary name. An exception during
    the write removes the temporary file and propagates; fsync before and after the rename keeps a
    power loss from leaving ``path`` renamed but empty.
    """
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        write(tmp)
        _fsync_tree(tmp)
        _replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def _as_dcp(checkpoint: dict[str, Any]) -> dict[str, Any]:
    # DCP keys nested dicts by path; optimizer states become a dict keyed by position (lists of tensors
    # would be keyed by index too, but dicts keep every path a string)
    return {
        "state_dict": checkpoint["state_dict"],
        "optimizer_states": {str(i): s for i, s in enumerate(checkpoint.get("optimizer_states", []))},
    }


def save_sharded(checkpoint: dict[str, Any], path: str, writer: bool) -> None:
    """Write this stage's tensors of ``checkpoint`` into the directory ``path``; collective over all ranks.

    Replicated entries (layers outside the backbone) are written once. ``writer`` (one rank) also
    writes the metadata (everything that is not a tensor of the model or the optimizers, without
    pickle: see :mod:`lightning_gpipe.checkpointing.metadata`), flushes the files and moves the finished directory
    into place. A value the metadata cannot hold fails before any tensor is written; any failure on
    the writer removes the temporary directory.
    """
    meta = {k: v for k, v in checkpoint.items() if k not in _TENSORS}
    encode(meta)  # every rank holds the same metadata: all fail alike, before the collective save
    tmp = path + ".tmp"
    if writer and os.path.exists(tmp):
        shutil.rmtree(tmp)
    if is_distributed():
        dist.barrier()
    try:
        dcp.save(_as_dcp(checkpoint), checkpoint_id=tmp)
        if writer:
            save_metadata(meta, tmp)
            _fsync_tree(tmp)
            _replace(tmp, path)
    except BaseException:
        if writer:
            _remove(tmp)
        raise


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


class _WeightsOnlyPlanner(dcp.DefaultLoadPlanner):
    """DCP's load planner, but its non-tensor values (optimizer hyper-parameters) load with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def sharded_model_keys(path: str) -> list[str]:
    """The model ``state_dict`` keys a sharded checkpoint holds (all stages'), read from DCP's index."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    return [keys[1] for keys in metadata.planner_data.values() if keys[0] == "state_dict"]


def stage_selector(model_keys: set[str], param_names: set[str]) -> Callable[[tuple], bool]:
    """Which entries of a sharded checkpoint one stage reads (for :func:`load_sharded`): the model entries in
    ``model_keys`` (its own layers, the rest of the model) and the optimizer state of ``param_names``."""

    def wanted(keys: tuple) -> bool:
        if keys[0] == "state_dict":
            return keys[1] in model_keys
        if keys[0] == "optimizer_states":
            return keys[2] == "groups" or (keys[2] in ("state", "group_of") and keys[3] in param_names)
        return False

    return wanted


def load_sharded(path: str, wanted: Callable[[tuple], bool], collective: Optional[bool] = None) -> dict[str, Any]:
    """Read back the entries of a sharded checkpoint whose key path ``wanted`` accepts, plus its metadata.

    A stage asks for the names it holds, so a checkpoint written with another split loads too.
    ``collective`` (default: whether a process group exists) makes every rank take part in the read;
    a single process reading on its own must pass ``False``, or it waits for the others forever.
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
    dcp.load(
        nested,
        checkpoint_id=path,
        planner=_WeightsOnlyPlanner(),
        no_dist=not (is_distributed() if collective is None else collective),
    )
    checkpoint = load_metadata(path)
    checkpoint["state_dict"] = nested.get("state_dict", {})
    optimizers = nested.get("optimizer_states", {})
    checkpoint["optimizer_states"] = [optimizers[k] for k in sorted(optimizers, key=int)]
    return checkpoint


def consolidate(path: str) -> dict[str, Any]:
    """A sharded checkpoint as one in-memory Lightning checkpoint, without processes (in one process of a
    job too: it reads alone).

    Its ``state_dict`` is the whole model's, so ``torch.save`` it and ``Model.load_from_checkpoint``
    works on one device. Its optimizer states are numbered as a full checkpoint's are, as a one-device optimizer
    numbers its parameters, with ``param_names`` beside them: a plain one-device ``trainer.fit(ckpt_path=...)``
    resumes the saved file, and so does this package's strategy with any number of stages. (They stayed keyed by
    name, which a one-device resume could not load: torch's ``KeyError: 'param_groups'``.)
    """
    checkpoint = load_sharded(path, wanted=lambda keys: True, collective=False)
    order = checkpoint.get("gpipe", {}).get("state_dict_keys")
    if order:
        checkpoint["state_dict"] = {k: checkpoint["state_dict"][k] for k in order}
    names = list(order or checkpoint["state_dict"])
    checkpoint["optimizer_states"] = [
        from_named(saved, names) if "groups" in saved else saved for saved in checkpoint.get("optimizer_states", [])
    ]
    return checkpoint
