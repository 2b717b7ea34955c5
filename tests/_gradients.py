"""Workers for the whole-model gradient tests: ``grad_norm`` logged and ``clip_grad_norm_`` called from a hook."""

from __future__ import annotations

import time
from typing import Any, Optional

import _models as M
import _replicas as R
import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from torch import nn
from torch.nn.utils import clip_grad_norm_ as torch_clip_grad_norm_  # bound before any pipeline exists, as users do
from torch.nn.utils import get_total_norm  # the same, for torch's two-step clipping
from torch.utils.data import DataLoader

#: Splits of the 7-layer tied backbone: with K=2 both ties span stages 0 and 1; with K=3 the weight tie
#: spans stages 0 and 2 and the bias tie stages 1 and 2.
BALANCE = {2: [3, 4], 3: [2, 2, 3]}
#: name -> (what the hook does, norm_type, max_norm). Each max_norm is below the norm of every step of
#: every layout (the tests check it on the one-device runs), so every step clips.
RUNS = {
    "grad_norm 2": ("log", 2.0, 0.0),
    "clip 2": ("clip", 2.0, 0.05),
    "clip inf": ("clip", float("inf"), 0.02),
    "clip 1": ("clip", 1.0, 0.5),
    "gradient_clip_val": ("trainer", 2.0, 0.05),  # Lightning's clipping, through the strategy
    "torch clip 2": ("torch clip", 2.0, 0.05),  # torch's own clip_grad_norm_, with and without the pipeline
    "torch clip inf": ("torch clip", float("inf"), 0.02),
    # torch's two steps, get_total_norm then clip_grads_with_norm_: by the name bound above, and by torch's own name
    "torch two steps 2": ("torch two steps", 2.0, 0.05),
    "torch two steps inf": ("torch two steps", float("inf"), 0.02),
}
#: The runs of each layout (processes, data-parallel replicas): all on 2 stages, fewer on the slower layouts.
LAYOUTS = {
    (2, 1): list(RUNS),
    (3, 1): ["grad_norm 2", "clip inf", "torch clip inf"],
    (4, 2): ["grad_norm 2", "clip 2", "torch clip 2"],
}
NORM_TYPES = (1.0, 2.0, float("inf"))


class GradNet(M.Net):
    """A stem before the backbone, the tied backbone (ties across stages), a head after it.

    ``on_before_optimizer_step`` logs ``grad_norm(self, norm_type)`` (``action="log"``) or clips with
    ``clip_grad_norm_(self.parameters(), max_norm, norm_type)`` (``"clip"``), and records the result:
    with this package's functions if ``gpipe``, else with Lightning's and torch's (the one-device
    reference). ``"trainer"``: nothing in the hook, the Trainer clips (``gradient_clip_val=max_norm``).
    ``"torch clip"``: torch's ``clip_grad_norm_`` in the hook, with the pipeline too. ``"torch two steps"``:
    torch's ``get_total_norm`` of the gradients (the 2-norm by the name this module bound, the others by
    ``torch.nn.utils.get_total_norm``), then ``clip_grads_with_norm_`` with it, with the pipeline too.
    """

    def __init__(self, action: str, norm_type: float, max_norm: float, gpipe: bool) -> None:
        super().__init__(stem=True)
        self.backbone = M.tied_mlp()
        self.action, self.norm_type, self.max_norm, self.gpipe = action, norm_type, max_norm, gpipe
        self.records: list[Any] = []

    def on_before_optimizer_step(self, optimizer) -> None:
        super().on_before_optimizer_step(optimizer)
        if self.action == "log":
            if self.gpipe:
                import lightning_gpipe

                norms = lightning_gpipe.grad_norm(self, self.norm_type)
            else:
                norms = lightning_grad_norm(self, self.norm_type)
            self.log_dict(norms)
            self.records.append({k: v.detach().clone() for k, v in norms.items()})
        elif self.action == "clip":
            if self.gpipe:
                import lightning_gpipe

                total = lightning_gpipe.clip_grad_norm_(self.parameters(), self.max_norm, self.norm_type)
            else:
                total = torch.nn.utils.clip_grad_norm_(self.parameters(), self.max_norm, self.norm_type)
            self.records.append(total.detach().clone())
        elif self.action == "torch clip":
            total = torch_clip_grad_norm_(self.parameters(), self.max_norm, self.norm_type)
            self.records.append(total.detach().clone())
        elif self.action == "torch two steps":
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            norm = get_total_norm if self.norm_type == 2.0 else torch.nn.utils.get_total_norm
            total = norm(grads, self.norm_type)
            torch.nn.utils.clip_grads_with_norm_(self.parameters(), self.max_norm, total)
            self.records.append(total.detach().clone())


