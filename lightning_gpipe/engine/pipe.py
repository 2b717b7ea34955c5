"""``GPipe``: an ``nn.Sequential`` run as a fill-drain pipeline, one stage per process; plain PyTorch."""

from __future__ import annotations

import atexit
import operator
import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, NoReturn, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.hooks import RemovableHandle

from lightning_gpipe.engine import distributed, microbatch
from lightning_gpipe.engine.channels import Channels
from lightning_gpipe.engine.failure import FailureBoard, PipelineError
from lightning_gpipe.engine.initial_state import start_from_rank_zero
from lightning_gpipe.engine.lockstep import stray_message_error
from lightning_gpipe.engine.partition import (
    balance_by_params,
    check_balance_entries,
    layer_names,
    layer_span,
    stage_bounds,
    validate_balance,
)
from lightning_gpipe.engine.replicas import GradientSync, refuse_sparse_gradients
from lightning_gpipe.engine.skip import SkipRoutes, StageSkips, find_skips
from lightning_gpipe.engine.stage import StageRunner
from lightning_gpipe.engine.stage_copy import StageCopy
from lightning_gpipe.engine.tied import TiedCopies, keep_stage, one_parameter_per_tie
from lightning_gpipe.engine.topology import PipeLayout, make_mesh
from lightning_gpipe.engine.tracer import Tracer

__all__ = ["STRAY_GRACE", "GPipe", "live_pipes"]

#: Seconds a message from a peer may wait untaken while this rank is blocked in a collective of the whole
#: pipeline, before the two count as out of step. A peer cannot pass such a collective before this rank
#: joins it, so a message that waits through one was sent from a call this rank never makes; the grace only
#: lets a message that was already on its way be counted.
STRAY_GRACE = 5.0

#: Seconds beyond ``failure_timeout`` that ranks must have waited for each other before the board calls it a
#: deadlock (:mod:`~lightning_gpipe.engine.deadlock`): the out-of-step checks, which take ``failure_timeout`` and
#: can say more (the call a stage never made), speak first.
DEADLOCK_MARGIN = 5.0

#: The pipelines of this process that are built and not closed; weakly held, so one that is dropped
#: without :meth:`GPipe.close` leaves too. Functions given only parameters look their pipeline up here.
_live: weakref.WeakSet[GPipe] = weakref.WeakSet()


def _close_at_exit() -> None:
    """At the interpreter's exit, close the plain pipelines a script left open (``pipe.close()`` forgotten).

    Their receiving threads would meet the process group's teardown, in which gloo aborts the process ("terminate
    called without an active exception", exit -6: 3 of 3 runs in an outside tester's script). Every process of a
    script that ended normally runs this, so the collective close meets. Registered at import, so it runs after
    the handlers registered later: after a failure :func:`~lightning_gpipe.engine.failure.exit_without_finalizers`
    has ended the process first. Where the script destroyed the default group already, closing cannot help: it
    says so, since the abort that follows names nothing of this package. The Lightning strategy closes its own.
    """
    for pipe in list(_live):
        if not (pipe._own_board and pipe.has_peers):
            continue
        if not dist.is_initialized():
            sys.stderr.write(
                "[lightning_gpipe] a GPipe was never closed, and the default process group was destroyed under it: "
                "gloo may abort this process at exit ('terminate called without an active exception'). Call "
                "pipe.close() on every process before dist.destroy_process_group().\n"
            )
            return
        pipe.close()


atexit.register(_close_at_exit)


#: Called with each pipeline of several stages when it is built, for what the process must set up once there is one
#: (``torch_clipping`` routes torch's ``clip_grad_norm_`` to the norm of every stage). A list that those modules
#: append to, so that this module imports none of them.
on_pipeline_built: list[Callable[[GPipe], None]] = []


def live_pipes() -> list[GPipe]:
    """The ``GPipe`` instances of this process that are built and not yet closed (usually one: the running one)."""
    return list(_live)


#: The packages whose calls of ``children()`` on a partitioned pipe mean this process's modules (see ``GPipe.children``)
_TRAVERSING = ("torch", "lightning", "lightning_fabric", "pytorch_lightning", "torchmetrics", "lightning_gpipe")

#: How to run the layers, for the errors of code that reaches them one by one.
_RUN_THE_PIPE = (
    "To run the layers, call the backbone itself (`self.backbone(x)`): code that runs them one by one (a loop, "
    "torch's `checkpoint_sequential`) would bypass the pipeline, which re-materializes by itself (`checkpoint=`)."
)


def refuse_own_forward(module: nn.Sequential, name: str = "The backbone") -> None:
    """Raise if ``module`` is a subclass of ``nn.Sequential`` with a ``forward`` of its own: naming it, and the fix.

    A pipeline runs the layers as ``nn.Sequential.forward`` does, each on the previous one's output, and never calls
    the Sequential's own ``forward``. A subclass that adds a residual around every layer, or passes two inputs
    along, would train as a plain chain: every shape can still fit, and nothing else would tell.
    """
    cls = type(module)
    if cls.forward is not nn.Sequential.forward:
        raise TypeError(
            f"{name} is a {cls.__name__}, a subclass of nn.Sequential with its own forward "
            f"({cls.__module__}.{cls.__qualname__}.forward). The pipeline runs the layers one after another as "
            "nn.Sequential.forward does (each on the previous layer's output) and cannot run your forward, so the "
            "model would silently train as another network. Put what the forward adds into the layers (a module per "
            "block that holds the residual, say) and make the backbone a plain nn.Sequential of them; if your forward "
            "only chains the layers, drop it."
        )


