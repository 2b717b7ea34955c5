"""Scatter a mini-batch into micro-batches along dim 0, and gather stage outputs back; pure."""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import operator
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lightning_gpipe.engine.rng import mix64

__all__ = [
    "check_chunks",
    "whole_number",
    "Outputs",
    "fields",
    "replaced_fields",
    "is_container",
    "leaves",
    "tensors",
    "map_leaves",
    "map_tensors",
    "batch_size",
    "split_sizes",
    "split",
    "scatter",
    "gather",
    "fingerprint",
    "fingerprints",
    "as_bits",
]

#: What a stage may return: one tensor, or tuples, lists and dicts of tensors, nested, with constants beside them.
Outputs = Any


def fields(value: Any) -> Optional[list[str]]:
    """The field names of a dataclass instance (a batch or an output type of the user's), else ``None``: Lightning
    moves the tensors inside dataclasses to the device (``apply_to_collection``), so they count as tensors here too."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [f.name for f in dataclasses.fields(value)]
    return None


def replaced_fields(value: Any, changes: Mapping[str, Any]) -> Any:
    """A shallow copy of the dataclass instance ``value`` with ``changes``, set as they are: neither ``__init__`` nor
    ``__post_init__`` runs again (a field with ``init=False``, a frozen class), as ``dataclasses.replace`` would."""
    copied = copy.copy(value)
    for name, field in changes.items():
        object.__setattr__(copied, name, field)
    return copied


def is_container(value: Any) -> bool:
    """Whether :func:`tensors` looks inside ``value``: a dict (any Mapping), a list, a tuple or a dataclass."""
    return isinstance(value, (Mapping, list, tuple)) or fields(value) is not None


def leaves(tree: Any, is_leaf: Callable[[Any], bool]) -> list[Any]:
    """The leaves of ``tree`` that ``is_leaf`` picks, in a fixed order: depth first through tuples, lists, dicts
    (keys in insertion order) and dataclasses (fields in declaration order), as :func:`map_leaves` visits them."""
    if is_leaf(tree):
        return [tree]
    if isinstance(tree, Mapping):
        return [leaf for value in tree.values() for leaf in leaves(value, is_leaf)]
    if isinstance(tree, (list, tuple)):
        return [leaf for value in tree for leaf in leaves(value, is_leaf)]
    names = fields(tree)
    return [leaf for name in names for leaf in leaves(getattr(tree, name), is_leaf)] if names is not None else []


def _is_tensor(value: Any) -> bool:
    return isinstance(value, Tensor)


def tensors(batch: Any) -> list[Tensor]:
    """The tensor leaves of a batch, in :func:`leaves`' order."""
    return leaves(batch, _is_tensor)


def map_tensors(fn: Callable[[Tensor], Any], batch: Any) -> Any:
    """``batch`` with ``fn`` applied to every tensor leaf; the structure is kept."""
    return map_leaves(fn, batch, _is_tensor)


