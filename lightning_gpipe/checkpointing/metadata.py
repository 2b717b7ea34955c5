"""A sharded checkpoint's metadata without pickle: JSON for the structure, a weights-only file for its tensors.

Unpickling runs whatever code the file names, so a checkpoint directory from elsewhere must not be
unpickled. Lightning's state besides the model's and optimizers' tensors (epoch, loops, callbacks,
hyper_parameters, this package's ``"gpipe"`` entry) is plain data: it is written as JSON, its tensors
go to a file that ``torch.load(..., weights_only=True)`` reads, and the values JSON lacks travel
tagged::

    >>> data, tensors = encode({"shape": (2, 3), "dtype": torch.float16})
    >>> data["shape"]
    {'__gpipe__': 'tuple', 'v': [2, 3]}
    >>> decode(data, tensors) == {"shape": (2, 3), "dtype": torch.float16}
    True

A value with no encoding (a function, a class, an arbitrary object) is an error at save time that
names its key path, never a silent loss.
"""

from __future__ import annotations

import base64
import enum
import json
import math
import os
import pathlib
import sys
from typing import Any

import torch

__all__ = ["MetadataError", "encode", "decode", "save_metadata", "load_metadata", "JSON_FILE", "TENSORS_FILE"]

JSON_FILE = "meta.json"
TENSORS_FILE = "meta_tensors.pt"
_TAG = "__gpipe__"  # a dict with this key is a tagged value; a user's dict with it is stored tagged too
_PATHS = {
    cls.__name__: cls
    for cls in (
        pathlib.Path,
        pathlib.PurePath,
        pathlib.PosixPath,
        pathlib.WindowsPath,
        pathlib.PurePosixPath,
        pathlib.PureWindowsPath,
    )
}


class MetadataError(TypeError):
    """A checkpoint value that the sharded format cannot store (or read back) without pickle."""


def _where(path: tuple) -> str:
    return "checkpoint" + "".join(f"[{key!r}]" for key in path)


def encode(value: Any, path: tuple = ()) -> tuple[Any, list[torch.Tensor]]:
    """``value`` as JSON-serializable data, and the tensors it refers to by position."""
    tensors: list[torch.Tensor] = []
    return _encode(value, path, tensors), tensors


def _encode(value: Any, path: tuple, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, enum.Enum):  # before int and str: IntEnum and StrEnum are enums first
        cls = type(value)
        return {_TAG: "enum", "v": [cls.__module__, cls.__qualname__, value.name]}
    if value is None or isinstance(value, (bool, str)):
        return str(value) if isinstance(value, str) else value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {_TAG: "float", "v": repr(float(value))}
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach().cpu())
        return {_TAG: "tensor", "v": len(tensors) - 1}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and _TAG not in value:
            return {k: _encode(v, path + (k,), tensors) for k, v in value.items()}
        return {
            _TAG: "dict",
            "v": [[_encode(k, path + (k,), tensors), _encode(v, path + (k,), tensors)] for k, v in value.items()],
        }
    if isinstance(value, list):
        return [_encode(v, path + (i,), tensors) for i, v in enumerate(value)]
    if isinstance(value, (tuple, set, frozenset)):
        kind = "tuple" if isinstance(value, tuple) else type(value).__name__
        items = value if isinstance(value, tuple) else sorted(value, key=repr)
        return {_TAG: kind, "v": [_encode(v, path + (i,), tensors) for i, v in enumerate(items)]}
    if isinstance(value, torch.dtype):
        return {_TAG: "dtype", "v": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {_TAG: "device", "v": str(value)}
    if isinstance(value, pathlib.PurePath):
        return {_TAG: "path", "v": [type(value).__name__, str(value)]}
    if isinstance(value, bytes):
        return {_TAG: "bytes", "v": base64.b64encode(value).decode("ascii")}
    raise MetadataError(
        f"Cannot store {_where(path)} (a {type(value).__module__}.{type(value).__qualname__}) in a sharded "
        "checkpoint: its metadata is written without pickle, as JSON plus tensors, which holds numbers, strings, "
        "lists, tuples, dicts, tensors, dtypes, devices, paths and enums. Store a plain value there instead (e.g. "
        "leave it out with save_hyperparameters(ignore=[...]), or edit it in on_save_checkpoint), or use "
        "GPipeStrategy(state_dict_type='full')."
    )


def decode(data: Any, tensors: list[torch.Tensor]) -> Any:
    """The value :func:`encode` turned into ``data`` (and ``tensors``)."""
    if isinstance(data, list):
        return [decode(v, tensors) for v in data]
    if not isinstance(data, dict):
        return data
    if _TAG not in data:
        return {k: decode(v, tensors) for k, v in data.items()}
    kind, value = data[_TAG], data["v"]
    if kind == "tensor":
        return tensors[value]
    if kind == "dict":
        return {decode(k, tensors): decode(v, tensors) for k, v in value}
    if kind in ("tuple", "set", "frozenset"):
        return {"tuple": tuple, "set": set, "frozenset": frozenset}[kind](decode(v, tensors) for v in value)
    if kind == "float":
        return float(value)
    if kind == "dtype" and isinstance(getattr(torch, value, None), torch.dtype):
        return getattr(torch, value)
    if kind == "device":
        return torch.device(value)
    if kind == "path" and value[0] in _PATHS:
        return _PATHS[value[0]](value[1])
    if kind == "bytes":
        return base64.b64decode(value)
    if kind == "enum":
        return _enum(*value)
    raise MetadataError(
        f"Unknown tagged value {data!r} in a sharded checkpoint's metadata; was it written by a "
        "newer version of lightning_gpipe?"
    )


def _enum(module: str, qualname: str, name: str) -> enum.Enum:
    """An enum member, from a module that is already imported: loading never imports (runs) code."""
    owner: Any = sys.modules.get(module)
    for part in qualname.split(".") if owner is not None else ():
        owner = getattr(owner, part, None)
    if not (isinstance(owner, type) and issubclass(owner, enum.Enum)):
        raise MetadataError(
            f"The checkpoint holds a member of the enum {module}.{qualname}, which is not loaded; "
            f"`import {module}` before loading the checkpoint."
        )
    return owner[name]


def save_metadata(meta: dict[str, Any], directory: str) -> list[str]:
    """Write ``meta`` into ``directory`` as JSON plus a tensors file; returns the files written."""
    data, tensors = encode(meta)
    json_path, tensors_path = os.path.join(directory, JSON_FILE), os.path.join(directory, TENSORS_FILE)
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(data, f, allow_nan=False)
    torch.save(tensors, tensors_path)
    return [json_path, tensors_path]


def load_metadata(directory: str) -> dict[str, Any]:
    """Read what :func:`save_metadata` wrote; tensors with ``weights_only=True``, nothing unpickled."""
    with open(os.path.join(directory, JSON_FILE), encoding="utf-8") as f:
        data = json.load(f)
    tensors = torch.load(os.path.join(directory, TENSORS_FILE), map_location="cpu", weights_only=True)
    return decode(data, tensors)