def fit(run: str, devices: Optional[int], replicas: int = 1) -> dict[str, Any]:
    """``run`` with the gpipe strategy on ``devices`` processes forming ``replicas`` pipelines; or, with
    ``devices=None``, on one device without this package, on the batches that the ``replicas`` see together."""
    action, norm_type, max_norm = RUNS[run]
    L.seed_everything(0, verbose=False)
    model = GradNet(action, norm_type, max_norm, gpipe=devices is not None)
    kwargs = M.trainer_kwargs(gradient_clip_val=max_norm if action == "trainer" else None)
    data = M.loader(batch_size=R.BATCH)
    if devices is None:
        if replicas > 1:
            data = DataLoader(M.dataset(), batch_sampler=R.global_batches(replicas))
        trainer = L.Trainer(devices=1, **kwargs)
    else:
        from lightning_gpipe import GPipeStrategy

        stages = devices // replicas
        strategy = GPipeStrategy(balance=BALANCE[stages], chunks=2, pipe_size=stages)
        trainer = L.Trainer(strategy=strategy, devices=devices, **kwargs)
    trainer.fit(model, data)
    return {
        "records": model.records,
        "logged": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("grad_")},
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def runs(rank: int, world_size: int, replicas: int) -> dict[str, Any]:
    """The runs of the layout; with 2 stages also the plain-PyTorch pipeline (:func:`plain`)."""
    results: dict[str, Any] = {run: fit(run, world_size, replicas) for run in LAYOUTS[world_size, replicas]}
    if (world_size, replicas) == (2, 1):
        results["plain"] = plain(rank)
    return results


# -- plain PyTorch: a GPipe inside an nn.Module, no Lightning ----------------------------------------------------


class Plain(nn.Module):
    """A stem, the tied backbone and a head, as a plain module (the pipeline goes in at ``backbone``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(M.FEATURES, M.FEATURES)
        self.backbone: nn.Module = M.tied_mlp()
        self.head = nn.Linear(8, M.CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(self.stem(x)))


def plain_backward(model: nn.Module) -> None:
    """One backward pass of a fixed batch (scaled up, so that clipping by 0.5 scales by a factor far from 1)."""
    x, y = M.dataset(16).tensors
    (F.cross_entropy(model(x), y) * 10).backward()


def plain(rank: int) -> dict[str, Any]:
    """``grad_norm`` and ``clip_grad_norm_`` of a module whose backbone is a 2-stage GPipe; then stage 1 fails
    and stage 0, in ``grad_norm``, must raise at once instead of waiting for it."""
    from lightning_gpipe import GPipe, PipelineError, clip_grad_norm_, grad_norm
    from lightning_gpipe.engine.gradients import owning_pipe

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    model = Plain()
    backbone = model.backbone
    assert isinstance(backbone, nn.Sequential)
    model.backbone = pipe = GPipe(backbone, BALANCE[2], chunks=2)
    plain_backward(model)
    out: dict[str, Any] = {"norms": {p: grad_norm(model, p) for p in NORM_TYPES}}
    out["total"] = clip_grad_norm_(model.parameters(), 0.5)
    out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    plain_backward(model)
    out["torch_total"] = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # torch's own, routed
    out["torch_grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    other = GPipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), chunks=1)  # a second pipeline of 2 stages
    out["owner_found"] = owning_pipe(list(model.parameters())) is pipe
    try:
        owning_pipe([nn.Parameter(torch.ones(1))])
        out["ambiguous"] = "no error"
    except ValueError as error:
        out["ambiguous"] = str(error)
    other.close()
    if rank == 1:
        pipe.board.publish(RuntimeError("stage 1 broke before the gradient norm"))
        time.sleep(3.0)  # alive while stage 0 waits: only the failure board can tell it
    else:
        start = time.monotonic()
        try:
            grad_norm(model, 2)
            out["failure"] = "no error"
        except PipelineError as error:
            out["failure"] = str(error)
        out["failure_seconds"] = time.monotonic() - start
    return out
