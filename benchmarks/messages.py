"""Per-message overhead: the engine's channels against a plain loop of ``send`` and ``recv``, between two processes.

    python benchmarks/messages.py                 # CPU, gloo, here

Two processes bounce one tensor back and forth (ping-pong) ``--iterations`` times per size. The
plain side is ``dist.send``/``dist.recv`` of a tensor whose shape both ends know. The engine side
is what a stage does per message: ``Channels.send`` (a tagged header, then the tensor, non-blocking)
and ``Channels.recv`` (the receiving thread takes the header, allocates, receives, and the main
thread checks the tag). One-way time is half the median round trip; the overhead is the engine's
one-way time minus the plain one. Prints a markdown table and writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time

import _common as C
import torch
import torch.distributed as dist


def _round_trips(send, recv, iterations: int, warmup: int = 20) -> list[float]:
    times = []
    for i in range(warmup + iterations):
        start = time.perf_counter()
        send()
        recv()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def worker(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    from lightning_gpipe.engine.channels import Channels
    from lightning_gpipe.engine.failure import FailureBoard
    from lightning_gpipe.engine.lockstep import check_message
    from lightning_gpipe.engine.messages import Tag
    from lightning_gpipe.engine.topology import PipeLayout

    device = torch.device("cpu")
    C.init_group(device)
    board = FailureBoard.for_default_group(lambda r: f"stage {r}", namespace="messages-benchmark")
    channels = Channels(PipeLayout(world, world), rank, device, board, timeout=600.0)
    peer = 1 - rank
    rows = []
    for size in args.sizes:
        value = torch.randn(size // 4)  # float32: size bytes
        box = torch.empty_like(value)
        call = iter(range(1 << 30))

        def plain_send() -> None:
            dist.send(value, peer)

        def plain_recv() -> None:
            dist.recv(box, peer)

        def engine_send() -> None:
            channels.send(peer, (value,), [False], False, Tag("forward", next(call), 0, "training_step"))

        def engine_recv() -> None:
            message = channels.recv(peer)
            check_message(message, message.tag, "peer", rank)

        # rank 0 sends first; rank 1 answers: each round trip is two messages
        if rank == 0:
            plain = _round_trips(plain_send, plain_recv, args.iterations)
            engine = _round_trips(engine_send, engine_recv, args.iterations)
        else:
            plain = _round_trips(plain_recv, plain_send, args.iterations)
            engine = _round_trips(engine_recv, engine_send, args.iterations)
        channels.flush()
        plain_s, engine_s = statistics.median(plain) / 2, statistics.median(engine) / 2
        rows.append(
            {
                "bytes": size,
                "plain_s": plain_s,
                "engine_s": engine_s,
                "overhead_s": engine_s - plain_s,
                "ratio": engine_s / plain_s,
            }
        )
    channels.close()
    dist.destroy_process_group()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[256, 16 * 2**10, 256 * 2**10, 4 * 2**20], help="message sizes in bytes"
    )
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--out", default=C.default_out("messages"))
    args = parser.parse_args()

    rows = C.launch(worker, 2, args)[0]
    info = C.machine("cpu")
    print(
        f"\nOne message between two processes (gloo, CPU), half the median of {args.iterations} round trips\n"
        f"{C.describe_machine(info)}\n"
    )
    print(
        C.markdown(
            ["bytes", "plain send/recv us", "engine us", "engine overhead us", "engine / plain"],
            [
                [
                    r["bytes"],
                    f"{1e6 * r['plain_s']:.0f}",
                    f"{1e6 * r['engine_s']:.0f}",
                    f"{1e6 * r['overhead_s']:+.0f}",
                    f"{r['ratio']:.2f}",
                ]
                for r in rows
            ],
        )
    )
    C.write_json(args.out, {"machine": info, "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
