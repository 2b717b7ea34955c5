"""What the benchmarks in this folder share: workloads, process launch, step timing, the machine, tables, JSON.

Every benchmark measures ratios inside one run (a pipeline against one process, against a peer), so
the figures survive a noisy, shared machine; the absolute times are printed beside them for context.
Processes are started as torchrun would start them (see :mod:`lightning_gpipe.launch`), so one spawn of K
processes can run many configurations, and Lightning inside them uses the TorchElastic environment
instead of launching processes of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_gpipe import GPipe, balance, profile_layers
from lightning_gpipe.engine.distributed import default_backend
from lightning_gpipe.launch import run_ok
from lightning_gpipe.models import amoebanetd, unet

HERE = os.path.dirname(os.path.abspath(__file__))

# -- workloads -----------------------------------------------------------------------------------------


class MeanPoolClassifier(nn.Module):
    """Mean over the sequence, then logits: the last layer of the Transformer stack."""

    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x.mean(dim=1))


@dataclass(frozen=True)
class Workload:
    """A backbone and its data: ``build()`` gives the Sequential, ``batch(n, device)`` an ``(x, y)`` batch,
    ``loss(output, y)`` the training loss (cross-entropy on class labels unless the workload says otherwise)."""

    name: str
    describe: str
    build: Callable[[], nn.Sequential]
    batch: Callable[[int, torch.device], tuple[Tensor, Tensor]]
    loss: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy


CLASSES = 10


def amoebanet_workload(layers: int = 6, filters: int = 32, image: int = 32) -> Workload:
    """AmoebaNet-D (L, D) with the small stem on ``image``-pixel RGB images: activation-heavy convolutions."""

    def batch(n: int, device: torch.device) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(n)
        return (
            torch.randn(n, 3, image, image, generator=g).to(device),
            torch.randint(0, CLASSES, (n,), generator=g).to(device),
        )

    return Workload(
        "amoebanet",
        f"AmoebaNet-D ({layers}, {filters}), {image}x{image} images",
        lambda: amoebanetd(CLASSES, layers, filters, stem="small"),
        batch,
    )


def transformer_workload(blocks: int = 8, width: int = 128, heads: int = 4, sequence: int = 32) -> Workload:
    """A stack of pre-norm Transformer encoder blocks on ``sequence`` tokens, then a mean-pool classifier."""

    def build() -> nn.Sequential:
        layers: list[nn.Module] = [
            nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(blocks)
        ]
        return nn.Sequential(*layers, MeanPoolClassifier(width, CLASSES))

    def batch(n: int, device: torch.device) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(n)
        return (
            torch.randn(n, sequence, width, generator=g).to(device),
            torch.randint(0, CLASSES, (n,), generator=g).to(device),
        )

    return Workload(
        "transformer", f"{blocks} Transformer blocks, width {width}, {heads} heads, {sequence} tokens", build, batch
    )


def unet_workload(depth: int = 3, num_convs: int = 2, channels: int = 16, image: int = 32) -> Workload:
    """torchgpipe's simplified U-Net (``depth``, B = ``num_convs``, C = ``channels``) on ``image``-pixel RGB images,
    a per-pixel binary mask as the target (BCE): long skip connections from every encoder level to its decoder."""

    def batch(n: int, device: torch.device) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(n)
        return (
            torch.randn(n, 3, image, image, generator=g).to(device),
            (torch.rand(n, 1, image, image, generator=g) < 0.5).float().to(device),
        )

    return Workload(
        "unet",
        f"U-Net (B={num_convs}, C={channels}), depth {depth}, {image}x{image} images",
        lambda: unet(depth, num_convs, channels),
        batch,
        F.binary_cross_entropy_with_logits,
    )


def workloads(names: Sequence[str], args: argparse.Namespace) -> list[Workload]:
    """The workloads named, at the sizes given by the common arguments."""
    made = {
        "amoebanet": lambda: amoebanet_workload(args.amoebanet_layers, args.amoebanet_filters, args.image),
        "transformer": lambda: transformer_workload(args.blocks, args.width, sequence=args.sequence),
        "unet": lambda: unet_workload(args.unet_depth, args.unet_convs, args.unet_channels, args.unet_image),
    }
    return [made[n]() for n in names]


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--amoebanet-layers", type=int, default=6, help="AmoebaNet-D L (normal cells)")
    parser.add_argument("--amoebanet-filters", type=int, default=32, help="AmoebaNet-D D (filters)")
    parser.add_argument("--image", type=int, default=32, help="image side for AmoebaNet")
    parser.add_argument("--blocks", type=int, default=8, help="Transformer blocks")
    parser.add_argument("--width", type=int, default=128, help="Transformer width")
    parser.add_argument("--sequence", type=int, default=32, help="Transformer tokens per sample")
    parser.add_argument("--unet-depth", type=int, default=3, help="U-Net levels")
    parser.add_argument("--unet-convs", type=int, default=2, help="U-Net B (convolution units per level)")
    parser.add_argument("--unet-channels", type=int, default=16, help="U-Net C (channels of the top level)")
    parser.add_argument("--unet-image", type=int, default=32, help="image side for the U-Net")


# -- processes, devices, timing ------------------------------------------------------------------------


def device_for(rank: int, kind: str) -> torch.device:
    """This rank's device: its own GPU with ``kind == "cuda"``, else the CPU."""
    if kind == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_group(device: torch.device) -> None:
    """The default process group from the torchrun environment the launcher set: NCCL on GPUs, gloo on CPUs."""
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"timeout": timedelta(minutes=10)}
        if device.type == "cuda":
            kwargs["device_id"] = device
        dist.init_process_group(default_backend(device), **kwargs)


