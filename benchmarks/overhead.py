"""Overhead: a training step through ``Trainer(strategy=GPipeStrategy(...))`` against the bare engine, same model.

    python benchmarks/overhead.py                        # K=2, M=8 on CPU here

Both sides train the same backbone on the same batch, with the same split, micro-batches and
checkpoint mode, an SGD step included. The engine side is a plain loop over ``GPipe``; the Trainer
side is what a Lightning user runs: a LightningModule whose ``training_step`` calls the backbone,
computes the loss and logs it with ``self.log``, and Lightning's loop, hooks and optimizer handling
around it (no logger, checkpointing or progress bar, which cost the same with any strategy; batches
come ready-made, so collation is not counted either). The two alternate in ABBA order inside one set
of processes over ``--repeats``, so a drifting machine affects both alike; the overhead is the
median Trainer step over the median engine step, minus one (target: at most 5%).

It also prices the trust checks inside every step (target: at most 1% of the engine step): the
batch fingerprint each stage takes, and the tag of every message (encoded by the sender, decoded and
checked by the receiver), counted for the messages one rank handles per step: ``2 * chunks + 2``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import _common as C
import torch


def _median_seconds(fn, repeats: int = 50) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def check_seconds(workload: C.Workload, batch_size: int, chunks: int, device: torch.device) -> dict[str, float]:
    """What the lock-step checks and the batch fingerprint cost per step on one rank, in seconds."""
    from lightning_gpipe.engine.lockstep import check_message
    from lightning_gpipe.engine.messages import Message, Tag, decode, encode
    from lightning_gpipe.engine.microbatch import fingerprint

    x, y = workload.batch(batch_size, device)
    micro = x[: max(1, batch_size // chunks)]
    tag = Tag("forward", 12, 3, "training_step", fingerprint((x, y)))

    def message() -> None:
        specs, got, structure = decode(encode((micro,), (True,), False, tag))
        check_message(Message((micro,), (True,), structure, got), tag, "stage 0 (rank 0)", 1)

    per_message, per_batch = _median_seconds(message), _median_seconds(lambda: fingerprint((x, y)))
    messages = 2 * chunks + 2
    return {
        "fingerprint_s": per_batch,
        "message_s": per_message,
        "messages": messages,
        "checks_s": per_batch + messages * per_message,
    }


def worker(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    from lightning_gpipe import GPipeStrategy

    device = C.device_for(rank, args.device)
    C.init_group(device)
    rows = []
    for workload in C.workloads(args.models, args):
        split = C.pipeline_balance(workload, world, max(1, args.batch_size // args.chunks), device)
        times: dict[str, list[float]] = {"engine": [], "trainer": []}

        def engine() -> float:
            pipe, step = C.gpipe_step(workload, args.chunks, args.checkpoint, args.batch_size, device, split)
            try:
                return C.step_seconds(step, device, args.warmup, args.steps)
            finally:
                pipe.close()

        def trainer() -> float:
            strategy = GPipeStrategy(balance=split, chunks=args.chunks, checkpoint=args.checkpoint)
            return C.lightning_step_seconds(workload, strategy, world, args.batch_size, device, args.warmup, args.steps)

        for repeat in range(args.repeats):
            for side in ("engine", "trainer") if repeat % 2 == 0 else ("trainer", "engine"):
                times[side].append((engine if side == "engine" else trainer)())
        engine_s, trainer_s = statistics.median(times["engine"]), statistics.median(times["trainer"])
        checks = check_seconds(workload, args.batch_size, args.chunks, device)
        rows.append(
            {
                "model": workload.name,
                "describe": workload.describe,
                "stages": world,
                "chunks": args.chunks,
                "engine_step_s": engine_s,
                "trainer_step_s": trainer_s,
                "overhead": trainer_s / engine_s - 1,
                "runs": times,
                **checks,
                "checks_share": checks["checks_s"] / engine_s,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default=C.default_device())
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--checkpoint", default="except_last", choices=["always", "except_last", "never"])
    parser.add_argument(
        "--models", nargs="+", default=["amoebanet", "transformer"], choices=["amoebanet", "transformer"]
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=6, help="fits of each side, in ABBA order")
    parser.add_argument("--out", default=C.default_out("overhead"))
    C.add_workload_arguments(parser)
    args = parser.parse_args()

    rows = C.launch(worker, args.stages, args)[0]
    info = C.machine(args.device)
    print(
        f"\nTrainer over bare engine at K={args.stages}, M={args.chunks}, checkpoint={args.checkpoint!r}, batch "
        f"{args.batch_size}, {args.device}, median of {args.repeats} fits of {args.steps} steps each\n"
        f"{C.describe_machine(info)}\n"
    )
    print(
        C.markdown(
            ["model", "engine step ms", "Trainer step ms", "overhead", "Trainer runs ms", "engine runs ms"],
            [
                [
                    r["describe"],
                    f"{1e3 * r['engine_step_s']:.1f}",
                    f"{1e3 * r['trainer_step_s']:.1f}",
                    f"{100 * r['overhead']:+.1f}%",
                    " ".join(f"{1e3 * t:.0f}" for t in r["runs"]["trainer"]),
                    " ".join(f"{1e3 * t:.0f}" for t in r["runs"]["engine"]),
                ]
                for r in rows
            ],
        )
    )
    print("\nTrust checks per step on one rank: the batch fingerprint, and the tag of each message it handles\n")
    print(
        C.markdown(
            ["model", "fingerprint ms", "tag per message us", "messages", "checks ms", "share of step"],
            [
                [
                    r["describe"],
                    f"{1e3 * r['fingerprint_s']:.3f}",
                    f"{1e6 * r['message_s']:.1f}",
                    r["messages"],
                    f"{1e3 * r['checks_s']:.3f}",
                    f"{100 * r['checks_share']:.2f}%",
                ]
                for r in rows
            ],
        )
    )
    C.write_json(args.out, {"machine": info, "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
