"""Random Sequentials for `test_random_models.py`: layers drawn from a seed, run through GPipe and one process.

Each model mixes what a stage boundary has to carry and what a stage has to run: tuples split and joined again,
a non-contiguous view, a parameter broadcast with ``expand``, in-place layers (also first on a stage), frozen
layers, parameter-free layers, LayerNorm. Splits, ``chunks``, batch sizes (some smaller than ``chunks``) and
checkpoint modes are drawn too, so the cases are ones no hand-written test picked.
"""

from __future__ import annotations

import random
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

FEATURES, WIDTH, CLASSES, STEPS = 5, 8, 3, 3


class Halves(nn.Module):
    """A tuple out: the two halves of the features."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x[:, : x.shape[1] // 2], x[:, x.shape[1] // 2 :]


class Join(nn.Module):
    """The halves back into one tensor, as they are or each changed."""

    def __init__(self, changed: bool) -> None:
        super().__init__()
        self.changed = changed

    def forward(self, halves: tuple[Tensor, Tensor]) -> Tensor:
        a, b = halves
        return torch.cat([a * 2, b.tanh()] if self.changed else [a, b], 1)


class Strided(nn.Module):
    """A non-contiguous view out (every second column of a copy twice as wide), never of the input's memory.

    A view of the input itself would make an in-place layer after it write the stage's input for some micro-batch
    sizes only, which checkpointing refuses by name (``stage_input.py``).
    """

    def forward(self, x: Tensor) -> Tensor:
        return x.repeat(1, 2)[:, ::2]


class Offset(nn.Module):
    """A parameter broadcast over the batch with ``expand``."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = nn.Parameter(torch.randn(1, WIDTH))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.offset.expand(x.shape[0], -1)


class AddOne(nn.Module):
    """In place, on whatever comes in (a received activation where it starts a stage)."""

    def forward(self, x: Tensor) -> Tensor:
        return x.add_(1.0)


def _layer(kind: str, rng: random.Random) -> list[nn.Module]:
    if kind == "linear":
        return [nn.Linear(WIDTH, WIDTH)]
    if kind == "frozen":
        return [nn.Linear(WIDTH, WIDTH).requires_grad_(False)]
    if kind == "halves":
        return [Halves(), Join(rng.random() < 0.5)]
    return [
        {
            "tanh": nn.Tanh,
            "leaky_inplace": lambda: nn.LeakyReLU(0.1, inplace=True),
            "norm": lambda: nn.LayerNorm(WIDTH),
            "view": Strided,
            "offset": Offset,
            "identity": nn.Identity,
            "add_one": AddOne,
        }[kind]()
    ]


#: what a layer may be ("linear" twice: most models are mostly weights)
KINDS = ["linear", "linear", "frozen", "halves", "tanh", "leaky_inplace", "norm", "view", "offset", "identity"]
KINDS += ["add_one"]


def build(seed: int) -> nn.Sequential:
    """The model of ``seed``: the same layers and initial weights in every process."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(FEATURES, WIDTH)]
    for _ in range(rng.randint(2, 9)):
        layers += _layer(rng.choice(KINDS), rng)
    return nn.Sequential(*layers, nn.Linear(WIDTH, CLASSES))


def _runs_on_one_device(seed: int) -> bool:
    """Whether one process can train the model at every batch size drawn (an in-place layer after a layer whose
    backward needs its output fails there, as it would in the pipeline)."""
    try:
        for size in range(1, 14):
            F.cross_entropy(build(seed)(torch.randn(size, FEATURES)), torch.zeros(size, dtype=torch.long)).backward()
    except RuntimeError:
        return False
    return True


def case(seed: int, stages: int) -> Optional[dict[str, Any]]:
    """The split, ``chunks``, batch size and checkpoint mode of ``seed`` for ``stages``; None where it cannot run."""
    rng = random.Random(seed * 7 + stages)
    layers = len(build(seed))
    if layers < stages or not _runs_on_one_device(seed):
        return None
    bounds = [0, *sorted(rng.sample(range(1, layers), stages - 1)), layers]
    chunks = rng.randint(1, 5)
    short = chunks > 1 and rng.random() < 0.3  # a batch smaller than `chunks`: fewer, smaller micro-batches
    return {
        "balance": [b - a for a, b in zip(bounds, bounds[1:])],
        "chunks": chunks,
        "batch": rng.randint(1, chunks - 1) if short else rng.randint(1, 13),
        "checkpoint": rng.choice(["always", "except_last", "never"]),
    }


def compare(rank: int, world_size: int, seeds: list[int]) -> list[dict[str, Any]]:
    """For each seed: the largest difference in loss over the steps and in this stage's weights after them."""
    from lightning_gpipe import GPipe

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results = []
    for seed in seeds:
        settings = case(seed, world_size)
        if settings is None:
            continue
        reference, pipe = build(seed), GPipe(build(seed), **{k: v for k, v in settings.items() if k != "batch"})
        trained = [p for p in pipe.parameters() if p.requires_grad] or [torch.zeros(1, requires_grad=True)]
        optimizers = [
            torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1, momentum=0.9),
            torch.optim.SGD(trained, lr=0.1, momentum=0.9),  # a stage may hold nothing to train
        ]
        data = torch.Generator().manual_seed(seed)
        losses = 0.0
        for _ in range(STEPS):
            x = torch.randn(settings["batch"], FEATURES, generator=data)
            y = torch.randint(0, CLASSES, (settings["batch"],), generator=data)
            pair = []
            for model, optimizer in zip((reference, pipe), optimizers):
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                pair.append(loss.item())
            losses = max(losses, abs(pair[0] - pair[1]))
        one_device = dict(reference.named_parameters())
        weights = max([(p - one_device[n]).abs().max().item() for n, p in pipe.named_parameters()] or [0.0])
        pipe.close()
        results.append({"seed": seed, **settings, "loss": losses, "weights": weights})
    dist.destroy_process_group()
    return results