def launch(fn: Callable[..., Any], processes: int, *args: Any, threads: int = 1, timeout: float = 3000.0) -> list:
    """``fn(rank, processes, *args)`` in ``processes`` fresh processes with ``threads`` threads each (see
    :mod:`lightning_gpipe.launch`); the per-rank results."""
    return run_ok(fn, processes, *args, timeout=timeout, threads=threads)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_seconds(step: Callable[[], None], device: torch.device, warmup: int, steps: int) -> float:
    """Median wall time of ``steps`` calls of ``step`` after ``warmup`` calls, the slowest rank's if distributed.

    The ranks of a pipeline finish a step together (the backward ends on the first stage, which every
    stage then waits for at the next step), so the slowest rank's median is the pipeline's step time.
    """
    for _ in range(warmup):
        step()
    synchronize(device)
    if dist.is_initialized():
        dist.barrier()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return slowest_rank(statistics.median(times))


def slowest_rank(seconds: float) -> float:
    """The largest of every rank's ``seconds`` (collective when distributed): a pipeline is as fast as its slowest."""
    if not dist.is_initialized():
        return seconds
    every: list[Optional[float]] = [None] * dist.get_world_size()
    dist.all_gather_object(every, seconds)
    return max(s for s in every if s is not None)


def pipeline_balance(
    workload: Workload, stages: int, micro_batch: int, device: torch.device, cost: str = "time"
) -> list[int]:
    """The split by measured ``cost`` (as ``balance="time"`` or ``"memory"``), profiled on rank 0 and broadcast."""
    if stages == 1:
        return [len(workload.build())]
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        x, _ = workload.batch(micro_batch, torch.device("cpu"))
        box[0] = balance(profile_layers(workload.build(), x, device).of(cost), stages)
    dist.broadcast_object_list(box, src=0)
    return box[0]


def sgd(parameters: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.01)


def gpipe_step(
    workload: Workload,
    chunks: int,
    checkpoint: str,
    batch_size: int,
    device: torch.device,
    split: list[int],
    make_optimizer: Callable[[Any], torch.optim.Optimizer] = sgd,
    **options: Any,
) -> tuple[GPipe, Callable[[], None]]:
    """A ``GPipe`` of the workload and one training step of it (the bare engine, no Lightning); SGD by default.
    ``options`` go to ``GPipe`` (``split_backward=True``)."""
    torch.manual_seed(0)
    pipe = GPipe(workload.build(), split, chunks=chunks, checkpoint=checkpoint, device=device, **options)
    optimizer = make_optimizer(pipe.parameters())
    x, y = workload.batch(batch_size, device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        workload.loss(pipe(x), y).backward()
        optimizer.step()

    return pipe, step


# -- reporting -----------------------------------------------------------------------------------------


def machine(device: str) -> dict[str, Any]:
    """What the figures were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device,
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
    try:
        import lightning

        info["lightning"] = lightning.__version__
    except ImportError:
        pass
    return info


def describe_machine(info: dict[str, Any]) -> str:
    gpu = f", {info['gpus']} x {info['gpu']}" if "gpu" in info else ""
    return f"{info['cores']} cores ({info['cpu']}){gpu}; Python {info['python']}, torch {info['torch']}" + (
        f", Lightning {info['lightning']}" if "lightning" in info else ""
    )


def markdown(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table: the first column left-aligned, the figures right-aligned."""
    rule = ["---"] + ["---:"] * (len(headers) - 1)
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: str, payload: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"\nwrote {path}")


def default_out(name: str) -> str:
    return os.path.join(HERE, "results", f"{name}.json")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# -- through the Trainer -------------------------------------------------------------------------------


def lightning_step_seconds(
    workload: Workload, strategy: Any, devices: int, batch_size: int, device: torch.device, warmup: int, steps: int
) -> float:
    """Median step time of ``Trainer.fit`` on the workload: what a Lightning user's step costs.

    The loader yields ready-made batches (``batch_size=None``), so the time is the Trainer's and the
    model's, not the collation's. With several processes and no pipeline (DDP), each process gets
    ``batch_size / devices`` samples: the global batch stays ``batch_size``.
    """
    import logging

    import lightning as L
    from torch.utils.data import DataLoader

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # the split table, tips: not the benchmark's

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = workload.build()

        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            x, y = batch
            loss = workload.loss(self.backbone(x), y)
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def on_train_batch_start(self, *args: Any) -> None:
            synchronize(device)
            self.stamps.append(time.perf_counter())

        def on_train_end(self, *args: Any) -> None:
            synchronize(device)
            self.stamps.append(time.perf_counter())

    pipelined = not isinstance(strategy, str)
    local = batch_size if pipelined or devices == 1 else batch_size // devices
    x, y = workload.batch(batch_size, torch.device("cpu"))
    rank = dist.get_rank() if dist.is_initialized() and not pipelined else 0
    shard = (x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local])
    torch.manual_seed(0)
    clock = Clock()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator=device.type,
        devices=devices,
        max_steps=warmup + steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[clock],
    )
    trainer.fit(Net(), DataLoader([shard] * (warmup + steps), batch_size=None))
    times = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])][warmup:]
    return slowest_rank(statistics.median(times))
