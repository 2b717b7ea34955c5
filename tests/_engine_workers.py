"""Plain-PyTorch pipeline workers: this module must not import Lightning, and blocks it in the workers."""

from __future__ import annotations

import collections
import dataclasses
import random
import sys
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn


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


def model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
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
    # each process draws its own weights, as an unseeded script run once per process does: the pipe trains
    # rank 0's (the reference's), as DDP's replicas would
    sequential = model(seed=rank)
    kept = {"net": sequential}  # a reference of the user's, kept before the split
    pipe = GPipe(sequential, balance, chunks=chunks, checkpoint="except_last")
    x, y = data()
    try:
        kept["net"]({"x": x, "scale": 2.0})
        aside = "no error"
    except RuntimeError as error:
        aside = str(error)
    loss = F.cross_entropy(pipe({"x": x, "scale": 2.0}), y)
    loss.backward()
    try:
        [layer for layer in pipe]
        iteration = "no error"
    except TypeError as error:
        iteration = str(error)
    grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    # whether the output requires grad, as on one device: only where something before it does
    pipe.requires_grad_(False)
    frozen = {"everything": pipe({"x": x.detach(), "scale": 2.0}).requires_grad}
    frozen["but the input"] = pipe({"x": x.detach().requires_grad_(), "scale": 2.0}).requires_grad
    pipe.requires_grad_(rank == 1)
    frozen["but the last stage"] = pipe({"x": x.detach(), "scale": 2.0}).requires_grad
    pipe.requires_grad_(rank == 0)
    frozen["but the first stage"] = pipe({"x": x.detach(), "scale": 2.0}).requires_grad
    result = {
        "aside": aside,
        "frozen": frozen,
        "iteration": iteration,
        "started_from_rank_zero": pipe.started_from_rank_zero,
        "loss": loss.item(),
        "grads": grads,
        "input_grad": x.grad.clone(),
        "lightning_imported": any(
            m == "lightning" or m.startswith("lightning.") for m in sys.modules if sys.modules[m] is not None
        ),
    }
    pipe.close()
    dist.destroy_process_group()
    return result


Carry = collections.namedtuple("Carry", "x state")


class _Linear(nn.Module):
    """A layer around one ``nn.Linear``; the subclasses differ in what they take and return."""

    def __init__(self, size_in: int = 8, size_out: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(size_in, size_out)


class Lift(_Linear):
    """Into a dict with a constant and a ``None`` beside the tensor: every boundary after it carries a structure."""

    def forward(self, x):
        return {"x": self.linear(x), "mask": None, "scale": 0.5}


class DictBlock(_Linear):
    def forward(self, d):
        return {"x": torch.tanh(self.linear(d["x"])) * d["scale"], "mask": d["mask"], "scale": d["scale"]}


@dataclasses.dataclass
class State:
    """A dataclass inside the namedtuple, with a string beside its tensors."""

    value: Tensor
    positive: Tensor
    note: str = "state"
    spectrum: Optional[Tensor] = None  # complex: gradients cross a boundary in it too


class ToCarry(nn.Module):
    def forward(self, d):
        spectrum = torch.fft.rfft(d["x"], dim=-1)  # as a spectral layer's
        return Carry(d["x"], State(d["x"].tanh(), d["x"] > 0, spectrum=spectrum))  # a namedtuple around a dataclass


class CarryBlock(_Linear):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Parameter(torch.randn(5, dtype=torch.complex64) * 0.3)  # a complex weight on the spectrum

    def forward(self, carry):
        state = carry.state
        spectrum = state.spectrum * self.mix
        x = torch.tanh(self.linear(carry.x)) + state.value * state.positive + torch.fft.irfft(spectrum, n=8)
        return Carry(x, State(state.value, state.positive, spectrum=spectrum))


class Out(_Linear):
    def forward(self, carry):
        state = carry.state
        return {"logits": self.linear(carry.x + state.value), "positive": state.positive.sum(1), "aux": None}


def structured_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Lift(4), DictBlock(), DictBlock(), ToCarry(), CarryBlock(), CarryBlock(), Out(8, 3))


def structured_reference() -> tuple[float, dict, Tensor]:
    x, y = data()
    net = structured_model()
    out = net(x.detach())
    loss = F.cross_entropy(out["logits"], y)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in net.named_parameters()}, out["positive"]


