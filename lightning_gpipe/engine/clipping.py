"""Gradient norms over the whole pipeline, not over one stage, and clipping by them.

The functions here take the roles of the parameters as arguments (this stage's own, replicated,
copies of a tie counted elsewhere) and the group to reduce over; :mod:`lightning_gpipe.engine.gradients`
finds those for a pipeline and is what users and the strategy call.

The norm of the whole model is joined from per-stage shares: the sum of ``|g|^p`` for a p-norm, the
largest ``|g|`` for the infinity norm. Each stage computes its share, one all-reduce (sum or max)
joins them, and every stage takes the same root. The shares are kept in float64, so that a large
``p`` does not overflow before the root and the result is as close to the exact norm as torch's
one-device norm is (float32 on MPS, which has no float64).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gpipe.engine import distributed

__all__ = ["check_norm_type", "global_grad_norm", "joined_norm", "clip_grad_norm_"]


def check_norm_type(norm_type: Union[float, int, str]) -> float:
    """``norm_type`` as a float; raises unless it is a positive number or ``inf``.

    A "p-norm" with ``p <= 0`` is no norm of the gradients seen as one vector (torch's ``0`` counts
    the parameters whose gradient has a nonzero entry, its ``-inf`` takes the smallest entry), and no
    sum of per-stage shares gives it; Lightning's ``grad_norm`` refuses it too.

    >>> check_norm_type("inf")
    inf
    """
    try:
        value = float(norm_type)
    except (TypeError, ValueError):
        value = math.nan
    if not value > 0:
        raise ValueError(
            f"`norm_type` must be a positive number or 'inf' (infinity norm), got {norm_type!r}: the gradient norm "
            "of the whole model is joined from one share per stage (the sum of |g|^p, or the largest |g|), which "
            "needs p > 0. Use norm_type=2.0 (the default), 1.0, or float('inf')."
        )
    return value


#: torch's own norm helper (``torch.nn.utils.get_total_norm``), kept before :mod:`~.torch_clipping` points torch's
#: names at the norm over every stage, which takes each stage's share with this one
TORCH_TOTAL_NORM: Callable[..., Tensor] = (
    getattr(torch.nn.utils.clip_grad, "_get_total_norm", None) or torch.nn.utils.get_total_norm
)


def _share(grads: list[Tensor], p: float, foreach: Optional[bool], dtype: torch.dtype) -> Tensor:
    """The part of the norm that ``grads`` hold: the sum of ``|g|^p``, or for ``inf`` the largest ``|g|``."""
    norm = TORCH_TOTAL_NORM(grads, p, False, foreach).to(dtype)
    return norm if math.isinf(p) else norm**p


def global_grad_norm(
    parameters: Iterable[Tensor],
    stage_parameters: Iterable[Tensor],
    count_replicated: bool,
    group: Optional[dist.ProcessGroup],
    counted_elsewhere: Iterable[Tensor] = (),
    *,
    norm_type: Union[float, int, str] = 2.0,
    error_if_nonfinite: bool = False,
    foreach: Optional[bool] = None,
    watch: Optional[distributed.Watch] = None,
    device: Optional[torch.device] = None,
) -> Tensor:
    """The ``norm_type``-norm of the gradients of the whole model, the same on every stage; collective over ``group``.

    ``parameters`` are those this rank steps. Those in ``stage_parameters`` are its stage's own; the
    others (a head outside the backbone) exist on every stage with the same gradient, so they are
    counted once, on the stage with ``count_replicated`` set. ``counted_elsewhere`` are skipped: copies
    of a tied parameter that an earlier stage holds too (and counts). ``group=None``: this process
    alone. ``watch`` is polled while the all-reduce waits (:mod:`lightning_gpipe.engine.distributed`),
    so a failed peer raises instead of leaving the stage waiting. ``device``: where a stage without any
    gradient (a frozen stage) makes its share, which must be on the group's device for NCCL.

    The result has the gradients' dtype (promoted, as torch's ``clip_grad_norm_`` returns it), float32
    on a stage without any. With ``error_if_nonfinite``, a norm that is ``nan`` or ``inf`` raises, on
    every stage alike (it is checked after the all-reduce).
    """
    own_ids = {id(q) for q in stage_parameters}
    skip = {id(q) for q in counted_elsewhere}
    pairs = [(id(q), g) for q in parameters if (g := q.grad) is not None]
    return joined_norm(
        [g for key, g in pairs if key in own_ids and key not in skip],
        [g for key, g in pairs if key not in own_ids and key not in skip],
        [g for _, g in pairs],
        count_replicated,
        group,
        norm_type=norm_type,
        error_if_nonfinite=error_if_nonfinite,
        foreach=foreach,
        watch=watch,
        device=device,
    )


def joined_norm(
    own: list[Tensor],
    shared: list[Tensor],
    grads: list[Tensor],
    count_replicated: bool,
    group: Optional[dist.ProcessGroup],
    *,
    norm_type: Union[float, int, str] = 2.0,
    error_if_nonfinite: bool = False,
    foreach: Optional[bool] = None,
    watch: Optional[distributed.Watch] = None,
    device: Optional[torch.device] = None,
) -> Tensor:
    """:func:`global_grad_norm` from the gradients themselves: ``own``, this stage's; ``shared``, those every stage
    holds alike (counted where ``count_replicated``); ``grads``, all that were given (their dtypes and device set
    the result's, as in torch). Collective over ``group``."""
    p = check_norm_type(norm_type)
    device = grads[0].device if grads else (device or torch.device("cpu"))
    dtype = torch.float32
    if grads:  # a norm is real: a complex gradient (a spectral layer's weight) counts as its real dtype, as in torch
        dtype = grads[0].dtype.to_real()
        for g in grads[1:]:
            dtype = torch.promote_types(dtype, g.dtype.to_real())
    accumulate = torch.float32 if device.type == "mps" else torch.float64
    share = torch.zeros((), dtype=accumulate, device=device)
    for part in (own, shared if count_replicated else []):
        if part:
            piece = _share(part, p, foreach, accumulate)
            share = torch.maximum(share, piece) if math.isinf(p) else share + piece
    if group is not None:
        op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
        distributed.all_reduce(share, op, group, watch)
    total = (share if math.isinf(p) else share ** (1.0 / p)).to(dtype)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"The total norm of order {p} for gradients from `parameters` is non-finite, so it cannot be clipped. "
            "To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    return total


def clip_grad_norm_(
    parameters: Iterable[Tensor],
    max_norm: float,
    stage_parameters: Iterable[Tensor],
    count_replicated: bool,
    group: Optional[dist.ProcessGroup],
    counted_elsewhere: Iterable[Tensor] = (),
    *,
    norm_type: Union[float, int, str] = 2.0,
    error_if_nonfinite: bool = False,
    foreach: Optional[bool] = None,
    watch: Optional[distributed.Watch] = None,
    device: Optional[torch.device] = None,
) -> Tensor:
    """Scale the gradients of ``parameters`` so that the norm over all stages is at most ``max_norm``.

    Clipping each stage by its own norm would scale the stages differently (the prototype was 1.6e-2
    off a one-device run); this joins the stages' shares of the norm first (:func:`global_grad_norm`,
    same arguments), then lets ``torch.nn.utils.clip_grads_with_norm_`` apply the one factor
    everywhere (to every copy of a tied parameter too, which keeps the copies equal). Returns the norm.
    """
    parameters = list(parameters)
    total = global_grad_norm(
        parameters,
        stage_parameters,
        count_replicated,
        group,
        counted_elsewhere,
        norm_type=norm_type,
        error_if_nonfinite=error_if_nonfinite,
        foreach=foreach,
        watch=watch,
        device=device,
    )
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total, foreach)
    return total
