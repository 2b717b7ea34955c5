"""How long a message takes between two stages: a latency plus bytes over a bandwidth; and measuring both.

The planner needs the link only to time the activations and gradients that cross stage boundaries and
the output share at the end of the fill. A straight line in the message size is what gloo over
loopback and NCCL over NVLink both look like at the sizes a pipeline sends (kilobytes to hundreds of
megabytes), so two numbers describe it: measured here with :func:`measure_link` (a ping between two
ranks of a process group), or given by the user for a machine they plan for.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["LinkModel", "measure_link"]


@dataclass(frozen=True)
class LinkModel:
    """A message of ``n`` bytes arrives ``latency + n / bandwidth`` seconds after it is sent.

    >>> LinkModel(bandwidth=1e9, latency=1e-4).seconds(10**6)
    0.0011
    """

    bandwidth: float = float("inf")  # bytes per second
    latency: float = 0.0  # seconds

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise ValueError(f"A link's bandwidth must be a positive number of bytes per second, got {self.bandwidth}.")
        if not self.latency >= 0:
            raise ValueError(f"A link's latency must be a non-negative number of seconds, got {self.latency}.")

    def seconds(self, nbytes: float) -> float:
        """Seconds from the send of ``nbytes`` to its arrival."""
        return self.latency + nbytes / self.bandwidth


def measure_link(
    peer: int,
    sizes: tuple[int, int] = (4, 1 << 22),
    repeats: int = 10,
    device: Optional[torch.device] = None,
    group: Optional[dist.ProcessGroup] = None,
) -> LinkModel:
    """Ping-pong ``repeats`` messages of each of two ``sizes`` (bytes) with rank ``peer``; collective for the two.

    Both ranks call it (each naming the other) and both get the same model: the latency is half the
    small message's median round trip, the bandwidth the large message's extra bytes over its extra
    time. The rank with the smaller number sends first.
    """
    rank = dist.get_rank()  # global ranks, as `peer` is
    device = device if device is not None else torch.device("cpu")
    halves: list[float] = []
    for size in sizes:
        buffer = torch.zeros(max(size // 4, 1), dtype=torch.float32, device=device)
        trips = []
        for attempt in range(repeats + 1):
            start = time.perf_counter()
            if rank < peer:
                dist.send(buffer, peer, group=group)
                dist.recv(buffer, peer, group=group)
            else:
                dist.recv(buffer, peer, group=group)
                dist.send(buffer, peer, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if attempt:  # the first message sets up the connection
                trips.append(time.perf_counter() - start)
        halves.append(statistics.median(trips) / 2)
    latency = halves[0]
    extra_bytes = 4 * (max(sizes[1] // 4, 1) - max(sizes[0] // 4, 1))
    extra_seconds = max(halves[1] - halves[0], 1e-9)
    shared = torch.tensor([latency, extra_bytes / extra_seconds], dtype=torch.float64)
    if rank > peer:  # both ranks keep the first rank's numbers, so that they plan alike
        dist.recv(shared, peer, group=group)
    else:
        dist.send(shared, peer, group=group)
    return LinkModel(bandwidth=float(shared[1]), latency=float(shared[0]))