#: The attributes a ``GPipe`` (or a weight average's ``StageCopy``) sets on itself: a layer under one of these names
#: (or a method's) could not be kept under its own name beside them (``tests/test_engine.py`` checks that this lists
#: every attribute a built pipe and a stage copy have).
OWN_ATTRIBUTES = frozenset(
    {
        "_all_layers",
        "_aside",
        "_full",
        "_is_full_backward_hook",
        "_layer_index",
        "_own_board",
        "_own_mesh",
        "_partial_state",
        "balance",
        "board",
        "device",
        "elsewhere",  # a StageCopy's
        "gather",  # a StageCopy's (and a GPipe method)
        "group",
        "layer_names",
        "layout",
        "mesh",
        "num_layers",
        "ranks",
        "replica_group",
        "runner",
        "skips",
        "stage",
        "started_from_rank_zero",
        "ties",
        "whole_state_hint",
    }
)


def refuse_reserved_names(names: Sequence[str]) -> None:
    """Raise if a layer's name in the Sequential is one a ``GPipe`` uses itself: naming the layer, and the fix.

    Each stage keeps its layers under their names, so that parameter names read as on one device; a layer called
    ``stage`` or ``device`` would clash with the pipeline's own attribute of that name.
    """
    for index, name in enumerate(names):
        if name in OWN_ATTRIBUTES or hasattr(GPipe, name) or hasattr(StageCopy, name):
            raise ValueError(
                f"Layer {index} of the backbone is named `{name}`, a name the pipeline uses for an attribute of its "
                f"own (`GPipe.{name}`, or a stage copy's). Each stage keeps its layers under their names in the "
                "Sequential, so that parameter names and checkpoint keys read as on one device. "
                f"Rename the layer (e.g. `{name}_`)."
            )


def refuse_lazy_layers(module: nn.Sequential) -> None:
    """Raise if a layer still has uninitialized (lazy) parameters: naming it, and how to give them their shapes.

    A pipeline profiles, splits and places layers, and compares the processes' weights, before any forward;
    a lazy layer would get its shape on one stage's first micro-batch only. DDP refuses them too.
    """
    for index, layer in enumerate(module):
        if any(nn.parameter.is_lazy(t) for t in [*layer.parameters(), *layer.buffers()]):
            raise ValueError(
                f"Layer {index} ({type(layer).__name__}) of the backbone has uninitialized parameters (a lazy module), "
                "which the pipeline cannot split, place or compare before they have a shape. Run one forward of a "
                "sample batch through the model before `fit` (or before building GPipe), as DistributedDataParallel "
                "also requires, or give the layer its input size."
            )


def refuse_sync_batch_norm(module: nn.Sequential, stages: int) -> None:
    """Raise if a layer holds an ``nn.SyncBatchNorm`` while the pipeline has several stages: naming it, and the fix.

    SyncBatchNorm reduces its statistics over every process of its group (the whole job by default) at each training
    forward. A pipeline's processes hold different layers: a stage's SyncBatchNorm would wait for stages that never
    run it (a hang), or pair with another stage's and mix the statistics of two layers. DDP scripts make it with
    ``nn.SyncBatchNorm.convert_sync_batchnorm(model)``; ``Trainer(sync_batchnorm=True)`` is refused apart.
    """
    if stages < 2:
        return
    for index, layer in enumerate(module):
        found = next((name for name, m in layer.named_modules() if isinstance(m, nn.SyncBatchNorm)), None)
        if found is not None:
            where = f" (`{found}`)" if found else ""
            raise ValueError(
                f"Layer {index} ({type(layer).__name__}) of the backbone holds an nn.SyncBatchNorm{where}, which "
                f"reduces its statistics over the processes of the job; the {stages} stages of a pipeline hold "
                "different layers, so it would wait for stages that never run it, or mix two layers' statistics. Use "
                "nn.BatchNorm (for statistics over the whole batch rather than each micro-batch, with "
                "deferred_batch_norm=True in GPipeStrategy, or DeferredBatchNorm), instead of "
                "nn.SyncBatchNorm.convert_sync_batchnorm."
            )


#: The hooks of a module's call (``register_forward_hook``, ``register_forward_pre_hook``,
#: ``register_full_backward_hook`` and ``register_full_backward_pre_hook``). A pipeline stands in for its Sequential
#: wherever that is called, so it runs the Sequential's: around the whole pipeline, on every rank, with the input and
#: the whole output (and their gradients), as they run around the Sequential on one device. Dropped, a hook that
#: captures the backbone's output or logs its statistics silently never ran.
_CALL_HOOKS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


