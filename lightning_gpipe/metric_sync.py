"""torchmetrics metrics kept outside the LightningModule sync over the data-parallel replicas, never over the stages.

A torchmetrics ``Metric`` without a ``process_group`` syncs its states over the default group: every process of the
job. The stages of one pipeline update their metrics with the same values (every rank holds the batch and the real
backbone output), so over every process a ``SumMetric`` counts each sample once per stage, a ``ConfusionMatrix``
holds K times the counts and a ``CatMetric`` each value K times (measured: 64 samples for 32 at K=2, silently). The
strategy gives the LightningModule's own metrics the replica group at setup; a metric that a callback keeps, builds
in a hook, or that a script keeps anywhere else cannot be reached from the module.

torchmetrics looks up its default sync function, ``gather_all_tensors``, in its ``metric`` module at every sync
(``Metric.sync``). Once routed, that name is :func:`_gather`: while a strategy has set :func:`sync_over_replicas`
(from its setup to its teardown), a gather without a group goes over this stage's replicas (with one pipeline,
this rank alone: its own state, as one device holds it); a gather given a group (``process_group=`` on the metric,
or ``sync(process_group=...)``) and every gather outside a strategy's run is torchmetrics' own. The module's metrics
(at setup) and those the callbacks keep (at teardown) get :func:`replica_gather` as their sync function
(:func:`keep_over`), which goes on syncing over the replicas for what the script computes after ``fit``; a module's
metrics get it through :class:`OwnerAwareGather`, which syncs as torchmetrics does once the module runs under another
strategy (a DDP ``validate`` of the trained module later in the same processes).

Written by hand because torchmetrics has no default group to set, only ``process_group`` and ``dist_sync_fn`` per
metric, and the metrics in question are not the package's to configure.
"""

from __future__ import annotations

import itertools
import os
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional

import torch.distributed as dist
import torchmetrics
import torchmetrics.metric as torchmetrics_metric
from torch import Tensor, nn
from torchmetrics.utilities.distributed import gather_all_tensors

__all__ = ["OwnerAwareGather", "keep_over", "replica_gather", "route_default_sync", "routed", "sync_over_replicas"]

#: torchmetrics' own ``gather_all_tensors``, kept while :func:`_gather` stands in for it
_torchmetrics_gather: Optional[Callable[..., list[Tensor]]] = None
#: while a strategy is set up: this stage's replica group, or ``None`` where the rank is its stage's only replica
_replicas: Optional[Callable[[], Optional[dist.ProcessGroup]]] = None
#: after a run: the replica group the metrics of :func:`keep_over` sync over (``(None,)``: nothing to sync with)
_kept: Optional[tuple[Optional[dist.ProcessGroup]]] = None


def routed() -> bool:
    """Whether torchmetrics' default sync function is :func:`_gather` in this process."""
    return getattr(torchmetrics_metric, "gather_all_tensors", None) is _gather


def route_default_sync() -> bool:
    """Make torchmetrics' default sync go through :func:`_gather` (idempotent).

    Returns False, with a warning that names the workaround, where this torchmetrics no longer looks the function
    up in its ``metric`` module.
    """
    global _torchmetrics_gather
    if routed():
        return True
    original = getattr(torchmetrics_metric, "gather_all_tensors", None)
    code = getattr(torchmetrics.Metric.sync, "__code__", None)
    if original is None or code is None or "gather_all_tensors" not in code.co_names:
        warnings.warn(
            f"torchmetrics {torchmetrics.__version__} no longer syncs through torchmetrics.metric.gather_all_tensors, "
            "so a metric kept outside the LightningModule (in a callback) would sync over every stage of the pipeline "
            "and count each sample once per stage. Give such metrics "
            "`process_group=trainer.strategy.replica_group` (None with one pipeline: use `sync_on_compute=False`).",
            stacklevel=2,
        )
        return False
    _torchmetrics_gather = original
    torchmetrics_metric.gather_all_tensors = _gather
    return True


def sync_over_replicas(
    group: Optional[Callable[[], Optional[dist.ProcessGroup]]], kept: Optional[dist.ProcessGroup] = None
) -> None:
    """From now on, a metric sync without a group of its own goes over ``group()`` (which gives ``None`` where this
    rank is its stage's only replica); ``None`` ends that (the strategy's setup and teardown call this), and the
    metrics given :func:`replica_gather` (:func:`keep_over`) sync over ``kept`` from then on: the replica group of the
    run that ended, ``None`` where this rank was its stage's only replica (nothing to sync with)."""
    global _replicas, _kept
    if group is not None:
        route_default_sync()
    else:
        _kept = (kept,)
    _replicas = group