def map_leaves(fn: Callable[[Any], Any], tree: Any, is_leaf: Callable[[Any], bool]) -> Any:
    """``tree`` (tuples, lists, dicts, namedtuples and dataclasses, nested) with ``fn`` applied to every leaf that
    ``is_leaf`` picks; other leaves are kept as they are."""
    if is_leaf(tree):
        return fn(tree)
    if isinstance(tree, Mapping):
        return type(tree)((k, map_leaves(fn, v, is_leaf)) for k, v in tree.items())  # type: ignore[call-arg]
    if isinstance(tree, (list, tuple)):
        items = [map_leaves(fn, v, is_leaf) for v in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
    names = fields(tree)
    if names is not None:
        return replaced_fields(tree, {name: map_leaves(fn, getattr(tree, name), is_leaf) for name in names})
    return tree


def batch_size(batch: Any) -> int:
    """The size of dim 0 shared by every tensor in ``batch``.

    Raises ``ValueError`` when the batch holds no tensor, a 0-dim tensor, a sparse tensor, a ``PackedSequence``,
    or tensors that disagree on dim 0: a micro-batch must cut every tensor at the same samples.
    """
    leaves = tensors(batch)
    if not leaves:
        raise ValueError(
            f"The backbone input holds no tensor (got {type(batch).__name__}); pass a Tensor, or a tuple, "
            "list or dict of Tensors, so that it can be cut into micro-batches."
        )
    if _holds_packed_sequence(batch):
        raise ValueError(
            "The backbone input holds a PackedSequence, whose `data` packs every sample's time steps together "
            "(time-major), so it cannot be cut into micro-batches of samples. Pass the padded tensor and the lengths "
            "(batch first) and pack them inside the backbone's first layer."
        )
    sparse = [t for t in leaves if t.layout != torch.strided or t.is_nested]
    if sparse:
        kind = "a nested tensor" if sparse[0].is_nested else f"a tensor of layout {sparse[0].layout}"
        raise ValueError(
            f"The backbone input holds {kind}, which the pipeline can neither cut into "
            "micro-batches nor send between stages: it takes strided (dense) tensors. Make it dense before the "
            "backbone (`x.to_dense()`), or compute the sparse product in a layer outside the backbone (a stem), "
            "whose dense output the backbone takes."
        )
    sizes = set()
    for t in leaves:
        if t.dim() == 0:
            raise ValueError(
                "A backbone input tensor is 0-dimensional; micro-batching splits dim 0, so every input "
                "tensor needs a batch dimension first."
            )
        sizes.add(t.shape[0])
    if len(sizes) != 1:
        raise ValueError(
            f"The backbone input tensors disagree on the batch size (dim 0): {sorted(sizes)}. "
            "Micro-batching cuts every tensor at the same samples, so they must agree."
        )
    return sizes.pop()


def _holds_packed_sequence(batch: Any) -> bool:
    """Whether ``batch`` holds a ``PackedSequence``: a namedtuple of tensors, which would be cut field by field."""
    packed = torch.nn.utils.rnn.PackedSequence
    found = leaves(batch, lambda leaf: isinstance(leaf, packed) or not is_container(leaf))
    return any(isinstance(leaf, packed) for leaf in found)


def check_chunks(chunks: object) -> int:
    """``chunks`` as an ``int`` if it is a positive integer (micro-batches per batch; a NumPy integer too), else a
    ``ValueError`` that says so.

    >>> check_chunks(4)
    4
    """
    number = whole_number(chunks)
    if number is None or number < 1:
        raise ValueError(f"`chunks` must be a positive integer (micro-batches per batch), got {chunks!r}.")
    return number


def whole_number(value: object) -> Optional[int]:
    """``value`` as an ``int`` where it is an integer (Python's, NumPy's: anything ``operator.index`` takes, but not a
    bool), else None: a count computed with NumPy (``np.int64``) means the same number."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def split_sizes(size: int, chunks: int) -> list[int]:
    """Micro-batch sizes for a batch of ``size`` samples cut into at most ``chunks`` pieces.

    The pieces differ by at most one sample, larger ones first, and none is empty: a batch of at least
    ``chunks`` samples gets exactly ``chunks`` micro-batches (``torch.chunk`` may return fewer), a
    smaller one (a short last batch, a validation batch of 1) gets one micro-batch per sample. Every
    stage holds the same batch, so every stage computes the same count.

    >>> split_sizes(10, 4)
    [3, 3, 2, 2]
    >>> split_sizes(2, 4)
    [1, 1]
    """
    check_chunks(chunks)
    if size < 1:
        raise ValueError(
            f"The batch has {size} samples; every micro-batch needs at least one sample, so there is nothing to run "
            "through the pipeline. Pass a batch with at least one sample (check the DataLoader or sampler that made "
            "an empty batch)."
        )
    count = min(chunks, size)
    base, extra = divmod(size, count)
    return [base + 1 if i < extra else base for i in range(count)]


def split(batch: Any, sizes: list[int]) -> list[Any]:
    """Cut every tensor of ``batch`` along dim 0 into pieces of ``sizes``; other leaves are repeated."""
    if isinstance(batch, Tensor):
        return list(torch.split(batch, sizes))
    if isinstance(batch, Mapping):
        parts = {k: split(v, sizes) for k, v in batch.items()}
        return [type(batch)((k, parts[k][i]) for k in batch) for i in range(len(sizes))]  # type: ignore[call-arg]
    if isinstance(batch, (list, tuple)):
        columns = [split(v, sizes) for v in batch]
        rows = [[col[i] for col in columns] for i in range(len(sizes))]
        if hasattr(batch, "_fields"):  # namedtuple
            return [type(batch)(*row) for row in rows]
        return [type(batch)(row) for row in rows]
    names = fields(batch)
    if names is not None:
        parts = {name: split(getattr(batch, name), sizes) for name in names}
        return [replaced_fields(batch, {name: parts[name][i] for name in names}) for i in range(len(sizes))]
    return [batch] * len(sizes)  # a non-tensor leaf (a flag, a string) goes to every micro-batch unchanged


def scatter(batch: Any, chunks: int) -> list[Any]:
    """Cut ``batch`` (a Tensor, or a tuple, list or dict of them, nested) into ``chunks`` micro-batches (fewer
    if it has fewer samples: see :func:`split_sizes`).

    >>> [t.shape[0] for t in scatter(torch.zeros(10, 3), 4)]
    [3, 3, 2, 2]
    """
    return split(batch, split_sizes(batch_size(batch), chunks))


def gather(outputs: Sequence[tuple[Tensor, ...]]) -> tuple[Tensor, ...]:
    """Join per-micro-batch outputs (each a tuple of tensors) along dim 0, element by element."""
    if len(outputs) == 1:
        return outputs[0]
    return tuple(torch.cat(parts) for parts in zip(*outputs))


_MASK64 = (1 << 64) - 1
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(t: Tensor) -> Tensor:
    """``t``'s values as integers of the same width, flat: exact digests sum these (integer sums do not
    depend on the order of summation, so every rank gets the same number for the same bits)."""
    t = t.detach().resolve_neg()
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())  # a lazy conjugate (``x.conj()``) has no real view of its own
    t = t.reshape(-1)
    return t.view(_INT_OF_SIZE[t.element_size()]) if t.numel() else t.to(torch.int64)


#: Elements a device tensor's sums read at once: they widen values to 64 bits, so a large tensor goes in pieces.
_PIECE = 2**22
#: A device tensor of at most this many bytes is copied to the host, in one copy with the others of its device,
#: and CRC'd there. Summing it on the device instead costs about 130 µs of kernel launches per tensor (measured on
#: an H100: 27 ms for 200 BatchNorm-sized buffers), far more than copying it; a larger tensor is summed there.
_HOST_BYTES = 2**20


def _crc(flat: Tensor) -> int:
    """CRC-32 of a flat CPU tensor's bytes (measured 4.2 GB/s on one thread of CPU-2, against 0.32 GB/s for the
    device-style sums: what a setup-time digest of a 4 GB model costs, 1 s against 12 s)."""
    return zlib.crc32(host_bytes(flat.contiguous())) if flat.numel() else 0


def host_bytes(t: Tensor) -> Any:
    """The bytes of a contiguous CPU tensor, read in place (a buffer for ``zlib`` or ``bytes``).

    Not through ``Tensor.numpy()``: that marks the tensor's storage as never to be resized again, for good, and
    these digests read the user's own tensors (weights, buffers, batches). A layer that resizes a buffer in
    place, as a quantization observer does with its ``min_val`` and ``max_val``, then failed in the pipeline
    with "Trying to resize storage that is not resizable".
    """
    return (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())


def _device_sums(flat: Tensor) -> Tensor:
    """Two int64 sums of a large device tensor's bits, computed there: plain, and weighted by position (so that
    values that move change it). Left on the device, so that :func:`fingerprint` reads them with the rest."""
    sums = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), _PIECE):
        piece = flat[start : start + _PIECE].to(torch.int64)
        positions = torch.arange(start + 1, start + piece.numel() + 1, device=piece.device, dtype=torch.int64)
        sums += torch.stack([piece.sum(), (piece * positions).sum()])  # int64 wraps around: fine for a digest
    return sums


def _checksums(flats: Sequence[Tensor]) -> list[list[int]]:
    """Checksums of each flat tensor's bits (:func:`as_bits`), that change when values change or move.

    On the CPU, :func:`_crc`. On a device: small tensors' bytes and large tensors' :func:`_device_sums` are
    joined there and copied to the host at once, one synchronization per device rather than one per tensor,
    then the bytes are CRC'd. Every process picks the same way for the same shapes and dtypes, so processes
    compare checksums of tensors on the same kind of device.
    """
    checks: list[list[int]] = [[] for _ in flats]
    pending: dict[torch.device, list[tuple[int, bool, Tensor]]] = {}
    for i, flat in enumerate(flats):
        if flat.device.type == "cpu":
            checks[i] = [_crc(flat)]
            continue
        small = flat.numel() * flat.element_size() <= _HOST_BYTES
        raw = flat.contiguous() if small else _device_sums(flat)
        pending.setdefault(flat.device, []).append((i, small, raw.view(torch.uint8)))
    for parts in pending.values():
        host = torch.cat([raw for _, _, raw in parts]).cpu()
        offset = 0
        for i, small, raw in parts:
            chunk, offset = host[offset : offset + raw.numel()], offset + raw.numel()
            if small:
                checks[i] = [_crc(chunk)]
            else:
                data = chunk.numpy().tobytes()  # two little-endian int64
                checks[i] = [int.from_bytes(data[k : k + 8], "little", signed=True) for k in (0, 8)]
    return checks


def fingerprint(batch: Any) -> int:
    """A 63-bit digest of every tensor of ``batch``: its shape, dtype and bits, in order; and of its other leaves.

    Two stages that hold the same batch get the same number; a different sample, order, shape or
    dtype changes it. It reads every value once, so it costs about a pass over the batch. It also
    tells whether processes built the same weights (:mod:`~lightning_gpipe.engine.initial_state`).
    Device tensors reach the host in one copy per device (:func:`_checksums`).

    >>> batch = (torch.arange(4.0), {"y": torch.tensor([1, 2])})
    >>> fingerprint(batch) == fingerprint((torch.arange(4.0), {"y": torch.tensor([1, 2])}))
    True
    >>> fingerprint(torch.tensor([1.0, 2.0])) == fingerprint(torch.tensor([2.0, 1.0]))
    False
    """
    return (_digest(batch, _OBJECT_DEPTH) >> 1) or 1  # 0 means "not checked" in a message header


#: How many levels of plain objects' attributes a fingerprint reads (a batch class of the user's holding tensors; a
#: bound keeps an object that refers to itself, or to a large graph, from being walked without end)
_OBJECT_DEPTH = 3


def _digest(batch: Any, depth: int) -> int:
    every = list(tensors(batch))
    digest = 0
    for t, values in zip(every, _tensor_checksums(every)):
        digest = _mix(digest, t, values)
    others = leaves(batch, lambda value: not isinstance(value, Tensor) and not is_container(value))
    for value in others:  # a text batch's strings, a NumPy array: the stages must agree on them too
        digest = mix64(digest ^ _leaf_digest(value, depth))
    return digest


def _leaf_digest(value: Any, depth: int) -> int:
    """A CRC of a non-tensor leaf: a number's or string's exact repr, a NumPy array's bytes; an object's type name and
    the digest of its attributes (a batch class of the user's, which Lightning moves through its ``.to``), ``depth``
    levels down; else its type's name alone (an object's repr may hold its address, which differs between processes)."""
    if isinstance(value, (str, bytes, bool, int, float, complex, type(None))):
        return zlib.crc32(repr(value).encode("utf-8", "surrogatepass"))
    tobytes = getattr(value, "tobytes", None)
    if callable(tobytes) and hasattr(value, "dtype") and hasattr(value, "shape"):
        return zlib.crc32(tobytes()) ^ zlib.crc32(f"{value.dtype}{value.shape}".encode())
    name = zlib.crc32(type(value).__qualname__.encode())
    attributes = getattr(value, "__dict__", None)
    if depth > 0 and isinstance(attributes, dict) and not callable(value):
        return name ^ _digest(attributes, depth - 1)
    return name


def fingerprints(every: Sequence[Tensor]) -> list[int]:
    """:func:`fingerprint` of each tensor, read in one pass: device tensors reach the host in one copy per device
    for all of them, where a :func:`fingerprint` per tensor would wait for the device once per tensor."""
    return [(_mix(0, t, values) >> 1) or 1 for t, values in zip(every, _tensor_checksums(every))]


def _tensor_checksums(every: Sequence[Tensor]) -> list[list[int]]:
    """:func:`_checksums` of each tensor's bits; a sparse tensor's are those of its coalesced indices and values.

    A sparse tensor has no strided bits to read (``as_bits`` failed with "reshape is not implemented for sparse
    tensors"), and a training batch may hold one that ``training_step`` makes dense before the backbone.
    """
    parts: list[Tensor] = []
    owners: list[int] = []
    checks: list[list[int]] = [[] for _ in every]
    for i, t in enumerate(every):
        if t.is_nested:  # a nested tensor's components, and their shapes (they are its shape)
            pieces = list(t.unbind())
            checks[i] += [d for piece in pieces for d in (piece.dim(), *piece.shape)]
        elif t.layout == torch.strided:
            pieces = [t]
        else:
            coo = (t if t.layout == torch.sparse_coo else t.to_sparse_coo()).coalesce()
            pieces = [coo.indices(), coo.values()]
        parts += pieces
        owners += [i] * len(pieces)
    for owner, values in zip(owners, _checksums([as_bits(part) for part in parts])):
        checks[owner] += values
    return checks


def _mix(digest: int, t: Tensor, values: Sequence[int]) -> int:
    shape = (t.size(0),) if t.is_nested else tuple(t.shape)  # a nested tensor's: its components' (in ``values``)
    for part in (zlib.crc32(str(t.dtype).encode()), t.dim(), *shape, *values):
        digest = mix64(digest ^ (part & _MASK64))
    return digest
