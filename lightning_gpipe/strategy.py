"""``GPipeStrategy``: Lightning glue that runs a LightningModule's Sequential backbone as a pipeline."""

from __future__ import annotations

import itertools
import types
from collections.abc import Generator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from typing_extensions import override

import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only

from lightning_gpipe import clipping, microbatch, optim_state, state
from lightning_gpipe._checkpoints import PipelineCheckpoints
from lightning_gpipe._collectives import ReplicaCollectives
from lightning_gpipe._lightning import (
    backbone_sample,
    current_hook,
    init_process_group,
    launcher,
    optimizers_to_device,
    preserved_rng,
)
from lightning_gpipe.batchnorm import DeferredBatchNorm
from lightning_gpipe.failure import FailureBoard, destroy_process_groups_at_exit, exit_without_finalizers
from lightning_gpipe.partition import balance as optimal_balance
from lightning_gpipe.partition import balance_by_params, parameter_costs, split_table, validate_balance
from lightning_gpipe.pipe import GPipe, make_mesh
from lightning_gpipe.profiling import COST_KINDS, LayerCosts, profile_layers
from lightning_gpipe.replicas import broadcast_from_first_replica
from lightning_gpipe.schedule import CHECKPOINT_MODES
from lightning_gpipe.summary import use_pipeline_summaries
from lightning_gpipe.tied import refuse_ties_outside
from lightning_gpipe.topology import PipeLayout

__all__ = ["GPipeStrategy"]

_runs = itertools.count()  # names each run's failure board; every rank counts its runs the same way