def keep_over(holders: Iterable[object]) -> None:
    """Make every torchmetrics metric without a ``process_group`` or ``dist_sync_fn`` of its own that ``holders`` keep
    sync over the replicas (:func:`replica_gather`): a module's own (a ``MetricCollection`` included), or an object's
    attributes, also in lists, tuples and dicts.

    The strategy calls it on the LightningModule at setup, and on the callbacks at teardown, after which
    :func:`sync_over_replicas` ends (a later run in this process, with another strategy, must sync as torchmetrics
    does): the stages' metrics still hold equal states then, so a metric the script computes once ``fit`` returned (a
    callback's confusion matrix) still counts each sample once. The metric gets a function of this module's, not the
    group itself: a ``ProcessGroup`` cannot be copied or pickled, and Lightning's weight averaging deep-copies the
    module at the setup of a later ``fit`` (which failed with "cannot pickle 'ProcessGroup' object").
    """
    modules = [h for h in holders if isinstance(h, nn.Module)]
    attributes = [v for h in holders if not isinstance(h, nn.Module) for v in getattr(h, "__dict__", {}).values()]
    for module in modules:
        gather = OwnerAwareGather(module)
        for metric in _metrics_in([module], depth=0):
            if metric.process_group is None and (metric.dist_sync_fn is None or _ours(metric.dist_sync_fn)):
                metric.dist_sync_fn = gather
    for metric in _metrics_in(attributes, depth=2):
        if metric.process_group is None and metric.dist_sync_fn is None:
            metric.dist_sync_fn = replica_gather


def _ours(sync: Callable) -> bool:
    return sync is replica_gather or isinstance(sync, OwnerAwareGather)


#: the modules whose metrics an :class:`OwnerAwareGather` serves, by its token (this process's id and a count): weak
_owners: "weakref.WeakValueDictionary[tuple[int, int], nn.Module]" = weakref.WeakValueDictionary()
_tokens = itertools.count()


class OwnerAwareGather:
    """:func:`replica_gather` for the metrics of one module, as long as the module runs under this package's strategy
    (or under none: the script's own ``compute()`` after ``fit``); torchmetrics' own gather once the module's trainer
    runs another strategy over several processes, and no gather under one of one process.

    A later run of the same module in the same processes (``Trainer(strategy="ddp").validate(model)`` after the
    pipelined fit) must sync over every rank, as DDP does: with the last run's replica group, its metrics silently
    stayed per rank (0.5 and 0.625 where DDP gives 0.5625). The metric tells its sync function nothing of its module,
    so the function holds a token of it. Only the token is copied and pickled (a deep copy of the module shares it;
    in another process it finds no module, and serves as :func:`replica_gather`).
    """

    def __init__(self, module: nn.Module) -> None:
        self.token = (os.getpid(), next(_tokens))
        _owners[self.token] = module

    def __call__(self, result: Tensor, group: Optional[Any] = None) -> list[Tensor]:
        module = _owners.get(self.token)
        trainer = getattr(module, "_trainer", None) if module is not None else None
        strategy = getattr(trainer, "strategy", None) if trainer is not None else None
        if strategy is not None and not getattr(strategy, "routes_metric_sync", False):
            if group is None and getattr(strategy, "world_size", 1) == 1:
                # a one-process run (devices=1) in processes whose default group is still up: its own state, as the
                # last run's replica group gave it; torchmetrics' gather would sum over every process of the job
                return [result]
            return (_torchmetrics_gather or gather_all_tensors)(result, group=group)
        return replica_gather(result, group)


def replica_gather(result: Tensor, group: Optional[Any] = None) -> list[Tensor]:
    """The ``dist_sync_fn`` :func:`keep_over` gives: :func:`_gather` during a strategy's run, and afterwards, where no
    group is given, over the replicas of the last run in this process."""
    if group is None and _replicas is None and _kept is not None:
        if _kept[0] is None:
            return [result]  # the only replica of this stage: nothing to sync with
        group = _kept[0]
    return _gather(result, group)


def _metrics_in(values: list[Any], depth: int) -> Iterator[torchmetrics.Metric]:
    """The metrics among ``values``: in modules, and in lists, tuples, sets and dicts ``depth`` levels down (not in
    other objects: a callback's attributes are read, not the trainer it may keep)."""
    for value in values:
        if isinstance(value, nn.Module):
            yield from (m for m in value.modules() if isinstance(m, torchmetrics.Metric))
        elif depth > 0 and isinstance(value, (list, tuple, set)):
            yield from _metrics_in(list(value), depth - 1)
        elif depth > 0 and isinstance(value, dict):
            yield from _metrics_in(list(value.values()), depth - 1)


def _gather(result: Tensor, group: Optional[Any] = None) -> list[Tensor]:
    """torchmetrics' ``gather_all_tensors``, over this stage's replicas where no group was given during a fit."""
    gather = _torchmetrics_gather or gather_all_tensors  # unrouted: a metric of replica_gather unpickled elsewhere
    if group is None and _replicas is not None:
        replicas = _replicas()
        if replicas is None:
            return [result]  # the only replica of this stage: nothing to sync with
        group = replicas
    return gather(result, group=group)
