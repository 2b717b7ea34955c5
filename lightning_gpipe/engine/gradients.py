"""``grad_norm`` and ``clip_grad_norm_`` of the whole model, for code that runs on every stage of a pipeline.

Each rank of a pipeline holds one stage of the backbone (plus the layers outside it, replicated), so
``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` and Lightning's ``grad_norm(model, ...)``
see one stage: the first would clip every stage by its own norm (torch's is routed to :func:`clip_grad_norm_`'s
norm while a pipeline is live, :mod:`~lightning_gpipe.engine.torch_clipping`), the second reports this stage's
parameters and their norm. The two functions here give what one device gives, on every rank: they are
collective over the stages of one pipeline (call them on every rank, as hook code does), through the polled
collectives, so a failed peer raises instead of a hang.
Without a pipeline they are exactly torch's and Lightning's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Optional, Union

import torch
from torch import Tensor, nn

from lightning_gpipe.engine import clipping, distributed
from lightning_gpipe.engine.pipe import GPipe, live_pipes

__all__ = ["clip_grad_norm_", "grad_norm", "owning_pipe", "stage_norm_keys"]

#: Every key :func:`grad_norm` has returned in this process: a logged key of the same form that is not among them
#: came from Lightning's ``grad_norm`` (or code that names norms as it does), which sees one stage.
_whole_model_keys: set[str] = set()
#: Keys in the form of Lightning's ``grad_norm``: ``grad_{norm_type}_norm`` then ``_total`` or a separator and a name.
_NORM_KEY = re.compile(r"^grad_(?:[0-9.]+(?:e[+-]?[0-9]+)?|inf)_norm")


def owning_pipe(parameters: list[Tensor]) -> Optional[GPipe]:
    """The pipeline of this process that ``parameters`` belong to; ``None`` without one.

    Looked up among the live pipelines (:func:`~lightning_gpipe.engine.pipe.live_pipes`: built and not
    closed), not from the parameters alone: a stage may hold none of the backbone's parameters that
    were passed (a stage of stateless layers, or only the head's parameters given), yet it must join
    the other stages' all-reduce. Pipelines of one stage join no one and are left out. So with one live
    pipeline of several stages, that one is used, and every parameter it
    does not hold counts as replicated (the same on every rank, as the layers outside the backbone
    are). With several, the one holding some of ``parameters``; otherwise the caller names it.
    """
    pipes = [pipe for pipe in live_pipes() if pipe.group is not None]  # one stage alone joins nothing
    if len(pipes) <= 1:
        return pipes[0] if pipes else None
    ids = {id(p) for p in parameters}
    holders = [pipe for pipe in pipes if any(id(p) in ids for p in pipe.parameters())]
    if len(holders) == 1:
        return holders[0]
    raise ValueError(
        f"This process has {len(pipes)} live GPipe pipelines and the parameters belong to "
        f"{'none' if not holders else len(holders)} of them, so which stages to join is ambiguous. Pass the "
        "pipeline whose norm to take: clip_grad_norm_(..., pipe=<the GPipe>), or close() the pipelines no longer used."
    )


def clip_grad_norm_(
    parameters: Union[Tensor, Iterable[Tensor]],
    max_norm: float,
    norm_type: Union[float, int, str] = 2.0,
    error_if_nonfinite: bool = False,
    foreach: Optional[bool] = None,
    *,
    pipe: Optional[GPipe] = None,
) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` by the norm of the whole model: use it instead of torch's in a pipeline.

    Called on every rank with that rank's parameters (``self.parameters()`` in a LightningModule hook
    such as ``on_before_optimizer_step``, or in manual optimization), it scales every gradient by the
    factor one device would use, and returns the whole model's norm, the same on every rank. torch's
    function alone would clip each stage by its own norm; it is routed to this norm while a pipeline of several
    stages is live (:mod:`~lightning_gpipe.engine.torch_clipping`), and this one also takes ``pipe=``.
    (``Trainer(gradient_clip_val=...)`` goes through this function already.)

    The norm counts this stage's backbone parameters, the parameters outside the pipeline once (they
    are replicated: every rank has the same gradients), and each tied parameter once. ``norm_type``:
    any ``p > 0`` or ``inf``. Collective over the stages of the pipeline that holds the parameters
    (with data-parallel replicas, their gradients are averaged already, so over one pipeline only).
    ``pipe``: that pipeline, if this process holds several (see :func:`owning_pipe`); without any,
    this is torch's function.
    """
    parameters = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    p = clipping.check_norm_type(norm_type)
    if pipe is None:
        pipe = owning_pipe(parameters)
    elsewhere = pipe.ties.counted_elsewhere() if pipe is not None else []
    if pipe is None or (pipe.group is None and not elsewhere):  # one stage holds the whole model
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, p, error_if_nonfinite, foreach)
    return clipping.clip_grad_norm_(
        parameters,
        max_norm,
        pipe.parameters(),
        count_replicated=pipe.stage == 0,
        group=pipe.group,
        counted_elsewhere=elsewhere,
        norm_type=p,
        error_if_nonfinite=error_if_nonfinite,
        foreach=foreach,
        watch=pipe.watch("lightning_gpipe.clip_grad_norm_ (the gradient norm of all stages)"),
        device=pipe.device,  # a stage may have no gradient at all (frozen), yet joins the all-reduce
    )


