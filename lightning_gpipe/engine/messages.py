"""What stages say to each other: a :class:`Tag` naming each message, the int64 header that carries it, and its frames.

Every message between stages starts with a fixed-size header. The header says what the message is
(a :class:`Tag`: the pass, the backbone call, the micro-batch, the hook that made the call and a
fingerprint of the batch) and how to rebuild its tensors (dtype, grad flag, shape), so that a
receiver can check that it gets exactly what it expects; pure, no communication.

On the wire (:func:`frames`) a message is either one *inline* frame, the header with the tensors'
bytes packed after it, or the header alone followed by one frame per tensor. Inline frames exist
because each point-to-point operation costs far more than the bytes it moves on small messages:
measured between two processes over gloo on loopback, one 256-byte message took 47 us one way and
a header plus the same tensor 153 us. They need a transport that accepts a message shorter than the
posted receive buffer (gloo does; NCCL does not), because the receiver cannot know the size before
the header arrives; the caller decides with ``inline_limit`` (0: never).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from lightning_gpipe.engine.failure import PipelineError
from lightning_gpipe.engine.structure import Skeleton, Structure

__all__ = [
    "EVAL_CALLS",
    "HEADER_BYTES",
    "HEADER_LEN",
    "INLINE_LIMIT",
    "Message",
    "Specs",
    "Tag",
    "close_header",
    "decode",
    "encode",
    "frames",
    "inline_size",
    "inline_values",
    "is_inline",
]

HEADER_LEN = 128
HEADER_BYTES = HEADER_LEN * 8
#: The most tensor bytes an inline frame carries. Packing costs a copy on each side (about 0.8 ms for
#: 4 MiB here), and a message of several frames costs more than that in a pipeline: its receiver posts
#: each frame's receive only after the header, so the frames wait on the sender, which computes by then
#: (measured on the main job's model, K=2: 3.1-3.6 ms from send to receipt for 450 KiB in three frames,
#: 1.3-1.4 ms as one inline frame). Larger messages go in frames of their own.
INLINE_LIMIT = 4 * 1024 * 1024
_ALIGN = 16  # every packed tensor starts at a multiple of the largest element size (complex128)
_DATA, _CLOSE, _INLINE = 1, 2, 3
_KINDS = ("forward", "output", "gradient", "input gradient", "skip", "skip gradient")
_LABEL_FIELDS = 6  # the hook name, up to 48 ASCII characters in 6 int64 fields
_FIXED = 6 + _LABEL_FIELDS  # type, structure, kind, call, micro-batch, batch fingerprint, label
_SKELETON = 2  # the structure field of a message whose tensors rebuild a Skeleton: its bytes follow the specs
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


#: Where the numbers of evaluation calls (made without a graph) start, so that they never meet the training calls'.
EVAL_CALLS = 1 << 62


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
        return f"{what} of {self.call_words()}{made}"

    def call_words(self) -> str:
        """The call in words: evaluation calls are counted apart from the training calls (see ``StageRunner``)."""
        if self.call >= EVAL_CALLS:
            return f"evaluation call {self.call - EVAL_CALLS} (without a graph)"
        return f"backbone call {self.call}"

    def same_step(self, other: "Tag") -> bool:
        """Whether ``other`` is the same pass of the same call (the batch fingerprints aside)."""
        return (self.kind, self.call, self.micro, self.label) == (other.kind, other.call, other.micro, other.label)


@dataclass
class Message:
    """What one stage sent another: tensors (``None`` where there is nothing), how to rebuild them, and its tag.

    ``structure`` rebuilds the stage output the tensors came from
    (:func:`~lightning_gpipe.engine.structure.unflatten`).
    """

    values: tuple[Optional[Tensor], ...]
    requires_grad: tuple[bool, ...]
    structure: Structure
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


def encode(
    values: Sequence[Optional[Tensor]],
    requires_grad: Sequence[bool],
    structure: Structure,
    tag: Tag,
    inline: bool = False,
) -> Tensor:
    """The fixed-size int64 header that announces a message: its tag, then dtype, grad flag and shape of each tensor,
    then a :class:`~lightning_gpipe.engine.structure.Skeleton`'s bytes where ``structure`` is one.

    ``inline``: the tensors' bytes follow the header in the same frame (see :func:`frames`).
    """
    fields = [
        _INLINE if inline else _DATA,
        _SKELETON if isinstance(structure, Skeleton) else int(structure),
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
    if isinstance(structure, Skeleton):
        raw = structure.raw + b"\0" * (-len(structure.raw) % 8)
        fields += [
            len(structure.raw),
            *(int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, len(raw), 8)),
        ]
    if len(fields) > HEADER_LEN:
        raise ValueError(
            f"A stage output with {len(values)} tensors of these shapes does not fit the {HEADER_LEN}-field message "
            "header; return fewer tensors (or fewer dimensions, or less structure around them) at a stage boundary."
        )
    return torch.tensor(fields + [0] * (HEADER_LEN - len(fields)), dtype=torch.int64)


Specs = list[tuple[Optional[torch.dtype], bool, tuple[int, ...]]]


def decode(header: Tensor) -> Optional[tuple[Specs, Tag, Structure]]:
    """The tensor specs, the tag and the structure a header announces, or ``None`` for the close message."""
    fields = header.tolist()
    if fields[0] == _CLOSE:
        return None
    if fields[0] not in (_DATA, _INLINE) or not 0 <= fields[2] < len(_KINDS):
        raise PipelineError(f"Received a malformed message header {fields[:8]}...; the stages are out of step.")
    tag = Tag(_KINDS[fields[2]], fields[3], fields[4], _decode_label(fields[6 : 6 + _LABEL_FIELDS]), fields[5])
    specs, pos = [], _FIXED + 1
    for _ in range(fields[_FIXED]):
        code, flag, ndim = fields[pos : pos + 3]
        shape = tuple(fields[pos + 3 : pos + 3 + ndim])
        specs.append((None if code < 0 else _DTYPES[code], bool(flag), shape))
        pos += 3 + ndim
    if fields[1] != _SKELETON:
        return specs, tag, bool(fields[1])
    size = fields[pos]
    raw = b"".join(f.to_bytes(8, "little", signed=True) for f in fields[pos + 1 : pos + 1 + -(-size // 8)])
    return specs, tag, Skeleton(raw[:size])


def close_header() -> Tensor:
    """The header that tells a receiving thread to stop: no tensors follow it."""
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = _CLOSE
    return header


def is_inline(header: Tensor) -> bool:
    """Whether the message's tensors were packed into the header's frame (else each follows in its own frame)."""
    return int(header[0]) == _INLINE


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def inline_size(values: Sequence[Optional[Tensor]], inline_limit: int) -> Optional[int]:
    """The bytes of the inline frame that carries ``values`` (header included), or ``None`` if they travel apart:
    more than ``inline_limit`` tensor bytes, a tensor off the CPU, or ``inline_limit == 0``."""
    present = [v for v in values if v is not None]
    total = sum(_padded(v.numel() * v.element_size()) for v in present)
    if not inline_limit or total > inline_limit or any(v.device.type != "cpu" for v in present):
        return None
    return HEADER_BYTES + total


def frames(
    values: Sequence[Optional[Tensor]],
    requires_grad: Sequence[bool],
    structure: Structure,
    tag: Tag,
    inline_limit: int = 0,
    buffer: Optional[Tensor] = None,
) -> list[Tensor]:
    """What goes on the wire for one message, in order: one inline frame if the tensors fit ``inline_limit``
    bytes (and are on the CPU, see :func:`inline_size`), else the header and then each tensor that is not ``None``.

    An inline frame is the start of ``buffer`` (uint8, at least :func:`inline_size` bytes) when one is given: a
    sender reuses its buffers, because fresh ones cost page faults (measured here: a fresh 256 KiB frame per
    message took 0.8 ms, a reused one 20 us; a fresh 4 MiB one 9.8 ms). Tell the framings apart by dtype: only
    inline frames are uint8.
    """
    # a lazy conjugate or negative view (`z.conj()`, a conjugate's `.imag`) holds its values unconjugated and
    # unnegated in memory, with a flag: resolved here, or the wire would carry the memory, not the values
    present = [v.detach().resolve_conj().resolve_neg().contiguous() for v in values if v is not None]
    size = inline_size(present, inline_limit)
    if size is None:
        return [encode(values, requires_grad, structure, tag), *present]
    frame = buffer[:size] if buffer is not None and buffer.numel() >= size else torch.empty(size, dtype=torch.uint8)
    frame[:HEADER_BYTES].view(torch.int64).copy_(encode(values, requires_grad, structure, tag, inline=True))
    offset = HEADER_BYTES
    for value in present:
        nbytes = value.numel() * value.element_size()
        frame[offset : offset + nbytes].copy_(value.reshape(-1).view(torch.uint8))
        offset += _padded(nbytes)
    return [frame]


def inline_values(frame: Tensor, specs: Specs, device: torch.device) -> list[Optional[Tensor]]:
    """The tensors an inline ``frame`` carries, copied out (so that the receiver can reuse ``frame``)."""
    values: list[Optional[Tensor]] = []
    offset = HEADER_BYTES
    for dtype, _, shape in specs:
        if dtype is None:
            values.append(None)
            continue
        value = torch.empty(shape, dtype=dtype, device=device)
        nbytes = value.numel() * value.element_size()
        value.reshape(-1).view(torch.uint8).copy_(frame[offset : offset + nbytes])
        values.append(value)
        offset += _padded(nbytes)
    return values