class GPipeStrategy(PipelineCheckpoints, ReplicaCollectives, ParallelStrategy):
    """Train the ``nn.Sequential`` at ``module.<backbone>`` as a GPipe pipeline, one stage per process.

    ``Trainer(strategy="gpipe", devices=K)`` splits the backbone into ``K`` stages, puts one on each
    device and cuts every batch into ``chunks`` micro-batches. The LightningModule is unchanged:
    ``self.backbone(x)`` returns the backbone's real output on every rank, and each rank's optimizer
    steps its own stage plus the layers outside the backbone (which every rank holds, in sync).

    Args:
        balance: how to split the backbone: layers per stage (one entry per stage), or the cost whose
            largest stage the split minimizes (exactly, see :func:`lightning_gpipe.balance`):
            ``"params"`` (the default: parameter count, nothing is run), ``"time"`` (forward plus
            backward of each layer on the device, median of 5 repeats) or ``"memory"`` (parameter,
            gradient and Adam-like optimizer-state bytes plus the activations one micro-batch saves).
            ``"time"`` and ``"memory"`` profile the layers one at a time on global rank 0, on one
            micro-batch of the first batch of the dataloader (run through ``training_step`` up to the
            backbone), or of ``example_input_array`` (run through ``forward``) when that fails; the
            split is broadcast to every rank. The chosen split is logged on rank 0.
        chunks: micro-batches per batch (``M``). Results do not depend on the number of stages; with
            random layers (dropout) they do depend on ``chunks``, which keys the random streams.
        checkpoint: ``"except_last"`` (default), ``"always"`` or ``"never"``: which micro-batches drop
            their activations in the forward and recompute them in the backward.
        backbone: the attribute (a dotted path is allowed) that holds the Sequential.
        pipe_size: stages per pipeline; the default is every device of a node. With fewer, the
            processes form ``world_size // pipe_size`` data-parallel replicas of the pipeline.
        seed: the root of the pipeline's random streams; by default the first stage's
            ``torch.initial_seed()``, which ``seed_everything`` sets.
        timeout: seconds a stage waits for a message from another before it fails the run.
        start_method: ``"popen"`` (scripts), ``"spawn"`` or ``"fork"`` (notebooks, tests).
        watchdog_grace: seconds a rank may stay blocked (in a collective of Lightning's) after another
            rank failed, before the watchdog ends its process.
        failure_timeout: seconds without a heartbeat after which a rank counts as dead (a killed rank
            is usually noticed at once, through its closed connections; this is the fallback); also how
            long a message from the previous stage may wait untaken while this rank has no backbone call
            under way before the stages count as out of step (a call made on one rank only).
        state_dict_type: ``"full"`` (default): one checkpoint file gathered on the first stage,
            loadable on one device without this package; ``"sharded"``: a directory written by every
            stage with ``torch.distributed.checkpoint``, for models too big to gather on one host.
        deferred_batch_norm: replace the backbone's BatchNorm layers by
            :class:`~lightning_gpipe.DeferredBatchNorm`, whose running statistics cover the whole batch
            instead of moving once per micro-batch.
    """

    strategy_name = "gpipe"

    def __init__(
        self,
        balance: Union[Sequence[int], Literal["params", "time", "memory"]] = "params",
        chunks: int = 4,
        checkpoint: str = "except_last",
        backbone: str = "backbone",
        pipe_size: Optional[int] = None,
        seed: Optional[int] = None,
        timeout: float = 1800.0,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        watchdog_grace: float = 10.0,
        failure_timeout: float = 30.0,
        state_dict_type: Literal["full", "sharded"] = "full",
        deferred_batch_norm: bool = False,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        process_group_timeout: timedelta = timedelta(minutes=30),
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        if isinstance(balance, str) and balance not in COST_KINDS:
            raise ValueError(f"`balance` must be a list of layers per stage or 'params', 'time' or 'memory', "
                             f"got {balance!r}.")
        if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
            raise ValueError(f"`chunks` must be a positive integer (micro-batches per batch), got {chunks!r}.")
        if checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"`checkpoint` must be one of {CHECKPOINT_MODES}, got {checkpoint!r}.")
        if not isinstance(backbone, str) or not backbone:
            raise ValueError(f"`backbone` must name the attribute that holds the nn.Sequential, got {backbone!r}.")
        if pipe_size is not None and (not isinstance(pipe_size, int) or pipe_size < 1):
            raise ValueError(f"`pipe_size` must be a positive integer, got {pipe_size!r}.")
        if state_dict_type not in ("full", "sharded"):
            raise ValueError(f"`state_dict_type` must be 'full' or 'sharded', got {state_dict_type!r}.")
        self.balance, self.chunks, self.checkpoint, self.backbone = balance, chunks, checkpoint, backbone
        self._pipe_size, self.seed, self.timeout = pipe_size, seed, timeout
        self._start_method, self.watchdog_grace = start_method, watchdog_grace
        self.failure_timeout, self.state_dict_type = failure_timeout, state_dict_type
        self.deferred_batch_norm = deferred_batch_norm
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._process_group_timeout = process_group_timeout
        self.pipe: Optional[GPipe] = None
        self._mesh: Optional[Any] = None  # the (dp, pp) DeviceMesh
        self.layer_costs: Optional[LayerCosts] = None  # what balance="time" or "memory" measured, per layer
        self._board: Optional[FailureBoard] = None
        self._failed = False
        self._full_names: list[str] = []  # the model's parameter names in order, before partitioning
        self._layouts: list[optim_state.Layout] = []  # per optimizer: its groups over the whole model
        self._loaders: list[Any] = []  # the resumable training loaders handed to the loop
        self._loader_position: Optional[dict[str, Any]] = None  # from a checkpoint, for the next training loader
        self._batch_idx = -1
        self._replicated: list[nn.Parameter] = []  # parameters outside the backbone, held by every rank

    # -- processes and ranks ---------------------------------------------------------------------------

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def layout(self) -> PipeLayout:
        """How the processes form pipelines: ``pipe_size`` stages, ``world_size // pipe_size`` replicas."""
        return PipeLayout(self.world_size, self._pipe_size or self.num_processes)

    @property
    def is_distributed(self) -> bool:
        # Lightning injects a DistributedSampler only for a "distributed" strategy. The stages of a
        # pipeline must see the same batches, so only data-parallel replicas count.
        return self.layout.num_replicas > 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.layout.num_replicas, "rank": self.layout.replica_of(self.global_rank)}

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._launcher = launcher(self, self._start_method, self._report_failure)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        _ = self.layout  # validates pipe_size against the world size before any work
        if self.world_size > 1:  # pipeline-1 needs no process group
            backend = self._process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")
            init_process_group(self.cluster_environment, backend, self.root_device, self._process_group_timeout)
            destroy_process_groups_at_exit()
        if self.world_size > 1 and self._mesh is None:  # the (dp, pp) groups live as long as the strategy
            self._mesh = make_mesh(self.layout, self.root_device)
        self._board = FailureBoard.for_default_group(self._describe, namespace=f"lightning_gpipe/{next(_runs)}")
        self._failed = False
        if self.world_size > 1:
            self._board.start(self.watchdog_grace, self.failure_timeout)

    def _describe(self, rank: int) -> str:
        layout = self.layout
        replica = f" of replica {layout.replica_of(rank)}" if layout.num_replicas > 1 else ""
        return f"stage {layout.stage_of(rank)}{replica}"

    # -- the model -------------------------------------------------------------------------------------

    def _backbone_owner(self, module: nn.Module) -> tuple[nn.Module, str]:
        *path, name = self.backbone.split(".")
        owner = module
        for part in path:
            owner = getattr(owner, part, None)  # type: ignore[assignment]
            if owner is None:
                break
        if owner is None or not hasattr(owner, name):
            raise ValueError(
                f"{type(module).__name__} has no attribute `{self.backbone}`; the gpipe strategy pipelines the "
                f"nn.Sequential found there. Assign your layers to `self.{self.backbone} = nn.Sequential(...)`, or "
                f"name the attribute with GPipeStrategy(backbone=...)."
            )
        return owner, name

    def _build_pipe(self) -> GPipe:
        module = self.lightning_module
        assert module is not None
        owner, name = self._backbone_owner(module)
        sequential = getattr(owner, name)
        if isinstance(sequential, GPipe):  # set up again after a failed run that could not reassemble it
            sequential = sequential.full_sequential()
        if not isinstance(sequential, nn.Sequential):
            raise TypeError(
                f"`{type(module).__name__}.{self.backbone}` is a {type(sequential).__name__}, but the gpipe strategy "
                "splits an nn.Sequential into stages. Make the backbone an nn.Sequential of its layers."
            )
        layout = self.layout
        if layout.pipe_size > len(sequential):
            raise ValueError(
                f"The pipeline has {layout.pipe_size} stages but `{self.backbone}` has only {len(sequential)} layers; "
                f"every stage needs at least one layer. Use at most {len(sequential)} devices per pipeline."
            )
        balance = self._choose_balance(sequential, layout.pipe_size)
        if self.deferred_batch_norm:  # after profiling (which would count as micro-batches), before partitioning
            DeferredBatchNorm.convert_deferred_batch_norm(sequential, self.chunks)
        refuse_ties_outside(module, sequential, self.backbone + ".")
        self._full_names = [n for n, _ in module.named_parameters()]
        pipe = GPipe(sequential, balance, chunks=self.chunks, checkpoint=self.checkpoint, layout=layout,
                     device=self.root_device, seed=self.seed, timeout=self.timeout, board=self._board, mesh=self._mesh)
        pipe.ties.prefix = self.backbone + "."
        setattr(owner, name, pipe)
        return pipe

    def _choose_balance(self, sequential: nn.Sequential, stages: int) -> list[int]:
        """The split: given, by parameter count, or by costs that rank 0 measures and broadcasts; logged."""
        self.layer_costs = None
        if not isinstance(self.balance, str):
            balance = validate_balance(self.balance, len(sequential), stages)
        elif self.balance == "params":
            balance = balance_by_params(sequential, stages)
        else:
            self.layer_costs = self._measure_costs(sequential)
            balance = optimal_balance(self.layer_costs.of(self.balance), stages)
        costs = self.layer_costs
        rank_zero_info(f"GPipe split of `{self.backbone}` into {stages} stage{'s' * (stages > 1)} by "
                       f"balance={self.balance!r}:\n"
                       + split_table(balance, parameter_costs(sequential), costs and costs.time, costs and costs.memory)
                       + ("" if costs else "\n(time and memory are measured with balance='time' or 'memory')"))
        return balance

    def _measure_costs(self, sequential: nn.Sequential) -> LayerCosts:
        """Profile on global rank 0 only and broadcast, so that every rank builds the same split."""
        outcome: Any = None
        if self.global_rank == 0:
            try:
                with preserved_rng():
                    sample, where = backbone_sample(self.lightning_module, sequential, self.backbone, self.chunks)
                    outcome = profile_layers(sequential, sample, self.root_device,
                                             context=self.precision_plugin.forward_context)
                rank_zero_info(f"Profiled `{self.backbone}` layer by layer on {self.root_device} with {where}.")
            except Exception as error:
                outcome = error
        shared = self.broadcast(outcome if not isinstance(outcome, Exception) else
                                (type(outcome).__name__, str(outcome)), src=0)
        if isinstance(outcome, Exception):
            raise outcome
        if isinstance(shared, tuple):  # rank 0 failed: fail alike, with its message
            raise {"ValueError": ValueError, "TypeError": TypeError}.get(shared[0], RuntimeError)(shared[1])
        return shared

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None
        _refuse_fp16_scaler(self.precision_plugin)
        self.accelerator.setup(trainer)
        self.pipe = self._build_pipe()
        module = self.lightning_module
        self.pipe.call_label = lambda: current_hook(module)  # type: ignore[arg-type]
        pipe, board = self.pipe, self._board
        if board is not None:
            board.add_check(lambda: pipe.idle_stray(self.failure_timeout))
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._sync_replicated()
        if trainer.state.fn == TrainerFn.FITTING:
            try:
                self.setup_optimizers(trainer)
            except ValueError as error:
                if "empty parameter list" not in str(error):
                    raise
                raise ValueError(
                    f"Stage {self.pipe.stage} has no parameters for its optimizer (layers "
                    f"{[i for i, _ in self.pipe.local_layers()]}). Give every stage trainable layers with `balance`, "
                    "or keep a trainable layer outside the backbone (a head) that every stage steps.") from error
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)
            self._layouts = [self._optimizer_layout(o) for o in self.optimizers]
        _use_global_norm_clipping(self.precision_plugin, self)
        use_pipeline_summaries(trainer.callbacks)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)  # the other stages' layers are not submodules any more: they stay put

    def _sync_replicated(self) -> None:
        """Give every stage the first stage's copy of the layers outside the backbone, and its random state.

        Those layers are replicated, so they must start equal; the random state must be equal so that a
        ``RandomSampler`` (which draws from it) orders the data alike on every stage.
        """
        pipe = self.pipe
        module = self.lightning_module
        assert pipe is not None and module is not None
        backbone = {id(t) for t in [*pipe.parameters(), *pipe.buffers()]}
        self._replicated = [p for p in module.parameters() if id(p) not in backbone]
        # replicas of a stage start equal, as under DDP: the first replica's weights everywhere
        broadcast_from_first_replica([*module.parameters(), *module.buffers()], pipe.replica_group)
        if pipe.group is None:
            return
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                if id(tensor) not in backbone:
                    dist.broadcast(tensor.data, src=pipe.ranks[0], group=pipe.group)
        torch.set_rng_state(pipe.broadcast(torch.get_rng_state()))
        if self.root_device.type == "cuda":
            torch.cuda.set_rng_state(pipe.broadcast(torch.cuda.get_rng_state(self.root_device)), self.root_device)

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        """Move the batch, after taking its fingerprint: every stage checks that the others got the same batch.

        Taken before the transfer, on the batch as the loader made it (inputs and targets), so that on a GPU
        it costs no synchronization.
        """
        if self.pipe is not None and len(self.pipe.ranks) > 1:
            self.pipe.batch_fingerprint = microbatch.fingerprint(batch)
        return super().batch_to_device(batch, device, dataloader_idx)

    # -- gradients -------------------------------------------------------------------------------------

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        """Average gradients over the data-parallel replicas (a no-op with one pipeline)."""
        if self.pipe is not None:
            self.pipe.sync_gradients(self._replicated)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No gradient averaging while Lightning accumulates gradients over several batches."""
        sync = self.pipe.runner.grad_sync if self.pipe is not None else None
        if sync is None:
            yield None
            return
        sync.enabled = False
        try:
            yield None
        finally:
            sync.enabled = True

    def _report_failure(self, exception: BaseException) -> Optional[BaseException]:
        """Tell the other ranks at once (before Lightning runs any callback's ``on_exception``), then stop
        every collective of this rank: the peers will not join them.

        Returns the error to raise instead: the one a background check of this rank found, when the
        exception is only how the blocked call it found ended (a peer closed the connection).
        """
        self._failed = True
        board = self._board
        if board is not None:
            board.publish(exception)
        if self.pipe is not None and self.pipe.runner.channels is not None:  # threads may wait on dead peers
            exit_without_finalizers(board)
        found = board.found if board is not None else None
        return found if found is not None and found is not exception else None

    @property
    def failed(self) -> bool:
        """Whether this rank's run failed (or learnt of another rank's failure): its collectives are skipped."""
        return self._failed

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._report_failure(exception)  # already done by the launcher, unless it was not this strategy's

    @override
    def teardown(self) -> None:
        """Put the backbone back into the LightningModule as an ``nn.Sequential``.

        Full mode: the whole trained backbone, on every rank (the other stages' layers on the CPU).
        Sharded mode is for models that do not fit one host, so nothing is gathered: each rank keeps its
        own stage's trained layers and the other stages' layers stay on ``meta``, where any use fails
        loudly instead of running with untrained weights.
        """
        sharded: Optional[tuple[nn.Module, str, nn.Sequential]] = None
        if self.pipe is not None and not self._failed:
            module = self.lightning_module
            assert module is not None
            owner, name = self._backbone_owner(module)
            if self.state_dict_type == "sharded":  # put in after Lightning's `module.cpu()`, which meta would fail
                sharded = (owner, name, self.pipe.full_sequential())
            else:
                setattr(owner, name, state.reassemble(self.pipe))
            self.pipe.close()
        self.pipe = None
        if self._board is not None and not self._failed:  # after a failure it keeps watching until the exit
            self._board.stop()
        super().teardown()
        if sharded is not None:
            owner, name, sequential = sharded
            setattr(owner, name, sequential)
            rank_zero_info(
                f"state_dict_type='sharded': after the run each rank holds only its own stage of `{self.backbone}` "
                "(the other layers are on the meta device). For the whole model, load the sharded checkpoint "
                "with `lightning_gpipe.checkpoint.consolidate(path)`.")

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        entries = (("gpipe", "popen"), ("gpipe_spawn", "spawn"), ("gpipe_fork", "fork"), ("gpipe_notebook", "fork"))
        for name, start_method in entries:
            strategy_registry.register(name, cls, description=f"GPipe pipeline, processes started with "
                                       f"{start_method!r}", start_method=start_method)


def _refuse_fp16_scaler(plugin: Precision) -> None:
    # A GradScaler per stage would decide on its own stage's gradients alone: the stages would disagree on
    # skipping a step and on the scale, and the backbone's gradients would be unscaled by another scale than
    # the one they were scaled with. bf16 needs no scaler.
    if isinstance(plugin, MixedPrecision) and plugin.scaler is not None:
        raise ValueError(
            f"precision={plugin.precision!r} is not supported by the gpipe strategy: it scales the loss with a "
            "GradScaler on each stage, and the stages would disagree on skipped steps and on the scale. Use "
            "precision='bf16-mixed' (no loss scaling needed), or '32-true'."
        )


def _use_global_norm_clipping(plugin: Precision, strategy: GPipeStrategy) -> None:
    # Lightning clips through `precision_plugin.clip_grad_by_norm(optimizer, clip_val)`, a public method
    # with no strategy hook around it. Norm clipping must use the norm over all stages, so this one
    # helper rebinds that method on the plugin instance.
    def clip_grad_by_norm(self: Precision, optimizer: torch.optim.Optimizer, clip_val: Union[int, float]) -> None:
        pipe = strategy.pipe
        assert pipe is not None
        clipping.clip_grad_norm_(self.main_params(optimizer), clip_val, pipe.parameters(),
                                 count_replicated=pipe.stage == 0, group=pipe.group,
                                 counted_elsewhere=pipe.ties.counted_elsewhere())

    plugin.clip_grad_by_norm = types.MethodType(clip_grad_by_norm, plugin)  # type: ignore[method-assign]