def structured_pipeline(rank: int, world_size: int, settings: list[tuple[list[int], str]]) -> list[dict]:
    """The structured model through pipelines of ``world_size`` stages, one per (balance, checkpoint) setting."""
    from lightning_gpipe import GPipe

    dist.init_process_group("gloo")
    results = []
    for balance, checkpoint in settings:
        pipe = GPipe(structured_model(), balance, chunks=3, checkpoint=checkpoint)
        x, y = data()
        out = pipe(x.detach())
        loss = F.cross_entropy(out["logits"], y)
        loss.backward()
        results.append(
            {
                "loss": loss.item(),
                "grads": {n: p.grad.clone() for n, p in pipe.named_parameters()},
                "positive": out["positive"],
                "aux": out["aux"],
            }
        )
        pipe.close()
    dist.destroy_process_group()
    return results


class PythonLayerDrop(nn.Module):
    """LayerDrop as older Hugging Face encoders wrote it: skip the layer when Python's ``random.random() < p``."""

    def __init__(self, inner: nn.Module, numpy: bool = False) -> None:
        super().__init__()
        self.inner, self.numpy = inner, numpy

    def forward(self, x: Tensor) -> Tensor:
        draw = float(np.random.uniform(0, 1)) if self.numpy else random.random()
        return x if self.training and draw < 0.5 else self.inner(x)


class OwnHostNoise(nn.Module):
    """Noise drawn from a ``random.Random`` and a NumPy ``Generator`` the layer holds."""

    def __init__(self) -> None:
        super().__init__()
        self.python, self.numpy = random.Random(5), np.random.default_rng(7)

    def forward(self, x: Tensor) -> Tensor:
        return x * (1 + self.python.random()) + float(self.numpy.normal()) if self.training else x


class Annealed(nn.Module):
    """A temperature annealed by a call counter, both plain attributes, counted in every call (training or not)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls, self.tau = 0, 1.0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.training:
            self.tau = max(0.3, self.tau * 0.9)
        return torch.tanh(x / self.tau)

    def kept(self) -> tuple[int, float]:
        return self.calls, self.tau


class RunningCenter(nn.Module):
    """Centers by a running mean kept in a plain tensor attribute (no buffer), written in place in training."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.mean = torch.zeros(width)

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            self.mean.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return x - self.mean

    def kept(self) -> Tensor:
        return self.mean.clone()


def host_random_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8),
        nn.Tanh(),
        PythonLayerDrop(nn.Linear(8, 8)),
        nn.Tanh(),
        OwnHostNoise(),
        PythonLayerDrop(nn.Linear(8, 8), numpy=True),
        nn.Tanh(),
        nn.Linear(8, 3),
    )