def _one_device_order(module: nn.Module) -> list[tuple[str, Union[nn.Parameter, GPipe]]]:
    """``module.named_parameters()`` as one device lists it, with each pipeline in the place of its parameters.

    The walk is ``named_parameters``' own (modules in ``named_modules`` order, each parameter once),
    except that a :class:`GPipe` stands for all of its stages' parameters: its name is the prefix
    (``"backbone."``) under which those follow.
    """
    order: list[tuple[str, Union[nn.Parameter, GPipe]]] = []
    seen: set[int] = set()
    pipes: list[str] = []
    for prefix, sub in module.named_modules():
        if any(at == "" or prefix.startswith(at + ".") for at in pipes):
            continue  # this stage's layers: the pipeline lists every stage's
        if isinstance(sub, GPipe):
            pipes.append(prefix)
            order.append((f"{prefix}." if prefix else "", sub))
            continue
        for name, p in sub.named_parameters(prefix=prefix, recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                order.append((name, p))
    return order


def _pipeline_norms(pipe: GPipe, norm_type: float) -> list[tuple[str, Tensor]]:
    """``(name, norm of the gradient)`` of every stage's parameters with a gradient, in one-device order; collective.

    Stages are contiguous runs of the Sequential, so their lists in stage order are the one-device
    order. A tied parameter is listed by its first holder, under its first (one-device) name there.
    """
    elsewhere = {id(p) for p in pipe.ties.counted_elsewhere()}
    own = [
        (name, p.grad.data.norm(norm_type))
        for name, p in pipe.named_parameters()
        if p.grad is not None and id(p) not in elsewhere
    ]
    if pipe.group is None:
        return own
    watch = pipe.watch("lightning_gpipe.grad_norm (a gather of every stage's gradient norms)")
    sent = [(name, value.detach().cpu()) for name, value in own]
    parts = distributed.gather_objects(sent, pipe.group, watch) or []
    norms: list[tuple[str, Tensor]] = []
    for stage, part in enumerate(parts):
        norms.extend(own if stage == pipe.stage else [(name, value.to(pipe.device)) for name, value in part])
    return norms


def grad_norm(module: nn.Module, norm_type: Union[float, int, str], group_separator: str = "/") -> dict[str, Tensor]:
    """Lightning's ``grad_norm`` of the whole model: use it instead of Lightning's when ``module`` holds a pipeline.

    The norm of each parameter's gradient, under ``grad_{norm_type}_norm{group_separator}{name}``, and
    of all of them as one vector, under ``grad_{norm_type}_norm_total``: the keys, order, values and
    dtypes that ``lightning.pytorch.utilities.grad_norm(module, norm_type)`` gives on one device, for
    every stage's parameters (one-device names, each tied parameter once), on every rank. Lightning's
    sees only this rank's stage, so the logger (which writes rank 0's values) would get the first
    stage's norms and a smaller total. Typical use, on every rank::

        def on_before_optimizer_step(self, optimizer):
            self.log_dict(lightning_gpipe.grad_norm(self, norm_type=2))

    Only parameters with a gradient are listed. Collective over the stages of each pipeline inside
    ``module`` (a gather); without a pipeline it is Lightning's function.
    """
    p = float(norm_type)
    if p <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {p}")
    prefix = f"grad_{p}_norm{group_separator}"
    norms: dict[str, Tensor] = {}
    for name, item in _one_device_order(module):
        if isinstance(item, GPipe):
            norms.update((f"{prefix}{name}{inner}", value) for inner, value in _pipeline_norms(item, p))
        elif item.grad is not None:
            norms[f"{prefix}{name}"] = item.grad.data.norm(p)
    if norms:  # as Lightning computes it, so that the total is bit for bit the one-device one
        norms[f"grad_{p}_norm_total"] = torch.tensor(list(norms.values())).norm(p)
    _whole_model_keys.update(norms)
    return norms


def stage_norm_keys(logged: Iterable[str]) -> list[str]:
    """The keys of ``logged`` (metric names) that look like gradient norms but that :func:`grad_norm` did not make.

    During a fit over several stages those are Lightning's ``grad_norm`` of one stage: the norms of this rank's
    layers and a total over them only, which the logger writes as the model's.
    """
    return sorted(k for k in logged if _NORM_KEY.match(k) and k not in _whole_model_keys)
