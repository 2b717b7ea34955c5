"""What stages say to each other: a :class:`Tag` naming each message, and the int64 header that carries it.

Every message between stages is a fixed-size header followed by its tensors. The header says what
the message is (a :class:`Tag`: the pass, the backbone call, the micro-batch, the hook that made the
call and a fingerprint of the batch) and how to rebuild its tensors (dtype, grad flag, shape), so
that a receiver can check that it gets exactly what it expects; pure, no communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from lightning_gpipe.engine.failure import PipelineError

__all__ = ["HEADER_LEN", "Message", "Specs", "Tag", "close_header", "decode", "encode"]

HEADER_LEN = 128
_DATA, _CLOSE = 1, 2
_KINDS = ("forward", "output", "gradient", "input gradient", "skip", "skip gradient")
_LABEL_FIELDS = 6  # the hook name, up to 48 ASCII characters in 6 int64 fields
_FIXED = 6 + _LABEL_FIELDS  # type, tuple flag, kind, call, micro-batch, batch fingerprint, label
_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}


@dataclass(frozen=True)
class Tag:
    """What a message is: one pass of one micro-batch of one backbone call, and the batch it belongs to.

    ``call`` counts the backbone calls of a pipeline (evaluation calls count apart), ``label`` names
    the hook that made the call (empty outside Lightning) and ``batch`` is a fingerprint of the
    batch (0: not checked). A receiver compares the tag it expects with the one it gets.

    >>> Tag("forward", call=3, micro=0, label="training_step").describe()
    'the forward of micro-batch 0 of backbone call 3 (made in `training_step`)'
    """

    kind: str
    call: int
    micro: int = -1
    label: str = ""
    batch: int = 0

    def describe(self) -> str:
        """The tag in words, for error messages."""
        what = f"the {self.kind} of micro-batch {self.micro}" if self.micro >= 0 else f"the {self.kind}"
        made = f" (made in `{self.label}`)" if self.label else ""
        return f"{what} of backbone call {self.call}{made}"

    def same_step(self, other: "Tag") -> bool:
        """Whether ``other`` is the same pass of the same call (the batch fingerprints aside)."""
        return (self.kind, self.call, self.micro, self.label) == (other.kind, other.call, other.micro, other.label)


@dataclass
class Message:
    """What one stage sent another: tensors (``None`` where there is nothing), how to rebuild them, and its tag."""

    values: tuple[Optional[Tensor], ...]
    requires_grad: tuple[bool, ...]
    is_tuple: bool
    tag: Tag

    def tensors(self) -> tuple[Tensor, ...]:
        """The values of a message that has no gaps (activations, the shared output): ``None`` is an error."""
        if any(v is None for v in self.values):
            raise PipelineError(f"{self.tag.describe()} arrived with missing tensors; the stages are out of step.")
        return tuple(v for v in self.values if v is not None)


def _encode_label(label: str) -> list[int]:
    raw = label.encode("ascii", "replace")[: 8 * _LABEL_FIELDS].ljust(8 * _LABEL_FIELDS, b"\0")
    return [int.from_bytes(raw[8 * i : 8 * i + 8], "little", signed=True) for i in range(_LABEL_FIELDS)]


def _decode_label(fields: list[int]) -> str:
    raw = b"".join(f.to_bytes(8, "little", signed=True) for f in fields)
    return raw.rstrip(b"\0").decode("ascii", "replace")


def encode(values: Sequence[Optional[Tensor]], requires_grad: Sequence[bool], is_tuple: bool, tag: Tag) -> Tensor:
    """The fixed-size int64 header that announces a message: its tag, then dtype, grad flag and shape of each tensor."""
    fields = [
        _DATA,
        int(is_tuple),
        _KINDS.index(tag.kind),
        tag.call,
        tag.micro,
        tag.batch,
        *_encode_label(tag.label),
        len(values),
    ]
    for value, flag in zip(values, requires_grad):
        if value is None:
            fields += [-1, 0, 0]
            continue
        if value.dtype not in _CODES:
            raise TypeError(f"Cannot send a tensor of dtype {value.dtype} between stages.")
        fields += [_CODES[value.dtype], int(flag), value.dim(), *value.shape]
    if len(fields) > HEADER_LEN:
        raise ValueError(
            f"A stage output with {len(values)} tensors of these shapes does not fit the {HEADER_LEN}-field message "
            "header; return fewer tensors (or fewer dimensions) at a stage boundary."
        )
    return torch.tensor(fields + [0] * (HEADER_LEN - len(fields)), dtype=torch.int64)


Specs = list[tuple[Optional[torch.dtype], bool, tuple[int, ...]]]


def decode(header: Tensor) -> Optional[tuple[Specs, Tag, bool]]:
    """The tensor specs, the tag and the tuple flag a header announces, or ``None`` for the close message."""
    fields = header.tolist()
    if fields[0] == _CLOSE:
        return None
    if fields[0] != _DATA or not 0 <= fields[2] < len(_KINDS):
        raise PipelineError(f"Received a malformed message header {fields[:8]}...; the stages are out of step.")
    tag = Tag(_KINDS[fields[2]], fields[3], fields[4], _decode_label(fields[6 : 6 + _LABEL_FIELDS]), fields[5])
    specs, pos = [], _FIXED + 1
    for _ in range(fields[_FIXED]):
        code, flag, ndim = fields[pos : pos + 3]
        shape = tuple(fields[pos + 3 : pos + 3 + ndim])
        specs.append((None if code < 0 else _DTYPES[code], bool(flag), shape))
        pos += 3 + ndim
    return specs, tag, bool(fields[1])


def close_header() -> Tensor:
    """The header that tells a receiving thread to stop: no tensors follow it."""
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = _CLOSE
    return header
