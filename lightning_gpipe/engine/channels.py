"""Point-to-point channels between stages over torch.distributed: one sending link and one receiving inbox a pair.

Every directed pair of ranks that talks gets a process group of its own, used by one sending thread
(the sender's main thread, with non-blocking ``isend``) and one receiving thread (an :class:`Inbox`).
The inbox thread posts the next receive as soon as the last one lands, so a message travels while
the receiver computes; the main thread only takes finished messages from a queue, and while it waits
it checks the failure board, so a failed peer never leaves it hanging. What a message holds, and
how it is cut into frames on the wire, is :mod:`lightning_gpipe.engine.messages`: over gloo on the
CPU a small message is one inline frame, so it costs one operation instead of two.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from datetime import timedelta
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gpipe.engine.distributed import backend_for, new_group
from lightning_gpipe.engine.failure import FailureBoard, PipelineError
from lightning_gpipe.engine.messages import (
    HEADER_BYTES,
    HEADER_LEN,
    INLINE_LIMIT,
    Message,
    Specs,
    Tag,
    close_header,
    decode,
    frames,
    inline_size,
    inline_values,
    is_inline,
)
from lightning_gpipe.engine.structure import Structure
from lightning_gpipe.engine.topology import PipeLayout

__all__ = ["Channels", "Inbox", "Link"]

#: Receives block in a thread for as long as a peer is quiet (validation, a checkpoint write), so the
#: transport's own timeout is effectively off; the bound on a wait is enforced by Inbox.get instead.
_FOREVER = timedelta(days=365)
#: Frame sizes a link keeps spare buffers of: a pipeline's messages repeat their sizes every step, and a few
#: sizes cover them (activations, gradients, the output share); the least recently used size is dropped.
_FRAME_SIZES = 8
#: Inline sends of one size a link lets run before it waits for the oldest and reuses its buffer: by then that
#: one has been delivered (the peer's inbox always has a receive posted), so the wait returns at once.
_IN_FLIGHT = 2


class Link:
    """The sending end of one directed pair: non-blocking sends that are waited for at :meth:`flush`."""

    def __init__(
        self, group: dist.ProcessGroup, dst: int, name: str, board: FailureBoard, inline_limit: int = 0
    ) -> None:
        self.group, self.dst, self.name, self.inline_limit = group, dst, name, inline_limit
        self.board = board  # where a broken send looks for the peer's own account of its failure
        self._pending: list[tuple[dist.Work, Tensor, Optional[Tensor]]] = []  # (work, frame, its pooled buffer)
        # Inline frame buffers whose sends completed, by size, for reuse (see `frames`). Gloo reports a send
        # complete only once it is waited for (measured: still not 0.5 s after the peer had it), so a buffer
        # comes back when `_take` waits for the oldest of its size, or at `flush`.
        self._spare: OrderedDict[int, list[Tensor]] = OrderedDict()
        self.bytes_sent = 0  # tensor payload so far, headers aside: what a traffic count compares

    def send(
        self, values: Sequence[Optional[Tensor]], requires_grad: Sequence[bool], structure: Structure, tag: Tag
    ) -> None:
        """Start sending ``values``; the tensors are kept alive until they are delivered."""
        self._reclaim(wait=False)
        size = inline_size(values, self.inline_limit)
        buffer = self._take(size) if size is not None else None
        for frame in frames(values, requires_grad, structure, tag, self.inline_limit, buffer):
            self._isend(frame, buffer if frame.dtype == torch.uint8 else None)
        self.bytes_sent += sum(v.numel() * v.element_size() for v in values if v is not None)

    def _take(self, size: int) -> Tensor:
        """A frame buffer of ``size`` bytes: a spare one, the oldest in flight once ``_IN_FLIGHT`` are, or a new one."""
        spare = self._spare.get(size)
        if spare:
            self._spare.move_to_end(size)
            return spare.pop()
        mine = [j for j, (_, _, pooled) in enumerate(self._pending) if pooled is not None and pooled.numel() == size]
        if len(mine) < _IN_FLIGHT:
            return torch.empty(size, dtype=torch.uint8)
        work, _, pooled = self._pending.pop(mine[0])
        try:
            work.wait()
        except RuntimeError as error:  # the peer's own account first: a layer of it raised, and it ended
            raise self._lost(error) from error
        assert pooled is not None
        return pooled

    def _isend(self, tensor: Tensor, pooled: Optional[Tensor] = None) -> None:
        try:
            work = dist.isend(tensor, self.dst, group=self.group)
        except RuntimeError as error:  # gloo's "Connection closed by peer [127.0.0.1]:8599" names no stage
            raise self._lost(error) from error
        if work is None:  # torch's answer for a rank outside the group
            raise PipelineError(f"Cannot send to {self.name}: this rank is not in the pair's process group.")
        self._pending.append((work, tensor, pooled))

    def _reclaim(self, wait: bool) -> None:
        """Drop finished sends (all of them, waiting, with ``wait``); their pooled buffers become spare."""
        pending = []
        try:
            for work, tensor, pooled in self._pending:
                if wait:
                    work.wait()
                elif not work.is_completed():
                    pending.append((work, tensor, pooled))
                    continue
                if pooled is not None:
                    self._spare.setdefault(pooled.numel(), []).append(pooled)
                    self._spare.move_to_end(pooled.numel())
        except RuntimeError as error:  # the transport's error says which address failed, not which stage
            raise self._lost(error) from error
        self._pending = pending
        while len(self._spare) > _FRAME_SIZES:
            self._spare.popitem(last=False)

    def _lost(self, error: RuntimeError) -> PipelineError:
        """The error for a send the transport broke: the failure a peer published, if one comes within a second (a
        killed peer publishes nothing; the store's host, rank 0, takes the store with it, which the board names),
        else the stage, named by the heartbeats that stopped."""
        account = self.board.wait_for_failure(1.0)
        if account is not None:
            return PipelineError(account)
        return self.board.lost(f"a send to {self.name}", error)

    def flush(self) -> None:
        """Wait until everything sent so far has been received."""
        self._reclaim(wait=True)

    def close(self) -> None:
        """Tell the peer's inbox that no more messages come."""
        self._isend(close_header())
        self.flush()


class Inbox:
    """The receiving end of one directed pair: a thread that receives messages in order into a queue."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        src: int,
        device: torch.device,
        name: str,
        board: FailureBoard,
        timeout: float,
        inline_limit: int = 0,
    ) -> None:
        self.group, self.src, self.device, self.name = group, src, device, name
        self.board, self.timeout, self.inline_limit = board, timeout, inline_limit
        self._queue: "queue.Queue[tuple[float, object]]" = queue.Queue()  # (arrival time, item)
        self._thread = threading.Thread(target=self._receive, name=f"lightning-gpipe-inbox-{src}", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # With inline frames, every receive is posted for the largest frame, which the transport fills
        # only as far as the sender's frame goes; the buffer is reused, as inline values are copied out.
        frame = torch.empty(HEADER_BYTES + self.inline_limit, dtype=torch.uint8) if self.inline_limit else None
        try:
            while True:
                if frame is not None:
                    dist.recv(frame, self.src, group=self.group)
                    header = frame[:HEADER_BYTES].view(torch.int64)
                else:
                    header = torch.empty(HEADER_LEN, dtype=torch.int64)
                    dist.recv(header, self.src, group=self.group)
                decoded = decode(header)
                if decoded is None:
                    self._queue.put((time.monotonic(), None))
                    return
                specs, tag, structure = decoded
                inline = frame is not None and is_inline(header)
                values = inline_values(frame, specs, self.device) if frame is not None and inline else self._each(specs)
                message = Message(tuple(values), tuple(f for _, f, _ in specs), structure, tag)
                self._queue.put((time.monotonic(), message))
        except BaseException as error:  # a dead peer closes the connection: hand the error to the main thread
            self._queue.put((time.monotonic(), error))

    def _each(self, specs: Specs) -> list[Optional[Tensor]]:
        """The tensors of a message that sends each in a frame of its own, after the header.

        Every receive is posted before any is waited for, so the transport moves the frames back to back
        (one posted and waited at a time stalled a 450 KiB pair of tensors for 2-14 ms while its sender computed).
        """
        values: list[Optional[Tensor]] = []
        works = []
        for dtype, _, shape in specs:
            if dtype is None:
                values.append(None)
                continue
            value = torch.empty(shape, dtype=dtype, device=self.device)
            works.append(dist.irecv(value, self.src, group=self.group))
            values.append(value)
        for work in works:
            assert work is not None  # this rank is in the pair's group: the inbox was made for it
            work.wait()
        return values

    def get(self) -> Message:
        """The next message; raises :class:`PipelineError` if a peer failed or nothing came for ``timeout`` s."""
        start = time.monotonic()
        while True:
            try:
                _, item = self._queue.get(timeout=0.05)
            except queue.Empty:
                self.board.raise_if_failed()
                if time.monotonic() - start > self.timeout:
                    raise PipelineError(
                        f"No message from {self.name} for {self.timeout:.0f}s; it is hung or gone (a layer that never "
                        "returns: its own log shows where, once it ends), or computing that long: a stage that "
                        "computes is never taken for a hung one, so `failure_timeout` does not cover it. Raise "
                        "`timeout` (GPipeStrategy(timeout=...), or GPipe(timeout=...) without Lightning) if a stage "
                        "really needs that long."
                    ) from None
                continue
            if isinstance(item, Message):
                return item
            # prefer the peer's own account of its failure: a peer whose layer raised closes its links at once, and
            # the board's poller sees its published error within a poll or two
            account = self.board.wait_for_failure(1.0)
            if item is None:
                raise PipelineError(
                    account or f"{self.name} closed its link while this stage still expected a message."
                )
            error = item if isinstance(item, BaseException) else None
            raise PipelineError(account or f"Lost the connection to {self.name}: {item}") from error

    def waiting(self) -> Optional[tuple[float, Message]]:
        """The oldest message not taken yet and how many seconds it has waited, if there is one."""
        try:
            arrived, item = self._queue.queue[0]  # a peek; only this rank's main thread takes items
        except IndexError:
            return None
        return (time.monotonic() - arrived, item) if isinstance(item, Message) else None

    def join(self, timeout: float) -> None:
        """Wait for the close message that ends the thread."""
        self._thread.join(timeout)


class Channels:
    """All links and inboxes of one rank, built collectively by every rank of the job.

    The pairs that talk in a pipeline ``s_0 .. s_{K-1}``: neighbours both ways (activations forward,
    gradients backward), the last stage to every other (the shared output), the first stage to every
    other (the gradient of the pipeline input, when it needs one), and both ways between the stages of
    each ``skips`` pair (stash stage, pop stage), so that a skip passes no stage in between.
    """

    def __init__(
        self,
        layout: PipeLayout,
        rank: int,
        device: torch.device,
        board: FailureBoard,
        timeout: float,
        backend: Optional[str] = None,
        skips: Iterable[tuple[int, int]] = (),
    ) -> None:
        self.rank = rank
        self.links: dict[int, Link] = {}
        self.inboxes: dict[int, Inbox] = {}
        self._groups: list[dist.ProcessGroup] = []
        backend = backend or backend_for(device)
        # inline frames need a transport that fills a longer receive buffer partly: gloo, on the CPU
        inline = INLINE_LIMIT if backend == "gloo" and device.type == "cpu" else 0
        pairs: set[tuple[int, int]] = set()
        for ranks in layout.pipelines:
            for a, b in zip(ranks, ranks[1:]):
                pairs |= {(a, b), (b, a)}
            pairs |= {(ranks[-1], r) for r in ranks[:-1]} | {(ranks[0], r) for r in ranks[1:]}
            for a, b in skips:
                pairs |= {(ranks[a], ranks[b]), (ranks[b], ranks[a])}
        for src, dst in sorted(pairs):  # every rank creates every group, in the same order
            group = new_group([src, dst], backend, _FOREVER)
            if group is None:  # this rank is not one of the pair
                continue
            if rank == src:
                self.links[dst] = Link(group, dst, f"stage {layout.stage_of(dst)} (rank {dst})", board, inline)
            if rank == dst:
                stage = layout.stage_of(src)
                self.inboxes[src] = Inbox(group, src, device, f"stage {stage} (rank {src})", board, timeout, inline)
            self._groups.append(group)

    def send(
        self,
        dst: int,
        values: Sequence[Optional[Tensor]],
        requires_grad: Sequence[bool],
        structure: Structure,
        tag: Tag,
    ) -> None:
        """Start sending ``values`` to rank ``dst``."""
        self.links[dst].send(values, requires_grad, structure, tag)

    def bytes_sent(self) -> dict[int, int]:
        """Tensor bytes sent so far to each peer rank (headers aside)."""
        return {dst: link.bytes_sent for dst, link in self.links.items()}

    def recv(self, src: int) -> Message:
        """The next message from rank ``src``."""
        return self.inboxes[src].get()

    def flush(self) -> None:
        """Wait until every message sent so far was received."""
        for link in self.links.values():
            link.flush()

    def stray(self, older_than: float) -> Optional[tuple[str, Message]]:
        """A message that has waited longer than ``older_than`` seconds, and who sent it, if there is one.

        Outside a backbone call, every message a peer sent should have been taken already: one that
        waits while this rank is blocked in a collective of the whole pipeline belongs to a call
        that this rank never made.
        """
        for inbox in self.inboxes.values():
            found = inbox.waiting()
            if found is not None and found[0] > older_than:
                return inbox.name, found[1]
        return None

    def close(self, timeout: float = 60.0) -> None:
        """End every inbox thread (peers do the same for ours) and free the groups; call on every rank."""
        for link in self.links.values():
            link.close()
        for inbox in self.inboxes.values():
            inbox.join(timeout)
        for group in self._groups:
            dist.destroy_process_group(group)
        self.links.clear()
        self.inboxes.clear()
        self._groups.clear()