def host_random_training(rank: int, world_size: int, settings: list[tuple[list[int], str]]) -> list[dict]:
    """The model of :func:`host_random_model` trained 6 steps by pipelines of ``world_size`` stages, one per (balance,
    checkpoint) setting; each process's Python and NumPy generators start elsewhere, as in an unseeded script."""
    from lightning_gpipe import GPipe

    if world_size > 1:
        dist.init_process_group("gloo")
    results = []
    for balance, checkpoint in settings:
        random.seed(100 + rank)
        np.random.seed(100 + rank)
        pipe = GPipe(host_random_model(), balance, chunks=4, checkpoint=checkpoint, seed=0)
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(6):
            x, y = torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)
            loss = F.cross_entropy(pipe(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        results.append(
            {
                "losses": losses,
                "weights": {n: p.detach().clone() for n, p in pipe.named_parameters()},
                "callers_draws": (random.random(), float(np.random.uniform())),  # after the pipe's calls
            }
        )
        pipe.close()
    if world_size > 1:
        dist.destroy_process_group()
    return results


def wire_messages() -> list[tuple]:
    """Messages of every framing: inline (small), header then tensors (over the inline limit), gaps, odd dtypes."""
    from lightning_gpipe.engine.messages import INLINE_LIMIT

    generator = torch.Generator().manual_seed(3)
    big = torch.randn(INLINE_LIMIT // 4 + 1, generator=generator)  # one element over: its own frame
    return [
        ((torch.randn(3, 5, generator=generator),), [True], False),
        ((torch.tensor(2.5), None, torch.zeros(0, 4), torch.tensor([True, False, True])), [False] * 4, True),
        (
            (torch.randn(7, generator=generator).to(torch.complex128), torch.arange(5, dtype=torch.int16)),
            [False] * 2,
            True,
        ),
        ((big, torch.randn(2, 2, generator=generator)), [True, False], True),
        ((torch.randn(2, 3, generator=generator).to(torch.bfloat16),), [False], False),
    ]


def wire_round_trip(rank: int, world_size: int) -> list:
    """Rank 0 sends :func:`wire_messages` over the engine's channels; rank 1 returns what arrived."""
    from lightning_gpipe.engine.channels import Channels
    from lightning_gpipe.engine.failure import FailureBoard
    from lightning_gpipe.engine.messages import Tag
    from lightning_gpipe.engine.topology import PipeLayout

    dist.init_process_group("gloo")
    board = FailureBoard.for_default_group(lambda r: f"stage {r}", namespace="wire")
    channels = Channels(PipeLayout(world_size, world_size), rank, torch.device("cpu"), board, timeout=60.0)
    got = []
    for micro, (values, flags, structure) in enumerate(wire_messages()):
        if rank == 0:
            channels.send(1, values, flags, structure, Tag("forward", 4, micro, "training_step", batch=77))
        else:
            message = channels.recv(0)
            got.append((message.values, message.requires_grad, message.structure, message.tag))
    sent = channels.bytes_sent()
    channels.flush()
    channels.close()
    dist.destroy_process_group()
    return got if rank else [sent]


def checkpointed_backbone(rank: int, world_size: int, reentrant: bool) -> dict:
    """The pipe called inside torch's ``checkpoint``: the reentrant form trains as one process does; the other one
    recomputes from inside each stage's drain, which the pipe refuses (it waited for ``failure_timeout`` before)."""
    from torch.utils.checkpoint import checkpoint

    from lightning_gpipe import GPipe

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    pipe = GPipe(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)), [2, 1], chunks=2)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    checkpoint(pipe, x, use_reentrant=reentrant).square().mean().backward()
    grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    pipe.close()
    dist.destroy_process_group()
    return {"grads": grads, "input_grad": x.grad.clone()}


def targets_of_another_rank(rank: int, world_size: int, checked: bool) -> str:
    """Rank 1's targets differ; ``checked``: the step's fingerprint covers them (``pipe.batch_fingerprint``). What the
    call raised, or the loss (which the gradients, from the last stage's targets, do not follow on rank 0)."""
    from lightning_gpipe import GPipe
    from lightning_gpipe.engine.microbatch import fingerprint

    dist.init_process_group("gloo")
    pipe = GPipe(model(), [4, 4], chunks=2)
    x, y = data()
    y = (y + rank) % 3
    batch = {"x": x, "scale": 2.0}
    if checked:
        pipe.batch_fingerprint = fingerprint((batch, y))
    try:
        return f"loss {F.cross_entropy(pipe(batch), y).item():.6f}"
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    finally:
        pipe.close()


class _RaisesInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        raise ValueError("boom in backward")


class _Boom(nn.Module):
    """Raises in its forward, or in its backward, on the rank that holds it."""

    def __init__(self, in_backward: bool) -> None:
        super().__init__()
        self.in_backward = in_backward

    def forward(self, x: Tensor) -> Tensor:
        if self.in_backward:
            return _RaisesInBackward.apply(x)
        raise ValueError("boom in forward")


def failing_layer(rank: int, world_size: int, in_backward: bool) -> str:
    """A layer of stage 0 raises in the fill, or one of stage 1 in the drain; every rank catches what the call or
    the backward raised and closes the pipe, as a script that reports its errors does. What each rank caught."""
    from lightning_gpipe import GPipe

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)]
    layers[2 if in_backward else 1] = _Boom(in_backward)
    return _one_step_caught(GPipe(nn.Sequential(*layers), [2, 2], chunks=2))


def _one_step_caught(pipe: Any) -> str:
    """One step of ``pipe`` on a batch of 8 samples of 4 features; what it raised, as a script that reports its
    errors catches it; then the pipe and the group are closed."""
    try:
        pipe(torch.randn(8, 4)).sum().backward()
        return "no error"
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    finally:
        pipe.close()
        dist.destroy_process_group()


class _Hangs(nn.Module):
    """A layer whose forward never returns (within the test): a lock or a read that blocks."""

    def forward(self, x: Tensor) -> Tensor:
        import time

        time.sleep(600)
        return x


def hung_layer(rank: int, world_size: int) -> str:
    """A layer of stage 1 never returns; ``timeout=2``. What stage 0 raised (stage 1 never returns at all)."""
    from lightning_gpipe import GPipe

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    return _one_step_caught(
        GPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), _Hangs(), nn.Linear(4, 2)), [2, 2], timeout=2.0)
    )


def killed_between_steps(rank: int, world_size: int) -> str:
    """Stage 1's process dies after a step, as a SIGKILL or the out-of-memory killer ends one (nothing published);
    stage 0 goes on to the next step 2 s later, whose first act is to send stage 1 activations. What it raised."""
    import os
    import time

    from lightning_gpipe import GPipe

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    pipe = GPipe(nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]), [2, 2], chunks=4)
    pipe(torch.randn(16, 64)).sum().backward()
    if rank == 1:
        os._exit(3)
    time.sleep(2.0)
    try:
        pipe(torch.randn(16, 64)).sum().backward()
        return "no error"
    except Exception as error:
        return f"{type(error).__name__}: {error}"