def _called_aside(module: nn.Module, args: Any) -> None:
    """Stops a call of the Sequential a pipeline was built from, made through a reference the caller kept (in a dict,
    a list, a closure) instead of through the pipeline: it holds only this stage's layers (the others are on ``meta``,
    where torch's error names no cause) and would run apart from the other stages, past the gradient exchange."""
    if not isinstance(module, GPipe):
        raise RuntimeError(
            "The backbone's nn.Sequential was called directly, through a reference kept before it was split into "
            "the pipeline's stages (in a dict or a list, a closure, ...). "
            "The pipeline has taken its place on the module: the Sequential object now holds only this stage's "
            "layers (the others are on `meta`). Call the backbone through the module's attribute "
            "(`self.backbone(x)`, looked up at each call), or keep its name instead of the object "
            "(`getattr(self, name)`). Once the fit ends the Sequential is whole again."
        )


def check_seconds(name: str, seconds: Any) -> None:
    """A duration argument: a positive number of seconds (a string from a config would fail later, deep inside)."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"`{name}` must be a positive number of seconds, got {seconds!r}.")


def check_seed(seed: Any) -> None:
    """``seed``: an integer, or None (the first stage's ``torch.initial_seed()``)."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(
            f"`seed` must be an integer (the root of the pipeline's random streams) or None (the first stage's "
            f"torch.initial_seed(), which seed_everything sets), got {seed!r}."
        )


