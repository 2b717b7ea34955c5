"""Gradient-norm clipping over the whole pipeline, not over one stage."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["global_grad_norm", "clip_grad_norm_"]


def global_grad_norm(
    parameters: Iterable[nn.Parameter],
    stage_parameters: Iterable[nn.Parameter],
    count_replicated: bool,
    group: Optional[dist.ProcessGroup],
    counted_elsewhere: Iterable[nn.Parameter] = (),
) -> Tensor:
    """The 2-norm of the gradients of the whole model, the same on every stage; collective over ``group``.

    ``parameters`` are those this rank steps. Those in ``stage_parameters`` are its stage's own; the
    others (a head outside the backbone) exist on every stage with the same gradient, so they are
    counted once, on the stage with ``count_replicated`` set. ``counted_elsewhere`` are skipped: copies
    of a tied parameter that an earlier stage holds too (and counts).
    """
    own_ids = {id(p) for p in stage_parameters}
    skip = {id(p) for p in counted_elsewhere}
    with_grad = [p for p in parameters if p.grad is not None and id(p) not in skip]
    own = [p.grad for p in with_grad if p.grad is not None and id(p) in own_ids]
    shared = [p.grad for p in with_grad if p.grad is not None and id(p) not in own_ids]
    device = (own + shared)[0].device if with_grad else torch.device("cpu")
    square = torch.zeros((), dtype=torch.float32, device=device)
    if own:
        square = square + torch.nn.utils.get_total_norm(own, 2.0).float() ** 2
    if shared and count_replicated:
        square = square + torch.nn.utils.get_total_norm(shared, 2.0).float() ** 2
    if group is not None:
        dist.all_reduce(square, group=group)
    return square.sqrt()


def clip_grad_norm_(
    parameters: Iterable[nn.Parameter],
    max_norm: float,
    stage_parameters: Iterable[nn.Parameter],
    count_replicated: bool,
    group: Optional[dist.ProcessGroup],
    counted_elsewhere: Iterable[nn.Parameter] = (),
) -> Tensor:
    """Scale the gradients of ``parameters`` so that the norm over all stages is at most ``max_norm``.

    Clipping each stage by its own norm would scale the stages differently (the prototype was 1.6e-2
    off a one-device run); this all-reduces the squared norms first, then lets
    ``torch.nn.utils.clip_grads_with_norm_`` apply the one factor everywhere (to every copy of a tied
    parameter too, which keeps the copies equal).
    """
    parameters = list(parameters)
    total = global_grad_norm(parameters, stage_parameters, count_replicated, group, counted_elsewhere)
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total
