"""Plain-PyTorch pipeline workers: this module must not import Lightning, and blocks it in the workers."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class Split(nn.Module):
    """Returns a tuple with an integer tensor, to cross a stage boundary as a tuple."""

    def forward(self, x):
        return x, (x > 0).sum(dim=1)


class Join(nn.Module):
    def forward(self, pair):
        x, count = pair
        return x * (1 + count.unsqueeze(1).float())


class FromDict(nn.Module):
    def forward(self, batch):
        return batch["x"] * batch["scale"]


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        FromDict(), nn.Linear(4, 8), nn.Tanh(), Split(), Join(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)
    )


def data():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(10, 4, generator=generator, requires_grad=True)
    return x, torch.randint(0, 3, (10,), generator=generator)


def reference():
    """The same computation on one process without any pipeline."""
    x, y = data()
    net = model()
    loss = F.cross_entropy(net({"x": x, "scale": 2.0}), y)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in net.named_parameters()}, x.grad


def plain_pipeline(rank: int, world_size: int, balance: list[int], chunks: int) -> dict:
    # The launcher (lightning_gpipe.launch) imported the package, and with it Lightning, before this ran: forget
    # both, so that the package is imported again as on a machine without Lightning.
    for name in [m for m in sys.modules if m.split(".")[0] in ("lightning", "lightning_gpipe")]:
        del sys.modules[name]
    sys.modules["lightning"] = None  # type: ignore[assignment]  # importing Lightning now fails
    from lightning_gpipe import GPipe

    dist.init_process_group("gloo")
    pipe = GPipe(model(), balance, chunks=chunks, checkpoint="except_last")
    x, y = data()
    loss = F.cross_entropy(pipe({"x": x, "scale": 2.0}), y)
    loss.backward()
    try:
        [layer for layer in pipe]
        iteration = "no error"
    except TypeError as error:
        iteration = str(error)
    result = {
        "iteration": iteration,
        "loss": loss.item(),
        "grads": {n: p.grad.clone() for n, p in pipe.named_parameters()},
        "input_grad": x.grad.clone(),
        "lightning_imported": any(
            m == "lightning" or m.startswith("lightning.") for m in sys.modules if sys.modules[m] is not None
        ),
    }
    pipe.close()
    dist.destroy_process_group()
    return result