class GPipe(nn.Module):
    """Run ``module`` as a ``K``-stage pipeline over ``K`` processes, this process holding one stage.

    Every process of the pipeline builds the same ``GPipe`` from the same Sequential (construction is
    collective: it creates the process groups the stages talk over). Each keeps the layers of its
    own stage, under their original indices, so ``state_dict`` keys match the Sequential's; the other
    stages' layers are moved to the ``meta`` device, which frees their memory. Calling the module
    runs the pipeline and returns the Sequential's real output on every process; ``backward`` on a
    loss of it runs the drain. With one process it is GPipe's "pipeline-1": micro-batching and
    re-materialization only.

    Example (in each of 2 processes, after ``dist.init_process_group("gloo")``)::

        pipe = GPipe(nn.Sequential(a, b, c, d), balance=[2, 2], chunks=4)
        loss = F.mse_loss(pipe(x), y)    # the same x and y on both processes
        loss.backward()                  # each process gets the gradients of its own stage
        torch.optim.SGD(pipe.parameters(), lr=0.1).step()

    Tied weights: a parameter shared by layers on different stages (``last.weight = first.weight``)
    stays one parameter in effect. Each stage that uses it holds its own copy (a separate Parameter);
    at the end of every backward the copies' gradients are summed over their stages (and averaged over
    replicas), so every copy gets the one-device gradient, and the copies' values are compared: they
    must stay equal, so step them alike (same param group and hyperparameters on every stage), or a
    :class:`~lightning_gpipe.PipelineError` names the parameter. A copy's local name may differ from
    the whole model's (:meth:`tied_names`); the whole model's is its first name in the Sequential. To
    count the whole model once (a gradient norm, a size), skip ``pipe.ties.counted_elsewhere()``. One
    module *object* placed twice must stay on one stage (construction raises otherwise), and a
    parameter shared with a module outside the pipeline is not kept tied: put that module inside.

    Args:
        module: the layers, in order.
        balance: layers per stage, one entry per stage; by default an optimal split by parameter count.
        chunks: micro-batches per batch (``M`` in the paper); a batch of fewer samples gets one per sample.
        checkpoint: ``"always"``, ``"except_last"``, ``"never"`` or ``"keep:N"`` (keep the last ``N``
            micro-batches' activations): which micro-batches drop their activations in the forward and
            recompute them in the backward.
        layout: how the processes form pipelines; by default one pipeline over all processes. With several
            pipelines (data-parallel replicas), each stage averages its gradients over its replicas:
            call ``sync_gradients()`` after ``backward`` (the Lightning strategy does).
        device: this stage's device; by default the CPU.
        devices: torchgpipe's list of devices, refused with the way to run one stage per process instead.
        seed: the root of the random streams (dropout); by default the first stage's ``torch.initial_seed()``.
        timeout: seconds a stage waits for a message before it gives up.
        board: where failures are published; by default one on the default process group's store.
        mesh: the ``(dp, pp)`` DeviceMesh of ``layout`` (see :func:`make_mesh`); by default one is made
            (a collective) and freed at :meth:`close`.
        split_backward: in the drain, compute each micro-batch's input gradient first and send it, then
            the weight gradients (:mod:`lightning_gpipe.engine.split_backward`). Same results; off by
            default because on the CPU its graph walk and extra autograd calls cost more than it saves
            (``docs/benchmarks.md``).
        check_per_sample: at the first call that cuts a batch (``chunks > 1``, 2 samples or more in the first
            micro-batch), check that every layer treats the samples along dim 0 apart, and refuse one that mixes
            them (a sequence-first layer given ``(sequence, batch, ...)``: see
            :mod:`lightning_gpipe.engine.sample_check`). ``False`` runs such layers per micro-batch, as GPipe runs
            BatchNorm.
    """

    def __init__(
        self,
        module: nn.Sequential,
        balance: Optional[Sequence[int]] = None,
        *,
        chunks: int = 1,
        checkpoint: str = "except_last",
        layout: Optional[PipeLayout] = None,
        device: Optional[Union[torch.device, str]] = None,
        seed: Optional[int] = None,
        timeout: float = 1800.0,
        board: Optional[FailureBoard] = None,
        mesh: Optional[DeviceMesh] = None,
        split_backward: bool = False,
        check_per_sample: bool = True,
        devices: Optional[Sequence[Any]] = None,
    ) -> None:
        super().__init__()
        if devices is not None:  # torchgpipe's argument: a script ported from it meets this first
            raise TypeError(
                f"GPipe takes no `devices` list (got {devices!r}): unlike torchgpipe, which puts every stage on its "
                "own device in one process, it runs one stage per process over torch.distributed. Start one process "
                "per stage (`torchrun --nproc-per-node K script.py`), call `torch.distributed.init_process_group()` "
                "in each, and give each process its own `device=` (with Lightning, `Trainer(strategy='gpipe', "
                "devices=K)` does it all)."
            )
        self._partial_state = 0  # > 0 inside `stage_state()`: state_dict() may return this stage's part
        self._all_layers = 0  # > 0 inside `all_layers()`: other stages' layers read as their `meta` copies
        #: what ``state_dict()`` outside :meth:`stage_state` tells the caller to do instead (an owner such as the
        #: Lightning strategy replaces it with its own ways to the whole model's state)
        self.whole_state_hint = (
            "take each stage's part as below and gather the parts with `pipe.gather(part, to_all=False)` on every "
            "process (the whole state on the first stage)"
        )
        for name, flag in (("split_backward", split_backward), ("check_per_sample", check_per_sample)):
            if not isinstance(flag, bool):
                raise TypeError(f"`{name}` must be True or False, got {flag!r}.")
        check_seconds("timeout", timeout)
        check_seed(seed)
        chunks = microbatch.check_chunks(chunks)  # as an int: a NumPy integer means the same count
        if not isinstance(module, nn.Sequential):
            raise TypeError(f"GPipe splits an nn.Sequential, got {type(module).__name__}; wrap the layers in one.")
        refuse_own_forward(module, "The module given to GPipe")
        refuse_reserved_names(layer_names(module))
        refuse_lazy_layers(module)
        for name in _CALL_HOOKS:  # the same dicts: a hook's handle removes it from both, and the Sequential keeps it
            setattr(self, name, getattr(module, name))
        self._is_full_backward_hook = module._is_full_backward_hook
        rank = dist.get_rank() if distributed.is_distributed() else 0
        world = dist.get_world_size() if distributed.is_distributed() else 1
        layout = layout or PipeLayout(world, world)
        if layout.world_size != world:
            raise ValueError(f"The layout is for {layout.world_size} processes but the job has {world}.")
        stages = layout.pipe_size
        refuse_sync_batch_norm(module, stages)
        refuse_sparse_gradients(module, layout.num_replicas)
        if balance is None:
            balance = balance_by_params(module, stages)
        elif not distributed.is_distributed() and len(check_balance_entries(balance)) > 1:
            raise ValueError(
                f"`balance={list(balance)}` asks for {len(list(balance))} stages, but torch.distributed is not "
                "initialized: this process is the whole pipeline. GPipe runs one stage per process, so start one "
                "process per stage (`torchrun --nproc-per-node K script.py`, or `lightning_gpipe.launch.run_processes`)"
                " and call `torch.distributed.init_process_group()` in each before building the GPipe; with "
                "Lightning, `Trainer(strategy='gpipe', devices=K)` does both."
            )
        self.balance = validate_balance(balance, len(module), stages)
        self.skips = SkipRoutes(find_skips(module), self.balance)  # checked before any group is made
        self.layout, self.stage = layout, layout.stage_of(rank)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        start, stop = stage_bounds(self.balance)[self.stage]
        self.num_layers = len(module)
        #: the Sequential's layer names (``"0"``, ``"1"``, ... or an ``OrderedDict``'s): this stage's layers keep theirs
        self.layer_names = layer_names(module)
        self._layer_index = {name: index for index, name in enumerate(self.layer_names)}
        #: whether the processes built different initial weights and every stage took rank 0's (as DDP does)
        self.started_from_rank_zero = world > 1 and start_from_rank_zero(
            module, self.device, board.raise_if_failed if board is not None else None
        )
        ties = keep_stage(self, module, self.balance, self.stage, self.device)
        self._full = [module]  # in a list, so that it is not a submodule: only the own stage is registered
        #: calls of the Sequential itself, reached through a reference kept elsewhere, stop with the reason (the pipe
        #: shares its hook dicts, so the hook sees the pipe's own calls too, and lets them pass)
        for key in [k for k, hook in module._forward_pre_hooks.items() if hook is _called_aside]:
            del module._forward_pre_hooks[key]  # left by a pipeline that ended in a failure, without close()
        self._aside: Optional[RemovableHandle] = None
        if world > 1:
            self._aside = module.register_forward_pre_hook(_called_aside, prepend=True)
        self._own_board = board is None
        self.board = board or FailureBoard.for_default_group(self.describe, namespace="lightning_gpipe")
        if self._own_board:
            self.board.add_check(lambda: self.idle_stray(30.0))
            self.board.watch_deadlocks(after=30.0 + DEADLOCK_MARGIN)
            self.board.start(grace=10.0, failure_timeout=30.0)
        self.ranks = layout.pipeline_of(rank)
        self.group: Optional[dist.ProcessGroup] = None  # this pipeline's ranks ("pp"), for collectives across stages
        self.replica_group: Optional[dist.ProcessGroup] = None  # this stage in every pipeline ("dp")
        self._own_mesh = mesh is None and world > 1
        self.mesh = make_mesh(layout, self.device) if self._own_mesh else mesh
        if self.mesh is not None:
            self.group = self.mesh.get_group("pp") if stages > 1 else None
            self.replica_group = self.mesh.get_group("dp") if layout.num_replicas > 1 else None
        channels = (
            Channels(layout, rank, self.device, self.board, timeout, skips=self.skips.pairs()) if stages > 1 else None
        )
        if seed is None:
            seed = self.broadcast(torch.initial_seed())
        layers = [(index, module[index]) for index in range(start, stop)]  # a layer placed twice runs twice
        self.runner = StageRunner(
            layers,
            self.stage,
            self.ranks,
            channels,
            chunks,
            checkpoint,
            self.device,
            seed,
            StageSkips(self.skips, self.stage),
        )
        self.ties = TiedCopies(module, ties, self.stage, layout, rank, self.device)  # collective with ties
        self.runner.after_drain = self.ties.after_drain
        self.runner.split_backward = split_backward
        self.runner.check_per_sample = check_per_sample
        if self._own_board:
            self.runner.on_error = self.board.publish
        if self.replica_group is not None:
            tied = self.ties.excluded()  # their replica average is part of the tie's sum
            self.runner.grad_sync = GradientSync(
                [p for p in self.parameters() if id(p) not in tied], self.replica_group
            )
        _live.add(self)
        if self.group is not None:
            for hook in on_pipeline_built:
                hook(self)

    def sync_gradients(self, replicated: Optional[list[nn.Parameter]] = None) -> None:
        """Average this stage's gradients (and ``replicated`` ones) over the data-parallel replicas.

        Most buckets went out during the drain already; this sends the rest and waits. A no-op with one
        replica. ``replicated``: parameters outside the pipeline that every rank holds (a head).
        """
        sync = self.runner.grad_sync
        if sync is not None:
            if replicated is not None:
                sync.add_replicated(replicated)
            sync.finish(self.watch("the average of the gradients over the data-parallel replicas"))

    def describe(self, rank: int) -> str:
        """How error messages name the stage of ``rank``."""
        return f"stage {self.layout.stage_of(rank)}"

    def broadcast(self, obj: Any, stage: int = 0) -> Any:
        """``obj`` as ``stage`` has it, on every stage of this pipeline; collective."""
        if self.group is None:
            return obj
        return distributed.broadcast_object(obj, self.ranks[stage], self.group, self.watch("a broadcast"), self.device)

    def gather(
        self, obj: Any, to_all: bool = True, doing: str = "a gather of every stage's state"
    ) -> Optional[list[Any]]:
        """``obj`` from every stage of this pipeline, in stage order: on every stage if ``to_all``, else on the
        first stage only (``None`` on the others); collective. ``doing`` names it in a deadlock's error."""
        if self.group is None:
            return [obj]
        return distributed.gather_objects(obj, self.group, self.watch(doing), dst=None if to_all else self.ranks[0])

    def watch(self, doing: str) -> distributed.Watch:
        """What a collective of the whole pipeline polls while it waits (see :mod:`lightning_gpipe.engine.distributed`).

        It raises :class:`~lightning_gpipe.PipelineError` once another rank failed, or once a message
        from a peer has waited through the collective (:data:`STRAY_GRACE`): that peer is inside a
        backbone call this rank never made, and will not join. ``doing`` names the collective.
        """

        def check() -> None:
            self.board.raise_if_failed()
            runner = getattr(self, "runner", None)  # construction broadcasts the seed before the runner exists
            channels = runner.channels if runner is not None else None
            stray = channels.stray(STRAY_GRACE) if channels is not None else None
            if stray is not None:
                situation = f"stage {self.stage} is in {doing}, which every rank of the pipeline must join"
                raise PipelineError(stray_message_error(stray[1], stray[0], self.stage, situation))

        return distributed.Watching(check, doing, self.board.lost)

    def idle_stray(self, older_than: float) -> Optional[str]:
        """Why the stages are out of step, if a peer's message waited ``older_than`` s with no call under way.

        Polled by a background thread (``FailureBoard.add_check``): it catches a peer that started a
        backbone call this rank never makes while this rank is blocked in a collective that is not this
        package's (Lightning's loop broadcasts from rank 0 before every training batch). A rank that is
        merely slow outside the pipeline for that long is taken as out of step too, so ``older_than`` is
        generous (the strategy's ``failure_timeout``).
        """
        runner = getattr(self, "runner", None)  # the board starts watching before the runner is built
        channels = runner.channels if runner is not None else None
        if channels is None or runner is None or runner.open_calls:
            return None
        stray = channels.stray(older_than)
        if stray is None:
            return None
        situation = (
            f"stage {self.stage} has had no backbone call under way for {older_than:.0f}s (or it has been busy that "
            f"long outside the backbone: in a step, hook or data loader that hangs or is that slow; where it is only "
            f"that slow, give the job a larger failure timeout, `GPipeStrategy(failure_timeout=...)`)"
        )
        return stray_message_error(stray[1], stray[0], self.stage, situation)

    @property
    def call_label(self) -> Callable[[], str]:
        """What names the caller's context in every message (default: nothing); see :class:`~.comm.Tag`.

        Stages whose calls come from different places (a hook that runs on one rank only) fail at
        the first message, with both places named. The Lightning strategy sets the running hook.
        """
        return self.runner.label

    @call_label.setter
    def call_label(self, label: Callable[[], str]) -> None:
        self.runner.label = label

    @property
    def batch_fingerprint(self) -> Optional[int]:
        """The fingerprint of the current step's batch (:func:`~lightning_gpipe.engine.microbatch.fingerprint`).

        Every stage checks that the previous stage holds the same batch. Set it before each step to the
        fingerprint of the whole batch (inputs and targets); ``None`` (the default): each call uses
        the fingerprint of the backbone's input.
        """
        return self.runner.batch_fingerprint

    @batch_fingerprint.setter
    def batch_fingerprint(self, value: Optional[int]) -> None:
        self.runner.batch_fingerprint = value

    @property
    def chunks(self) -> int:
        """Micro-batches per batch (``M``)."""
        return self.runner.chunks

    @contextmanager
    def whole_batches(self) -> Iterator[None]:
        """Within, a call runs its batch as one micro-batch: for a look at the model that must see the batch as one
        device does (the model summary's sizes and flops), never for training, whose results depend on ``chunks``.
        Every stage of the pipeline must enter it around the same call."""
        chunks, self.runner.chunks = self.runner.chunks, 1
        try:
            yield
        finally:
            self.runner.chunks = chunks

    @property
    def seed(self) -> int:
        """The root of the random streams (with :attr:`calls`, what a resumed run needs to draw alike)."""
        return self.runner.seed

    @seed.setter
    def seed(self, seed: int) -> None:
        self.runner.seed = seed

    @property
    def calls(self) -> int:
        """Training calls so far: with the seed, the key of every random stream. Saved with a checkpoint and set
        back on resume, so that dropout draws the masks of an uninterrupted run."""
        return self.runner.calls

    @calls.setter
    def calls(self, calls: int) -> None:
        self.runner.calls = calls

    @property
    def has_peers(self) -> bool:
        """Whether this stage talks to other stages (its receiving threads may wait on a peer that is gone)."""
        return self.runner.channels is not None

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """No gradient averaging over replicas inside the block (gradient accumulation), as in DDP's ``no_sync``."""
        sync = self.runner.grad_sync
        if sync is None:
            yield
            return
        sync.enabled = False
        try:
            yield
        finally:
            sync.enabled = True

    @property
    def checkpoint(self) -> str:
        return self.runner.checkpoint

    @property
    def tracer(self) -> Optional[Tracer]:
        """What this stage reports its passes to (see :class:`~lightning_gpipe.StageTimer`); ``None``: nothing."""
        return self.runner.tracer

    @tracer.setter
    def tracer(self, tracer: Optional[Tracer]) -> None:
        self.runner.tracer = tracer

    def bytes_sent(self) -> dict[int, int]:
        """Tensor bytes this stage has sent to each other stage of its pipeline so far (headers aside)."""
        channels = self.runner.channels
        sent = channels.bytes_sent() if channels is not None else {}
        return {self.layout.stage_of(rank): n for rank, n in sent.items() if rank in self.ranks}

    def local_layers(self) -> list[tuple[int, nn.Module]]:
        """This stage's ``(index, layer)`` pairs."""
        return self.runner.layers

    def forward(self, input: Any) -> microbatch.Outputs:
        """The whole Sequential's output for ``input``, on every stage; ``input`` is ``nn.Sequential.forward``'s name,
        so that a call by keyword (``self.backbone(input=x)``) runs as on one device."""
        return self.runner(input)

    def tied_names(self) -> dict[str, str]:
        """This stage's name of each parameter tied across stages -> its name in the whole Sequential, where
        they differ (``{"6.weight": "0.weight"}`` on the stage of layer 6 when layers 0 and 6 share a weight)."""
        return self.ties.canonical_names()

    def full_sequential(self) -> nn.Sequential:
        """The Sequential this pipeline was built from (other stages' layers are on ``meta`` until reassembled)."""
        return self._full[0]

    @contextmanager
    def stage_state(self) -> Iterator[None]:
        """Within, ``state_dict()`` returns this stage's entries only, for code that knows it gets a part.

        Outside, ``state_dict()`` of a pipeline of more than one stage raises instead: a partial state that
        looks like a whole one (its keys are the Sequential's) is how a saved model silently loses layers.
        """
        self._partial_state += 1
        try:
            yield
        finally:
            self._partial_state -= 1

    def __reduce_ex__(self, protocol: Any) -> Any:
        """A pipeline of one process copies and pickles as a module does; one partitioned over several refuses.

        ``copy.deepcopy`` and pickling both come here. A partitioned pipeline holds one stage's layers and the
        process groups that join it to the others, which cannot be copied (torch's error names a ``PrefixStore``),
        and a copy of one stage could not run or stand for the backbone anyway. The common caller is weight
        averaging that copies the live model during a fit (``AveragedModel(pl_module.backbone)`` in a callback).
        """
        if self.layout.pipe_size > 1 and self.group is not None:
            layers = layer_span(*stage_bounds(self.balance)[self.stage])
            raise TypeError(
                f"A copy (copy.deepcopy, pickle) was asked of a backbone partitioned over {self.layout.pipe_size} "
                f"stages during a fit: this process holds only stage {self.stage} (layers {layers} of "
                f"{self.num_layers}) and the process groups that join it to the other stages, which cannot be copied. "
                "To average the weights, use Lightning's EMAWeightAveraging or StochasticWeightAveraging callback, or "
                "make the AveragedModel in the LightningModule's __init__ (every stage then averages its own layers); "
                "to copy the whole model, copy it before `fit` or after it, when the backbone is whole again."
            )
        return super().__reduce_ex__(protocol)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """This stage's state, under the Sequential's keys: inside :meth:`stage_state` only, when partitioned."""
        if self.layout.pipe_size > 1 and not self._partial_state:
            layers = layer_span(*stage_bounds(self.balance)[self.stage])
            owner = "<module>." + self.ties.prefix[:-1] if self.ties.prefix else "pipe"
            raise RuntimeError(
                f"state_dict() of a backbone partitioned over {self.layout.pipe_size} stages would hold only "
                f"this process's stage {self.stage} (layers {layers} of {self.num_layers}), "
                "under keys that look like the whole model's, so a saved or copied model would silently miss the "
                f"other stages' layers. Instead, {self.whole_state_hint}. For this stage's part on purpose, call it "
                f"inside `with {owner}.stage_state():`."
            )
        return super().state_dict(*args, **kwargs)

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # A whole Sequential's state loads (`model.load_state_dict(whole)`, as weight-averaging callbacks call it on
        # resume): each stage takes its own layers' entries and leaves the other layers' to their stages. Which keys
        # a whole state must hold is the caller's check (the Lightning strategy checks them on every rank alike).
        own = set(self._modules)
        for key in [k for k in state_dict if k.startswith(prefix)]:
            layer = key[len(prefix) :].split(".", 1)[0]
            if layer in self._layer_index and layer not in own:
                del state_dict[key]
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def close(self) -> None:
        """Shut the links between stages down; collective, call on every process of the job."""
        _live.discard(self)
        if self._aside is not None:  # the Sequential is whole again (reassembled) or given back as it is
            self._aside.remove()
            self._aside = None
        if self.has_peers:
            assert self.runner.channels is not None
            self.runner.channels.close()
            self.runner.channels = None
        if self.runner.grad_sync is not None:
            self.runner.grad_sync.remove()
            self.runner.grad_sync = None
        self.ties.close()
        if self._own_mesh:
            for group in (self.group, self.replica_group):
                if group is not None:
                    dist.destroy_process_group(group)
        self.group = self.replica_group = self.mesh = None
        if self._own_board:
            self.board.stop()

    def __len__(self) -> int:
        return self.num_layers

    @contextmanager
    def all_layers(self) -> Iterator[None]:
        """Within, indexing, slicing and iterating reach every layer, another stage's as its ``meta`` copy
        (parameters without values), instead of raising: for the code that builds the optimizers, which selects
        layers by position on one device (``self.backbone[-1].parameters()``, a param group per layer). The
        pipeline's submodules are every layer too, in the Sequential's order, so ``named_parameters()`` and
        ``parameters()`` (of the LightningModule as well) list the whole model under its one-device names: param
        groups built by name (a rate per depth) and values counted over them (a rate scaled by the model's size)
        come out as on one device. Every stage then builds the same param groups; the strategy drops the ``meta``
        parameters from them (:func:`~lightning_gpipe.engine.optimizers.accept_empty_parameter_lists`)."""
        own = self._modules
        outermost = self._all_layers == 0 and self.layout.pipe_size > 1
        if outermost:
            whole = OrderedDict((name, self._layer(i)) for i, name in enumerate(self.layer_names))
            self._modules = whole  # type: ignore[assignment]
        self._all_layers += 1
        try:
            # a tie listed once, under its one-device name (each spot in another stage's layer holds a placeholder)
            with one_parameter_per_tie(self, self.ties.ties, self.stage) if outermost else nullcontext():
                yield
        finally:
            self._all_layers -= 1
            self._modules = own

    def __iter__(self) -> Iterator[nn.Module]:
        if self.layout.pipe_size == 1:
            return iter([layer for _, layer in self.local_layers()])
        if self._all_layers:
            return iter([self[i] for i in range(self.num_layers)])
        self._refuse_iteration()

    def children(self) -> Iterator[nn.Module]:
        """This process's layers, for the traversals of torch, Lightning and this package (``train()``, ``apply``,
        ``.to()``, ``BackboneFinetuning``), which mean the modules this process holds.

        Code of the user's that lists the children of a partitioned backbone gets this stage's layers only, where the
        k-th child is not layer k: freezing the first two children in a callback froze stage 1's first two layers
        on rank 1, 4.2e-2 off one device and no error. That is refused as iterating over the backbone is (within
        :meth:`all_layers`, every layer is listed).
        """
        if self.layout.pipe_size > 1 and not self._all_layers:
            caller = sys._getframe(1).f_globals.get("__name__", "")  # the module whose code asks
            if caller.partition(".")[0] not in _TRAVERSING:
                self._refuse_iteration("listing its `children()`")
        return super().children()

    def _refuse_iteration(self, what: str = "iterating over it") -> NoReturn:
        raise TypeError(
            f"The backbone is partitioned over {self.layout.pipe_size} stages and this process holds only layers "
            f"{[i for i, _ in self.local_layers()]} (stage {self.stage}), so {what} would see some layers on some "
            "ranks only, and the k-th would not be layer k. Iterate over `local_layers()` for this stage's (index, "
            "layer) pairs, use `named_children()` (the names are the whole Sequential's), or select parameters by "
            "name (`named_parameters()` of the LightningModule). " + _RUN_THE_PIPE
        )

    def __getitem__(self, index: Union[int, slice]) -> nn.Module:
        """A layer, or a Sequential of layers for a slice, as ``nn.Sequential`` indexes: only this stage's layers.

        Indexing a layer another stage holds raises an ``IndexError`` that names the layer, its stage
        and what to use instead. The same code runs on every rank, so the run then fails on every rank
        (the other ranks learn it from the failure board within a second). Inside :meth:`all_layers` it
        gives the layer's ``meta`` copy instead.
        """
        if isinstance(index, slice):
            indices = list(range(self.num_layers)[index])
            if not self._all_layers:
                self._refuse_missing([i for i in indices if self.layer_names[i] not in self._modules])
            return nn.Sequential(OrderedDict((self.layer_names[i], self._layer(i)) for i in indices))
        i = operator.index(index)
        if not -self.num_layers <= i < self.num_layers:
            raise IndexError(f"index {index} is out of range for a backbone of {self.num_layers} layers")
        i %= self.num_layers
        if not self._all_layers:
            self._refuse_missing([i] if self.layer_names[i] not in self._modules else [])
        return self._layer(i)

    def __getattr__(self, name: str) -> Union[Tensor, nn.Module]:
        """A layer by its name in an ``OrderedDict`` Sequential (``backbone.head``), as :meth:`__getitem__` gives it.

        Without this, another stage's layer would be a bare ``AttributeError`` on some ranks and the layer on others.
        """
        try:
            return super().__getattr__(name)
        except AttributeError:
            index = self.__dict__.get("_layer_index", {}).get(name)
            if index is None:
                raise
            return self[index]

    def _layer(self, i: int) -> nn.Module:
        layer = self._modules.get(self.layer_names[i])
        return layer if layer is not None else self.full_sequential()[i]  # another stage's, inside `all_layers()`

    def _refuse_missing(self, missing: list[int]) -> None:
        if not missing:
            return
        bounds = stage_bounds(self.balance)
        where = ", ".join(
            f"layer {self._describe_layer(i)} on stage {s} (rank {self.ranks[s]})"
            for i in missing
            for s, (start, stop) in enumerate(bounds)
            if start <= i < stop
        )
        name = (self.ties.prefix or "backbone.") + self.layer_names[missing[0]]
        raise IndexError(
            f"The backbone is partitioned over {self.layout.pipe_size} stages: {where}, but this process runs stage "
            f"{self.stage}, which holds layers {[i for i, _ in self.local_layers()]}. The same code runs on every "
            f"rank, so the run stops on every rank. Select layers by parameter name instead, e.g. "
            f"`[p for n, p in self.named_parameters() if n.startswith('{name}.')]` (empty on the stages "
            "without the layer), or use `local_layers()` for this stage's (index, layer) pairs. (In "
            "`configure_optimizers`, selecting layers by position works: another stage's layer reads there as its "
            "`meta` copy, whose parameters the optimizers leave out.) In a `BaseFinetuning` callback, give `freeze` "
            "and `unfreeze_and_add_param_group` the whole backbone (`pl_module.backbone`): each stage then walks its "
            "own layers, as `BackboneFinetuning` does; a part of it chosen by position would add a param group on "
            "some stages only. " + _RUN_THE_PIPE
        )

    def _describe_layer(self, i: int) -> str:
        """``3 (Linear)``, or ``3 `head` (Linear)`` where the Sequential names its layers."""
        name = self.layer_names[i]
        named = f" `{name}`" if name != str(i) else ""
        return f"{i}{named} ({type(self.full_sequential()[i]).__name__})"

    def extra_repr(self) -> str:
        return (
            f"stage={self.stage} of {self.layout.pipe_size}, balance={self.balance}, chunks={self.chunks}, "
            f"checkpoint={self.checkpoint!r}"
        )
