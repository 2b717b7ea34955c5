"""``GPipeStrategy``: the Lightning glue that runs a LightningModule's Sequential backbone as a pipeline.

One class, like Lightning's own ``ddp.py`` and ``fsdp.py``: it overrides documented strategy hooks and
hands the work to the plain modules (the engine, checkpointing, balancing). Every private Lightning
access it needs is in :mod:`lightning_gpipe._lightning`. The sections below follow a run: processes,
the model, the step, collectives, data, checkpoints, failure and teardown.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from datetime import timedelta
from typing import Any, Callable, Literal, NoReturn, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor, nn
from typing_extensions import override

from lightning_gpipe import metric_sync, refusals, weight_averages
from lightning_gpipe._lightning import (
    START_METHODS,
    atomic_checkpoint_io,
    averaged_copies,
    count_throughput_per_pipeline,
    current_hook,
    dump_model_state_with,
    evaluation_batches,
    finetuning_callbacks,
    finetuning_group_names,
    first_batch,
    graph_loggers,
    init_process_group,
    launcher,
    optimizers_to_device,
    restart_training_iterator,
    restore_finetuning_param_groups,
    sample_loaders,
    seed_workers,
    silence_not_resumable_warning,
    silence_sync_dist_advice,
    tell_swa_about_batch_norm,
    use_pipeline_summaries,
    validation_interval_seconds,
    walk_stages_in_finetuning,
    with_finetuning_group_names,
)
from lightning_gpipe._subclass import copy_as
from lightning_gpipe.balancing.check import BalanceCheck, ComputeTally, compare
from lightning_gpipe.balancing.plan.auto import AUTO, AutoChoice, choose, parse_bytes
from lightning_gpipe.balancing.plan.link import LinkModel, measure_link
from lightning_gpipe.balancing.plan.search import searched_split
from lightning_gpipe.balancing.profiling import COST_KINDS, LayerCosts, crossable_at, profile_layers
from lightning_gpipe.balancing.sample import (
    NoSampleError,
    backbone_input,
    backbone_sample,
    described,
    sample_micro_batch,
)
from lightning_gpipe.checkpointing import model_state, optim_state, sharded_leftover
from lightning_gpipe.checkpointing.files import (
    is_sharded,
    load_sharded,
    save_sharded,
    sharded_model_keys,
    stage_selector,
)
from lightning_gpipe.checkpointing.resumable import resumable
from lightning_gpipe.engine import distributed, microbatch, tied
from lightning_gpipe.engine.agreement import (
    DIFFERENT_LOSS_CAUSES,
    DIFFERENT_SETTINGS_CAUSES,
    FREED_BY_THE_DRAIN,
    digest,
    first_difference,
    loss_bits,
    losses_apart,
    optimizer_settings,
)
from lightning_gpipe.engine.batchnorm import DeferredBatchNorm, per_micro_batch_norms
from lightning_gpipe.engine.checkpoint import check_checkpoint_mode
from lightning_gpipe.engine.failure import (
    FailureBoard,
    PipelineError,
    destroy_process_groups_at_exit,
    exit_without_finalizers,
    print_stacks_on_a_crash,
)
from lightning_gpipe.engine.grad_scaler import loss_scale_state
from lightning_gpipe.engine.gradients import stage_norm_keys
from lightning_gpipe.engine.host_malloc import keep_freed_memory
from lightning_gpipe.engine.micro_batch_writes import frequency_scaled_embeddings
from lightning_gpipe.engine.optimizers import accept_empty_parameter_lists
from lightning_gpipe.engine.outer_layers import OuterLayers
from lightning_gpipe.engine.partition import (
    balance_by_params,
    balance_keeping_together,
    check_balance_entries,
    kept_together,
    layer_names,
    parameter_costs,
    split_table,
    validate_balance,
)
from lightning_gpipe.engine.pipe import (
    DEADLOCK_MARGIN,
    GPipe,
    check_seconds,
    check_seed,
    refuse_lazy_layers,
    refuse_own_forward,
    refuse_reserved_names,
    refuse_sync_batch_norm,
)
from lightning_gpipe.engine.replicas import (
    broadcast_buffers_from_first_replica,
    broadcast_from_first_replica,
    refuse_sparse_gradients,
)
from lightning_gpipe.engine.rng import get_rng_state, isolated_rng, set_rng_state
from lightning_gpipe.engine.split_weights import SplitWeights, judge
from lightning_gpipe.engine.stage_copy import StageCopy
from lightning_gpipe.engine.tied import refuse_ties_outside
from lightning_gpipe.engine.topology import PipeLayout, make_mesh
from lightning_gpipe.global_norm_clipping import GlobalNormClipping
from lightning_gpipe.interrupt import InterruptTogether
from lightning_gpipe.prediction_writers import write_once_per_pipeline
from lightning_gpipe.requeue import RequeueTogether
from lightning_gpipe.sigterm import SigtermStop
from lightning_gpipe.stop_together import StopTogether

__all__ = ["GPipeStrategy"]

_runs = itertools.count()  # names each run's failure board; every rank counts its runs the same way


#: The training batches the balance check times: batches _CHECK_FROM to _CHECK_FROM + _CHECK_STEPS - 1.
_CHECK_FROM, _CHECK_STEPS = 2, 4


#: Where :meth:`GPipeStrategy._gather_decisions` was called, in its first column.
_STOP_DECISION, _EVALUATION_BATCH = 1, 2
#: The columns of what :meth:`GPipeStrategy._gather_decisions` returns, one row per rank.
_SIGTERM, _REQUEUE, _INTERRUPT, _STOP, _DIGEST = range(5)
#: What a rank waits for in it, as the deadlock and failure messages say.
_DOING = {_STOP_DECISION: "a decision of every rank (stop or go on)", _EVALUATION_BATCH: "the signals every rank got"}
_POINTS = {
    _STOP_DECISION: "a stop decision (the start of training, the end of a training batch, an epoch or a validation)",
    _EVALUATION_BATCH: "the end of a validation, test or predict batch",
}


class GPipeStrategy(ParallelStrategy):
    """Train the ``nn.Sequential`` at ``module.<backbone>`` as a GPipe pipeline, one stage per process.

    ``Trainer(strategy="gpipe", devices=K)`` splits the backbone into ``K`` stages, puts one on each
    device and cuts every batch into ``chunks`` micro-batches. The LightningModule is unchanged:
    ``self.backbone(x)`` returns the backbone's real output on every rank, and each rank's optimizer
    steps its own stage plus the layers outside the backbone (which every rank holds, in sync).

    Args:
        balance: how to split the backbone: layers per stage (one entry per stage), or the cost whose
            largest stage the split minimizes (exactly, see :func:`lightning_gpipe.balance`):
            ``"params"`` (parameter count, nothing is run), ``"time"`` (forward plus backward of each
            layer on the device, a trimmed mean of 5 repeats) or ``"memory"`` (parameter,
            gradient and Adam-like optimizer-state bytes plus the activations one micro-batch saves).
            ``"time"`` and ``"memory"`` profile the layers one at a time on global rank 0, on one
            micro-batch of the first batch of the dataloader (run through ``training_step`` up to the
            backbone), or of ``example_input_array`` (run through ``forward``) when that fails; the
            split is broadcast to every rank. The code of ``training_step`` before the backbone call
            runs once more for the sample; what it changes in the module's buffers, its torchmetrics
            metrics and the random state is put back, and its ``self.log`` calls log nothing (other
            state it keeps itself, a Python counter say, does see the extra call). The chosen split is
            logged on rank 0. ``"auto"``: the split the planner predicts fastest (see ``chunks="auto"``).
            ``None`` (the default) is ``"time"``, then the split near it that the planner's replay of a
            step (from the same profile) predicts 2% faster or more, if any (frozen first layers keep their
            forward and lose their backward, which a split by time weighs together; see
            :func:`~lightning_gpipe.balancing.plan.search.searched_split`); one stage is not profiled
            (there is nothing to split) and a backbone that gives no sample micro-batch is split by
            ``"params"`` with a warning instead of an error. Time is the default because a parameter
            count says little about compute: on the VGG-style stack of ``benchmarks/trainer.py``
            (parameters grow 16-fold from the first block to the last, compute does not) the ``"params"``
            split ran at 0.56 of the ideal speed-up and the ``"time"`` split at 0.64. The split never
            changes what is learned.
        chunks: micro-batches per batch (``M``); a batch of fewer samples (a short last batch, a
            validation batch of 1) gets one micro-batch per sample. Results do not depend on the number
            of stages; with random layers (dropout) they do depend on ``chunks``, which keys the random
            streams. With BatchNorm in the backbone and ``chunks > 1``, setup warns (see
            ``deferred_batch_norm``). ``"auto"``: the planner (:mod:`lightning_gpipe.balancing.plan`)
            profiles the backbone on rank 0 at every micro-batch size it weighs (1 to the batch size,
            powers of two), replays a step for each candidate and takes the fastest predicted that fits
            in ``max_memory``; the choice and the runner-up are logged on rank 0, with the time it took.
        checkpoint: ``"except_last"`` (default), ``"always"``, ``"never"`` or ``"keep:N"`` (keep the
            activations of the last ``N`` micro-batches, recompute the others): which micro-batches drop
            their activations in the forward and recompute them in the backward. ``"auto"``: the
            planner's choice, as for ``chunks``.
        max_memory: bytes per device the ``"auto"`` choices must fit in (a number, or a size such as
            ``"16GiB"``); by default a CUDA device's total memory, and no cap on the CPU. Given with no
            ``"auto"`` setting, it is refused: nothing would be fitted into it.
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
            under way before the stages count as out of step (a call made on one rank only); and, 5 s more,
            how long ranks may wait for each other before the run ends as a deadlock (see "Failures" in
            the README).
        state_dict_type: ``"full"`` (default): one checkpoint file gathered on the first stage,
            loadable on one device without this package; ``"sharded"``: a directory written by every
            stage with ``torch.distributed.checkpoint``, for models too big to gather on one host.
        deferred_batch_norm: replace the backbone's BatchNorm layers by
            :class:`~lightning_gpipe.DeferredBatchNorm`, whose running statistics cover the whole batch
            instead of moving once per micro-batch.
        split_backward: compute each micro-batch's input gradient first in the drain and send it, then the
            weight gradients (see :class:`~lightning_gpipe.GPipe`); the same results. Off by default: on
            the CPU its graph walk and extra autograd calls cost more than the earlier input gradient saves.
        check_per_sample: refuse, at the first batch that is cut into micro-batches, a backbone layer that mixes
            the samples along dim 0 (see :class:`~lightning_gpipe.GPipe`): most often a sequence-first layer given
            ``(sequence, batch, ...)``. ``False`` runs such layers per micro-batch, as GPipe runs BatchNorm.
        reuse_freed_memory: on the CPU, set each stage process's glibc malloc to keep the memory a step frees
            for the next step instead of returning it to the system and faulting it in again
            (:mod:`lightning_gpipe.engine.host_malloc`): measured 10-14% off a K=2 step on a 2-core machine.
            The resident set then stays near its peak between steps, for the rest of the process. Nothing
            is changed where the environment already tunes malloc (``MALLOC_MMAP_THRESHOLD_`` and the like),
            on a C library other than glibc, or on a GPU; what was done is logged on rank 0 and kept in
            ``host_malloc``.
    """

    strategy_name = "gpipe"
    #: the module's metrics keep syncing over the replicas while its trainer runs this strategy (see metric_sync)
    routes_metric_sync = True

    def __init__(
        self,
        balance: Union[Sequence[int], Literal["params", "time", "memory", "auto"], None] = None,
        chunks: Union[int, Literal["auto"]] = 4,
        checkpoint: str = "except_last",
        max_memory: Union[float, str, None] = None,
        backbone: str = "backbone",
        pipe_size: Optional[int] = None,
        seed: Optional[int] = None,
        timeout: float = 1800.0,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        watchdog_grace: float = 10.0,
        failure_timeout: float = 30.0,
        state_dict_type: Literal["full", "sharded"] = "full",
        deferred_batch_norm: bool = False,
        split_backward: bool = False,
        check_per_sample: bool = True,
        reuse_freed_memory: bool = True,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        process_group_timeout: timedelta = timedelta(minutes=30),
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if balance is not None and isinstance(balance, str) and balance not in (*COST_KINDS, AUTO):
            raise ValueError(
                "`balance` must be a list of layers per stage or 'params', 'time', 'memory' or 'auto', "
                f"got {balance!r}."
            )
        if balance is not None and not isinstance(balance, str):
            balance = check_balance_entries(balance)  # the count and the sum need the backbone: checked at setup
        try:
            if chunks != AUTO:
                chunks = microbatch.check_chunks(chunks)
            if checkpoint != AUTO:
                check_checkpoint_mode(checkpoint)
        except ValueError as error:
            raise ValueError(f"{error} Or 'auto': the planner's choice.") from None
        if isinstance(max_memory, str):
            try:
                max_memory = parse_bytes(max_memory)
            except ValueError as error:
                raise ValueError(f"`max_memory`: {error}") from None
        if max_memory is not None and (
            isinstance(max_memory, bool) or not isinstance(max_memory, (int, float)) or not max_memory > 0
        ):
            raise ValueError(
                f"`max_memory` must be a positive number of bytes per device (or a size such as '16GiB'), got "
                f"{max_memory!r}."
            )
        if max_memory is not None and AUTO not in (balance, chunks, checkpoint):
            raise ValueError(
                f"`max_memory` bounds the planner's 'auto' choices, but none of chunks={chunks!r}, "
                f"checkpoint={checkpoint!r}, balance={balance!r} is 'auto', so nothing would be fitted into it (it "
                "would be ignored). "
                "Set chunks, checkpoint or balance to 'auto' for the planner to choose them within max_memory, or "
                "drop max_memory."
            )
        for name, seconds in (
            ("timeout", timeout),
            ("watchdog_grace", watchdog_grace),
            ("failure_timeout", failure_timeout),
        ):
            check_seconds(name, seconds)
        check_seed(seed)
        if start_method not in START_METHODS:
            raise ValueError(f"`start_method` must be one of {START_METHODS}, got {start_method!r}.")
        if not isinstance(deferred_batch_norm, bool):
            raise TypeError(f"`deferred_batch_norm` must be True or False, got {deferred_batch_norm!r}.")
        #: What the user asked for; ``chunks``, ``checkpoint`` and ``balance`` hold what runs (the plan's, if "auto").
        self.requested = (balance, chunks, checkpoint)
        self.max_memory = max_memory
        self.auto_choice: Optional[AutoChoice] = None
        if not isinstance(backbone, str) or not backbone:
            raise ValueError(f"`backbone` must name the attribute that holds the nn.Sequential, got {backbone!r}.")
        size = microbatch.whole_number(pipe_size) if pipe_size is not None else None
        if pipe_size is not None and (size is None or size < 1):
            raise ValueError(f"`pipe_size` must be a positive integer, got {pipe_size!r}.")
        pipe_size = size
        if state_dict_type not in ("full", "sharded"):
            raise ValueError(f"`state_dict_type` must be 'full' or 'sharded', got {state_dict_type!r}.")
        if not isinstance(split_backward, bool):
            raise TypeError(f"`split_backward` must be True or False, got {split_backward!r}.")
        self.split_backward = split_backward
        if not isinstance(check_per_sample, bool):
            raise TypeError(f"`check_per_sample` must be True or False, got {check_per_sample!r}.")
        self.check_per_sample = check_per_sample
        if not isinstance(reuse_freed_memory, bool):
            raise TypeError(f"`reuse_freed_memory` must be True or False, got {reuse_freed_memory!r}.")
        self.reuse_freed_memory = reuse_freed_memory
        #: What ``reuse_freed_memory`` did in this process: ``"reused"``, or why malloc was left alone.
        self.host_malloc: Optional[str] = None
        #: ``balance=None``: by measured time, by parameter count where nothing can be measured (``_choose_balance``)
        self._default_balance = balance is None
        self.balance: Union[Sequence[int], str] = "time" if balance is None else balance
        self.backbone = backbone
        self.chunks: int = chunks if isinstance(chunks, int) else 1  # "auto": set by the plan at setup
        self.checkpoint: str = checkpoint if checkpoint != AUTO else "except_last"
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
        #: The profiled split checked against training steps 2 to 5 (see :mod:`lightning_gpipe.balancing.check`);
        #: set on every rank after step 5 when the split came from a profile, ``None`` before or otherwise.
        self.balance_check: Optional[BalanceCheck] = None
        self._check_costs: Optional[list[float]] = None  # the profiled time per layer, until the check ran
        self._tally: Optional[ComputeTally] = None
        self._train_batches = 0
        self._board: Optional[FailureBoard] = None
        self._failed = False
        #: After a pipelined run, each rank's optimizers still hold only their stage's state (see ``optimizer_state``).
        self._stage_optimizers = False
        #: The whole model's optimizer states gathered at the end of a fit, by optimizer, on the first stage of each
        #: pipeline, so that ``trainer.save_checkpoint(path)`` after ``fit`` writes what it writes on one device.
        self._states_at_the_end: dict[int, dict[str, Any]] = {}
        self._full_names: list[str] = []  # the model's parameter names in order, before partitioning
        self._layouts: list[optim_state.Layout] = []  # per optimizer: its groups over the whole model
        self._emptied: list[torch.optim.Optimizer] = []  # optimizers given no parameters on this stage
        self._loaders: list[Any] = []  # the resumable training loaders handed to the loop
        #: whether Lightning's checkpoint dump takes :meth:`_checkpoint_state_dict` (see ``dump_model_state_with``)
        self._dump_routed = False
        self._buffers_due = True  # whether DDP would broadcast buffers before the next forward
        self._loader_position: Optional[dict[str, Any]] = None  # from a checkpoint, for the next training loader
        self._batch_idx = -1
        self._outer: Optional[OuterLayers] = None  # every stage's copy of the layers outside the backbone
        self._rng_resynced = False  # whether the stages' random states were found apart and made one (said once)
        self._outer_resynced = False  # the same for the layers outside the backbone
        #: this stage's backbone weights since the split or a restore, until the first training step of a fit
        self._split_weights = SplitWeights()
        self._last_loss: Optional[Tensor] = None  # what the last training_step returned: compared before the next
        self._saved_model_keys: Optional[list[str]] = (
            None  # a sharded checkpoint's model keys (each stage reads its own)
        )
        self._sigterm = SigtermStop()  # a SIGTERM stops every rank at one step (see lightning_gpipe.sigterm)
        self._requeue = RequeueTogether()  # SLURM's requeue signal acts at one step (see lightning_gpipe.requeue)
        self._interrupt = InterruptTogether()  # so does Ctrl-C (see lightning_gpipe.interrupt)
        self._in_main_process = False  # the main process of a spawn or fork launch, after its workers failed
        self._copies: list[tuple[nn.Module, str, StageCopy]] = []  # weight averages' backbones: (owner, attribute, cut)
        self._mirrors: list[str] = []  # copies of the backbone outside it, by path (see weight_averages)

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
        self._launcher = launcher(
            self, self._start_method, self._report_failure, self._end_call_together, self._workers_failed
        )

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]  # how Lightning's strategies set it

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        if self.layout.num_replicas == 1:  # also validates pipe_size against the world size, before any work
            silence_sync_dist_advice()
        if self.world_size > 1:  # pipeline-1 needs no process group
            backend = self._process_group_backend or distributed.default_backend(self.root_device)
            init_process_group(self.cluster_environment, backend, self.root_device, self._process_group_timeout)
            destroy_process_groups_at_exit()
            print_stacks_on_a_crash()
        self._set_host_malloc()
        self._board = FailureBoard.for_default_group(self._describe, namespace=f"lightning_gpipe/{next(_runs)}")
        self._failed = self._stage_optimizers = self._in_main_process = False
        if self.world_size > 1:  # before the first collective: a rank that never joins it is found by its heartbeat
            self._board.watch_deadlocks(after=self.failure_timeout + DEADLOCK_MARGIN)
            self._board.start(self.watchdog_grace, self.failure_timeout)
        if self.world_size > 1 and self._mesh is None:  # the (dp, pp) groups live as long as the strategy
            self._mesh = make_mesh(self.layout, self.root_device)
        if self.world_size > 1:
            self._start_from_first_stages_random_state()

    def _start_from_first_stages_random_state(self) -> None:
        """Every stage takes its pipeline's first stage's random state, before Lightning's setup hooks run.

        A script without ``seed_everything`` draws other numbers in each process. What the setup hooks draw
        then (a DataModule's unseeded ``random_split``, a model made in ``configure_model``) would differ per
        stage: the stages would load other data, and the batch check stop them, where one device trains. The
        first stage's process is the one device: every stage takes its state (torch's, Python's, NumPy's), as
        each replica's stages do later in the fit (:meth:`_take_first_stages_state`). A seeded script
        already agrees: one gather of a digest, nothing more.
        """
        assert self._mesh is not None
        group = self._mesh.get_group("pp")
        state = get_rng_state(self.root_device, everything=True)
        watch = self._watch("a comparison of the stages' random states at setup", whole_pipeline=False)
        mine = torch.tensor([digest(state)], dtype=torch.int64, device=self.root_device)
        digests = distributed.all_gather(mine, group, watch)
        if bool((digests == digests[0]).all()):
            return
        first = self.layout.pipeline_of(self.global_rank)[0]
        state = distributed.broadcast_object(state, first, group, watch, self.root_device)
        set_rng_state(state, self.root_device)
        rank_zero_info(
            "The stages' random states differed at setup (no `seed_everything` before the Trainer?): every stage "
            "took its pipeline's first stage's, so that what the setup hooks and the data draw (a `random_split`, "
            "a shuffle) is drawn alike on every stage, as in one process."
        )

    def _set_host_malloc(self) -> None:
        """``reuse_freed_memory`` in this process, once; logged on rank 0."""
        if self.host_malloc is not None:
            return
        if not self.reuse_freed_memory:
            self.host_malloc = "left alone: reuse_freed_memory=False"
        elif self.root_device.type != "cpu":
            self.host_malloc = f"left alone: the stages run on {self.root_device.type}"
        else:
            why_not = keep_freed_memory()
            self.host_malloc = "reused" if why_not is None else f"left alone: {why_not}"
            rank_zero_info(
                "GPipe on the CPU: each stage keeps the host memory a step frees for the next step (glibc malloc "
                "thresholds; GPipeStrategy(reuse_freed_memory=False) leaves malloc alone)."
                if why_not is None
                else f"GPipe on the CPU: malloc left as it is ({why_not})."
            )

    def _describe(self, rank: int) -> str:
        layout = self.layout
        replica = f" of replica {layout.replica_of(rank)}" if layout.num_replicas > 1 else ""
        return f"stage {layout.stage_of(rank)}{replica}"

    # -- the model -------------------------------------------------------------------------------------

    def _backbone_owner(self, module: nn.Module) -> tuple[nn.Module, str]:
        *path, name = self.backbone.split(".")
        owner: Any = module
        for part in path:
            owner = getattr(owner, part, None)
            if owner is None:
                break
        if owner is None or not hasattr(owner, name):
            raise refusals.missing_backbone(module, self.backbone)
        return owner, name

    def _build_pipe(self) -> GPipe:
        module = self.lightning_module
        assert module is not None
        owner, name = self._backbone_owner(module)
        sequential = getattr(owner, name)
        if isinstance(sequential, (GPipe, StageCopy)):  # set up again after a failed run that could not reassemble it
            sequential = sequential.full_sequential()
        where = f"`{type(module).__name__}.{self.backbone}`"
        compile_layers = "compile its layers instead (`for layer in backbone: layer.compile()`), which each stage runs"
        if isinstance(getattr(sequential, "_orig_mod", None), nn.Sequential):  # torch.compile's wrapper module
            raise TypeError(
                f"{where} is `torch.compile(nn.Sequential(...))`, a compiled wrapper the pipeline cannot split into "
                f"stages: {compile_layers}."
            )
        if not isinstance(sequential, nn.Sequential):
            raise refusals.not_sequential(where, self.backbone, sequential)
        if getattr(sequential, "_compiled_call_impl", None) is not None:  # set by nn.Module.compile()
            raise ValueError(
                f"{where}.compile() compiles the Sequential's call, but under the pipeline no stage calls the "
                "Sequential (each runs only its own layers), so it would be silently dropped. Instead, "
                f"{compile_layers}."
            )
        refuse_own_forward(sequential, where)  # the profile would time the layers as a chain
        refuse_reserved_names(layer_names(sequential))  # before the profile, as GPipe would
        refuse_lazy_layers(sequential)  # before the profile, which would meet them first
        layout = self.layout
        refuse_sync_batch_norm(sequential, layout.pipe_size)  # before the profile too: it would wait in a collective
        refuse_sparse_gradients(module, layout.num_replicas)  # the whole module: its stem and head are averaged too
        if layout.pipe_size > len(sequential):
            raise ValueError(
                f"The pipeline has {layout.pipe_size} stages but `{self.backbone}` has only {len(sequential)} layers; "
                f"every stage needs at least one layer. Use at most {len(sequential)} devices per pipeline."
            )
        left = sharded_leftover.continue_from(
            sequential, self.backbone, layout.pipe_size, layout.stage_of(self.global_rank), self.requested[0]
        )
        if left is not None:  # each process holds its stage of a sharded run: no split can be chosen anew
            balance = self._go_on_from(left)
        else:
            planned = self._plan(sequential, layout.pipe_size) if AUTO in self.requested else None
            balance = planned if planned is not None else self._choose_balance(sequential, layout.pipe_size)
        if self.deferred_batch_norm:  # after profiling (which would count as micro-batches), before partitioning
            DeferredBatchNorm.convert_deferred_batch_norm(sequential, self.chunks)
        self._warn_per_micro_batch_statistics(sequential)
        refuse_ties_outside(module, sequential, self.backbone + ".")
        self._full_names = [n for n, _ in module.named_parameters()]
        pipe = GPipe(
            sequential,
            balance,
            chunks=self.chunks,
            checkpoint=self.checkpoint,
            layout=layout,
            device=self.root_device,
            seed=self.seed,
            timeout=self.timeout,
            board=self._board,
            mesh=self._mesh,
            split_backward=self.split_backward,
            check_per_sample=self.check_per_sample,
        )
        pipe.ties.prefix = self.backbone + "."
        if pipe.started_from_rank_zero:
            rank_zero_info(
                f"The processes built different initial weights for `{self.backbone}` (a model built before "
                "`L.seed_everything`, in a script the launcher runs once per process): every stage starts from "
                "rank 0's, as DDP's replicas do. Seed before building the model to make runs repeatable."
            )
        pipe.whole_state_hint = (
            "call `trainer.save_checkpoint(path)` on every rank (the file holds every stage), "
            "`trainer.strategy.lightning_module_state_dict()` on every rank (the whole model on rank 0, `{}` on "
            "the other stages), or "
            "`state_dict()` after `trainer.fit` returns (the whole backbone is back in the module on every rank)"
        )
        setattr(owner, name, pipe)
        return pipe

    def _warn_per_micro_batch_statistics(self, sequential: nn.Sequential) -> None:
        """Say out loud, once per setup on rank 0, that plain BatchNorm sees micro-batches (as in GPipe), and so do the
        token counts of frequency-scaled embeddings."""
        if self.chunks == 1:
            return
        embeddings = frequency_scaled_embeddings(sequential)
        if embeddings:
            rank_zero_warn(
                f"`{self.backbone}` has embeddings built with scale_grad_by_freq=True "
                f"({', '.join(f'{self.backbone}.{n}' for n in embeddings)}) and chunks={self.chunks}: their backward "
                "scales each token's gradient by its count in the batch, and in the pipeline each micro-batch counts "
                "its own tokens, so the gradients differ from a one-device run. GPipeStrategy(chunks=1), or "
                "scale_grad_by_freq=False, gives the one-device result."
            )
        names = per_micro_batch_norms(sequential)
        if not names:
            return
        shown = ", ".join(f"{self.backbone}.{n}" for n in names[:3]) + (
            f" and {len(names) - 3} more" if len(names) > 3 else ""
        )
        rank_zero_warn(
            f"`{self.backbone}` has BatchNorm layers that track running statistics ({shown}) and chunks={self.chunks}: "
            "in the pipeline each micro-batch is normalized by its own statistics (as in GPipe) and the running "
            "statistics move once per micro-batch, so results differ from a one-device run. "
            "GPipeStrategy(deferred_batch_norm=True) keeps the running statistics per batch (the normalization stays "
            "per micro-batch); GPipeStrategy(chunks=1) gives the one-device result."
        )

    def _go_on_from(self, left: sharded_leftover.Leftover) -> list[int]:
        """The split of the sharded run whose stages the processes hold (its chunks and mode where "auto")."""
        self.layer_costs = None
        _, chunks, checkpoint = self.requested
        self.chunks = chunks if isinstance(chunks, int) else left.chunks
        self.checkpoint = left.checkpoint if checkpoint == AUTO else checkpoint
        rank_zero_info(
            f"`{self.backbone}` holds in each process its own stage of the last run with state_dict_type='sharded' "
            f"(the other stages' layers on the meta device), so this run goes on with that split, "
            f"balance={list(left.balance)}, instead of choosing one."
        )
        return list(left.balance)

    def _choose_balance(self, sequential: nn.Sequential, stages: int) -> list[int]:
        """The split: given, by parameter count, or by costs that rank 0 measures and broadcasts; logged."""
        self.layer_costs = None
        kind = self.balance
        if not isinstance(kind, str):
            balance = validate_balance(kind, len(sequential), stages)
        elif kind == "params" or (self._default_balance and stages == 1):
            balance = balance_by_params(sequential, stages)
            if self._default_balance and stages == 1:
                kind = "one stage: nothing to measure"
        else:
            try:
                self.layer_costs = self._measure_costs(sequential)
            except NoSampleError as error:  # raised alike on every rank (see _from_rank_zero)
                if not self._default_balance:
                    raise
                rank_zero_warn(
                    f"{error} The default balance (by measured time) splits by parameter count instead: pass "
                    "balance='params' or a list of layers per stage to choose that and silence this warning."
                )
                kind = "params"
                balance = balance_by_params(sequential, stages)
            else:
                # a module object in several layers, and a layer whose output cannot leave a stage, stay on one stage
                together = kept_together(sequential, self.layer_costs.crossable)
                if self._default_balance and not together:  # by time, or a faster split a replayed step finds
                    balance, moved = searched_split(self.layer_costs, stages, int(self.chunks), self.checkpoint)
                    if moved is not None:
                        rank_zero_info(moved)
                else:
                    by = self.layer_costs.of("time" if self._default_balance else kind)
                    balance = balance_keeping_together(by, stages, together)
                self._check_costs = list(self.layer_costs.time) if stages > 1 else None
                self._train_batches = 0  # counted from this setup's first training batch
        costs = self.layer_costs
        how = f"balance={kind!r}" if not self._default_balance else f"the default balance ({kind})"
        rank_zero_info(
            f"GPipe split of `{self.backbone}` into {stages} stage{'s' * (stages > 1)} by {how}:\n"
            + split_table(
                balance, parameter_costs(sequential), costs.time if costs else None, costs.memory if costs else None
            )
            + ("" if costs else "\n(time and memory are measured with balance='time' or 'memory')")
        )
        return balance

    def _plan(self, sequential: nn.Sequential, stages: int) -> list[int]:
        """The ``"auto"`` settings: rank 0 profiles and plans, every rank takes its choice; returns the split."""
        balance, chunks, checkpoint = self.requested
        balance = "time" if balance is None else balance  # the default, as a split by time at the planned M
        link = LinkModel()
        if stages > 1 and self.global_rank in (0, 1):  # the link between two stages, as the pipeline will use it
            link = measure_link(1 - self.global_rank, device=self.root_device)

        def plan_here(batch: Optional[tuple[Any, str, str]]) -> Any:
            module = self.lightning_module
            assert module is not None
            cap = self.max_memory
            if cap is None and self.root_device.type == "cuda":
                cap = torch.cuda.get_device_properties(self.root_device).total_memory
            with isolated_rng(self.root_device, everything=True):
                sample, _ = backbone_sample(module, sequential, self.backbone, 1, batch)
                outcome, _ = choose(
                    sequential,
                    sample,
                    stages,
                    chunks,
                    checkpoint,
                    balance,
                    self.root_device,
                    cap,
                    link,
                    context=self.precision_plugin.forward_context,
                )
            rank_zero_info(
                f"GPipe plan for {stages} stage{'s' * (stages > 1)} (chunks={chunks!r}, checkpoint={checkpoint!r}, "
                f"balance={balance!r}), predicted on {self.root_device} in {outcome.seconds:.1f}s:\n{outcome.table}"
            )
            return outcome

        shared = self._from_rank_zero_on_the_first_batch(plan_here)
        self.auto_choice = shared
        self.chunks = chunks if isinstance(chunks, int) else shared.chunks
        self.checkpoint = shared.checkpoint if checkpoint == AUTO else checkpoint
        return validate_balance(shared.balance, len(sequential), stages)

    def _measure_costs(self, sequential: nn.Sequential) -> LayerCosts:
        """Profile on global rank 0 only and broadcast, so that every rank builds the same split."""

        def profile_here(batch: Optional[tuple[Any, str, str]]) -> LayerCosts:
            module = self.lightning_module
            assert module is not None
            with isolated_rng(self.root_device, everything=True):
                whole, origin = backbone_input(module, sequential, self.backbone, batch)
                sample, where = described(sample_micro_batch(whole, self.chunks), origin)
                costs = profile_layers(
                    sequential, sample, self.root_device, context=self.precision_plugin.forward_context
                )
                samples = microbatch.batch_size(whole)
                if microbatch.batch_size(sample) == 1 < samples:
                    # micro-batches of one sample: what may leave a stage shows on two (see crossable_at)
                    pair = sample_micro_batch(whole, (samples + 1) // 2)  # the first 2 samples
                    pair_flags = crossable_at(sequential, pair, self.root_device)
                    costs = replace(costs, crossable=tuple(a and b for a, b in zip(costs.crossable, pair_flags)))
            rank_zero_info(f"Profiled `{self.backbone}` layer by layer on {self.root_device} with {where}.")
            return costs

        return self._from_rank_zero_on_the_first_batch(profile_here)

    def _from_rank_zero_on_the_first_batch(self, compute: Callable[[Optional[tuple[Any, str, str]]], Any]) -> Any:
        """:meth:`_from_rank_zero` for a ``compute`` of the running stage's first batch (``first_batch``): every
        rank builds the loaders at this point (``sample_loaders``), so that each calls a loader hook alike."""
        trainer = self._trainer()
        loaders = sample_loaders(trainer) if trainer is not None else None

        def with_the_batch() -> Any:
            with isolated_rng(self.root_device, everything=True):  # a loader's transforms draw as the run will
                batch = first_batch(trainer, loaders) if trainer is not None else None
            return compute(batch)

        return self._from_rank_zero(with_the_batch)

    def _from_rank_zero(self, compute: Callable[[], Any]) -> Any:
        """``compute()`` on global rank 0, broadcast; if it raises there, every rank raises alike (collective)."""
        outcome: Any = None
        if self.global_rank == 0:
            try:
                outcome = compute()
            except Exception as error:
                outcome = error
        shared = self.broadcast(
            outcome if not isinstance(outcome, Exception) else (type(outcome).__name__, str(outcome)), src=0
        )
        if isinstance(outcome, Exception):
            raise outcome
        if isinstance(shared, tuple):  # rank 0 failed: fail alike, with its message
            known = {"ValueError": ValueError, "TypeError": TypeError, "NoSampleError": NoSampleError}
            raise known.get(shared[0], RuntimeError)(shared[1])
        return shared

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None
        self._last_loss = None
        self._loaders = []  # this run's: a checkpoint's position goes to no earlier fit's loader
        self._buffers_due = True  # DDP broadcasts before a fit's first forward (see _first_replicas_buffers)
        self._dump_routed = dump_model_state_with(trainer, self._checkpoint_state_dict)
        self._sigterm.install(trainer)  # before the Trainer registers its signal handlers
        self._requeue.install(trainer, self.cluster_environment, self.world_size)
        self._interrupt.install(trainer, self.world_size, self.global_rank)
        refusals.timed_validation(validation_interval_seconds(trainer) if self.world_size > 1 else None)
        assert self.lightning_module is not None
        refusals.sync_batchnorm(self._layer_sync, self.lightning_module, self.world_size)
        refusals.graph_logging(graph_loggers(trainer), self.world_size)
        averaging = [name for name, _ in averaged_copies(trainer)]
        refusals.callbacks(trainer.callbacks, averaging, self.state_dict_type, self.world_size)  # type: ignore[attr-defined]
        self.accelerator.setup(trainer)
        plugin: Any = copy_as(self.precision_plugin, GlobalNormClipping)  # the user's plugin class, subclassed
        plugin.pipeline = lambda: self.pipe
        self.precision_plugin = plugin
        self.pipe = self._build_pipe()
        module = self.lightning_module
        assert module is not None and self.model is not None
        self.pipe.call_label = lambda: current_hook(module)
        if module.example_input_array is not None and self.pipe.group is not None:
            # The model summary runs it through the backbone on every rank (so every stage joins the call); one
            # device has one array, and an unseeded `torch.randn` one differed per rank, so the stages held
            # different batches. Every stage takes the first stage's.
            module.example_input_array = self.pipe.broadcast(module.example_input_array)
        pipe, board = self.pipe, self._board
        if board is not None:
            board.add_check(lambda: pipe.idle_stray(self.failure_timeout))
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._sync_replicated()
        self._sync_metrics_over_replicas()
        self._cut_averaged_copies(trainer)
        # before configure_optimizers, which could draw weights too (and after which nothing else changes them)
        self._note_split_weights(trainer.state.fn == TrainerFn.FITTING)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)
            self._layouts = [self._optimizer_layout(o) for o in self.optimizers]
            refusals.empty_everywhere([_unwrap(o) for o in self.optimizers], self._layouts, self._emptied)
        use_pipeline_summaries(trainer)
        count_throughput_per_pipeline(trainer, self.layout.num_replicas, self.layout.pipe_size)
        write_once_per_pipeline(trainer, first_stage=self.layout.stage_of(self.global_rank) == 0)
        walk_stages_in_finetuning()
        callbacks = trainer.callbacks  # type: ignore[attr-defined]
        if self.world_size > 1:
            together = StopTogether(self._any_stops, self._agree_on_signals)
            callbacks[:] = [c for c in callbacks if not isinstance(c, StopTogether)] + [together]

    def _trainer(self) -> Optional["pl.Trainer"]:
        if self.lightning_module is None:
            return None
        try:
            return self.lightning_module.trainer
        except RuntimeError:  # not attached: the main process of a spawn launch, tearing down after its workers failed
            return None

    def _stage_state(self) -> Any:
        """A context in which the module's ``state_dict()`` holds this stage's part of the backbone, for the
        strategy's own code that gathers or selects per stage (outside it, a partitioned backbone refuses)."""
        return self.pipe.stage_state() if self.pipe is not None else nullcontext()

    def _any_stops(self, should_stop: bool) -> bool:
        """Whether any rank was asked to stop (see :mod:`lightning_gpipe.stop_together`).

        The same gather carries each rank's random-state digest, so that these points (the ends of a training
        batch, an epoch and a validation, the start of training) also make the pipeline's random state one
        (:meth:`_agree_before_step`) before the loader draws the next batches' augmentations.
        """
        if not self._active():
            return should_stop
        state = get_rng_state(self.root_device, everything=True)
        votes = self._gather_decisions(_STOP_DECISION, should_stop, digest(state))
        if self.pipe is not None and self.pipe.group is not None:
            self._take_first_stages_state(votes[self.pipe.ranks, _DIGEST], state)
        self._act_on_signals(votes)
        return bool(votes[:, _STOP].any())

    def _gather_decisions(self, point: int, should_stop: bool = False, state_digest: int = 0) -> Tensor:
        """Every rank's signals (SIGTERM, SLURM's requeue signal, SIGINT, not yet acted on), stop vote and random-state
        digest, one row per rank, in the columns ``_SIGTERM`` to ``_DIGEST``; collective. Where the ranks made it at
        different points (a stop decision, the end of an evaluation batch), their loops ran different numbers of
        batches: every rank raises, naming the points."""
        signals = [int(self._sigterm.noted), int(self._requeue.noted), int(self._interrupt.noted)]
        mine = torch.tensor(
            [point, *signals, int(should_stop), state_digest], dtype=torch.int64, device=self.root_device
        )
        votes = distributed.all_gather(mine, watch=self._watch(_DOING[point]))
        points = votes[:, 0].tolist()
        if len(set(points)) > 1:
            where = ", ".join(f"{self._describe(r)} (rank {r}) at {_POINTS[p]}" for r, p in enumerate(points))
            raise PipelineError(
                f"The pipeline's ranks reached different points of their loops: {where}. Their loops ran different "
                "numbers of batches (an evaluation loader of another length on some rank, `limit_val_batches` set per "
                "rank): every stage of a pipeline must get the same batches."
            )
        return votes[:, 1:]

    def _act_on_signals(self, votes: Tensor) -> None:
        """Every rank at the same point, once any rank got a signal: SLURM's requeue signal saves the HPC checkpoint
        and requeues here, or at the next such point where no gradients wait for an optimizer step
        (:mod:`lightning_gpipe.requeue`); SIGTERM makes each rank's loop stop at the same point
        (:mod:`lightning_gpipe.sigterm`); SIGINT raises ``KeyboardInterrupt`` right here
        (:mod:`lightning_gpipe.interrupt`)."""
        if bool(votes[:, _REQUEUE].any()):
            self._requeue.run(self._from_rank_zero)
        if bool(votes[:, _SIGTERM].any()):
            self._sigterm.agree()
        if bool(votes[:, _INTERRUPT].any()):
            self._interrupt.stop_here()

    def _agree_on_signals(self) -> None:
        """At the end of each validation, test and predict batch (see :mod:`lightning_gpipe.stop_together`), where the
        loops read SIGTERM's flag but share no stop decision; collective."""
        if self._active():
            self._act_on_signals(self._gather_decisions(_EVALUATION_BATCH))

    def _agree_before_step(self) -> None:
        """Before each ``training_step``: make the stages' random states and outer layers one, check their optimizer
        settings.

        Called last before the step (the strategy's ``on_train_batch_start`` comes after the callbacks' and the
        module's). One gather over the pipeline carries four digests per stage:

        - the random state (torch's, Python's, NumPy's). A call that draws on some ranks only, such as a
          ``@rank_zero_only`` callback that picks samples to log, leaves the stages' generators apart; what
          draws outside the backbone (dropout in a head or a stem, augmentation in ``training_step`` or in the
          Dataset) would then differ per stage, and the stages would train apart without a word (measured:
          3.7e-2 off one device after 8 steps, dropout in a head). Where the digests differ, every stage takes
          the first stage's state: rank 0's under a rank-zero-only callback, the state one device holds. (The
          stop decisions carry the same digest, see :meth:`_any_stops`.)
        - the optimizers' settings and the global step (:mod:`lightning_gpipe.engine.agreement`). Where they
          differ, no stage's can be called right, so every stage raises, naming the first difference.
        - the layers outside the backbone (a stem, a head: every stage holds a copy and steps it alike), by a
          fingerprint of their parameters and buffers. Code that changes them on some ranks only, such as a
          ``@rank_zero_only`` callback that rescales a head's weights, leaves the copies apart, and each stage
          would go on computing its loss, and so its gradients, with its own copy. Where the fingerprints
          differ, every stage takes the first stage's copy (the one rank-zero-only code changed, as on one
          device), and the first time a warning names the tensors. The check reads each of those tensors once
          per step (CRC-32 on the CPU: 0.26-0.38 ms per MB on CPU-2, so 0.7 ms for a 2 MB head).
        - the loss the last ``training_step`` returned. Every stage computes it from the same backbone output with
          the same layers outside it, so a difference means that the loss depends on the stage: a penalty over
          ``self.parameters()``, which holds one stage during a fit, adds each stage's own part, the logged loss is
          stage 0's part and a loss scaled by it trains the stages apart. Every stage raises, naming both values.
        """
        pipe, trainer = self.pipe, self._trainer()
        if pipe is None or pipe.group is None or trainer is None or not self._active():
            return
        state = get_rng_state(self.root_device, everything=True)
        scaler = getattr(self.precision_plugin, "scaler", None)  # float16's: every stage scales the loss alike
        settings = optimizer_settings(
            [_unwrap(o) for o in self.optimizers], trainer.global_step, loss_scale_state(scaler)
        )
        outer = self._outer.fingerprint() if self._outer is not None else 0
        loss = loss_bits(self._last_loss)
        drawn = self._split_weights.changed(pipe.parameters())
        mine = torch.tensor(
            [digest(state), digest(settings), outer, loss, drawn], dtype=torch.int64, device=self.root_device
        )
        watch = self._watch("a comparison of the stages' random states, optimizer settings, outer layers and losses")
        digests = distributed.all_gather(mine, pipe.group, watch)
        self._refuse_different_losses(digests[:, 3], f"the training step before batch {self._batch_idx}")
        if self._split_weights.watching:  # the first training step of a fit: a hook's random weights are refused
            apart = self._split_weights.rng_apart or bool((digests[:, 0] != digests[0, 0]).any())
            self._split_weights.note(None)
            said = judge(digests[:, 4].tolist(), apart, pipe.ranks, self._batch_idx)
            if said is not None:
                rank_zero_warn(said)
        if bool((digests[:, 1] != digests[0, 1]).any()):
            self._refuse_different_settings(settings, trainer.current_epoch)
        self._take_first_stages_state(digests[:, 0], state)
        self._take_first_stages_outer_layers(digests[:, 2], f"Before training batch {self._batch_idx}")

    def _note_split_weights(self, fitting: bool) -> None:
        """Fingerprint this stage's weights where the split was made (in setup, before ``configure_optimizers``) or a
        restore filled it, for a fit over several stages (:mod:`lightning_gpipe.engine.split_weights`); else watch
        nothing."""
        pipe = self.pipe if fitting else None
        self._split_weights.note(pipe.parameters() if pipe is not None and pipe.group is not None else None)

    def _refuse_different_settings(self, settings: dict[str, Any], epoch: int) -> NoReturn:
        """Every stage of the pipeline raises alike: the stages' optimizer settings differ (collective)."""
        pipe = self.pipe
        assert pipe is not None
        every = pipe.gather(settings)
        assert every is not None
        for stage, theirs in enumerate(every[1:], start=1):
            found = first_difference(every[0], theirs)
            if found is not None:
                what, first, other = found
                raise PipelineError(
                    f"The pipeline's stages disagree on their optimizers before training batch {self._batch_idx} of "
                    f"epoch {epoch}: "
                    f"{what} is {first!r} on stage 0 (rank {pipe.ranks[0]}) but {other!r} on stage {stage} "
                    f"(rank {pipe.ranks[stage]}). {DIFFERENT_SETTINGS_CAUSES}"
                )
        raise PipelineError("The pipeline's stages disagree on their optimizers' settings (their digests differ).")

    def _take_first_stages_state(self, digests: Tensor, state: Any) -> None:
        """Collective over the pipeline where ``digests`` (one per stage, the same on every stage) differ."""
        pipe = self.pipe
        assert pipe is not None
        if bool((digests == digests[0]).all()):
            return
        set_rng_state(pipe.broadcast(state), self.root_device)
        self._split_weights.rng_apart = self._split_weights.watching
        if not self._rng_resynced:
            self._rng_resynced = True
            apart = [rank for rank, digest in zip(pipe.ranks, digests.tolist()) if digest != digests[0].item()]
            when = f"By training batch {self._batch_idx}" if self._batch_idx >= 0 else "At the start of training"
            rank_zero_info(
                f"{when}, the random state of rank(s) {apart} differed from the first "
                f"stage's (rank {pipe.ranks[0]}): code drew random numbers on some ranks only, such as a "
                "`@rank_zero_only` callback. Every stage took the first stage's state, so that what draws outside "
                "the backbone draws alike on every stage, as on one device (said once). Random draws over "
                "`self.parameters()` during a fit (gradient noise, a random perturbation of the weights) also part "
                "the stages' states: those hold this stage's parameters only, and differ from one device."
            )

    def _agree_on_outer_layers(self, when: str) -> None:
        """The layers-outside-the-backbone part of :meth:`_agree_before_step`, alone: at the start of a validation
        during a fit and at the end of training, after the callbacks' and the module's hooks, so that what a
        rank-zero-only hook changed after the last step is in every stage's copy when it evaluates or ends."""
        pipe, trainer = self.pipe, self._trainer()
        if pipe is None or pipe.group is None or trainer is None or not self._active():
            return
        if trainer.state.fn != TrainerFn.FITTING:
            return
        assert self._outer is not None
        mine = torch.tensor(
            [self._outer.fingerprint(), loss_bits(self._last_loss)], dtype=torch.int64, device=self.root_device
        )
        watch = self._watch("a comparison of the stages' layers outside the backbone and losses")
        digests = distributed.all_gather(mine, pipe.group, watch)
        self._refuse_different_losses(digests[:, 1], f"training batch {self._batch_idx}")
        self._take_first_stages_outer_layers(digests[:, 0], when)

    def _refuse_stage_grad_norms(self, when: str) -> None:
        """Raise where this rank logged gradient norms of its stage alone (Lightning's ``grad_norm`` during a fit
        over several stages): the logger would write the first stage's norms, and their total, as the model's."""
        pipe, trainer = self.pipe, self._trainer()
        if pipe is None or pipe.group is None or trainer is None:
            return
        found = stage_norm_keys(trainer.callback_metrics)
        if found:
            shown = ", ".join(f"`{k}`" for k in found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
            raise PipelineError(
                f"{when}, rank {self.global_rank} (stage {pipe.stage}) had logged {shown}: gradient norms in the form "
                "of Lightning's `grad_norm`, which during a fit over several stages sees only this rank's stage. The "
                "logger writes rank 0's values, so the logged norms would miss the other stages' layers and the "
                "total would be the first stage's. Log `lightning_gpipe.grad_norm(self, norm_type)` instead (the "
                "same arguments and keys, the whole model's values), on every rank."
            )

    def _refuse_different_losses(self, bits: Tensor, which: str) -> None:
        """Every stage raises alike where the losses their last ``training_step`` returned (``bits``, one per stage,
        gathered) differ: the loss depended on the stage that computed it."""
        pipe = self.pipe
        assert pipe is not None
        found = losses_apart(bits.tolist())
        if found is None:
            return
        stage, first, other = found
        apart = [f"{v:.7g} on stage {s}" for s, v in ((0, first), (stage, other)) if not math.isfinite(v)]
        unfinite = (
            f" Only {' and '.join(apart)} is not finite: the loss overflowed or met a NaN on some stages alone, which "
            "one device cannot do (the same backbone output reaches every stage), so the loss read something only "
            "those ranks hold."
            if len(apart) == 1
            else ""
        )
        raise PipelineError(
            f"The pipeline's stages computed different losses in {which}: {first:.7g} on stage 0 (rank "
            f"{pipe.ranks[0]}) but {other:.7g} on stage {stage} (rank {pipe.ranks[stage]}).{unfinite} "
            f"{DIFFERENT_LOSS_CAUSES}"
        )

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """Lightning's, keeping the loss it returns: the stages compare it before the next step."""
        output = super().training_step(*args, **kwargs)
        loss = output.get("loss") if isinstance(output, Mapping) else output
        self._last_loss = loss.detach() if isinstance(loss, Tensor) else None
        return output

    def _take_first_stages_outer_layers(self, digests: Tensor, when: str) -> None:
        """Collective over the pipeline where ``digests`` (of the layers outside the backbone, one per stage) differ:
        every stage takes the first stage's copy (:class:`OuterLayers`), and the first time rank 0 warns, saying
        ``when`` it was found. Where a copy of the backbone outside it differs, taking the first stage's would not
        make it right (each stage updated its first layers from its own stage), so every stage raises instead."""
        pipe, outer = self.pipe, self._outer
        assert pipe is not None and outer is not None
        apart = outer.apart(digests)
        if not apart:
            return
        ranks = [rank for rank, d in zip(pipe.ranks, digests.tolist()) if d != digests[0].item()]
        mirrors = [m for m in self._mirrors if any(name.startswith(m + ".") for name in apart)]
        if mirrors:  # every stage found the same names, so every stage raises
            raise RuntimeError(weight_averages.mirror_apart(mirrors[0], ranks, pipe.ranks[0], when))
        outer.copy_first_stages(self._watch("the first stage's copy of the layers outside the backbone"))
        if not self._outer_resynced:
            self._outer_resynced = True
            rank_zero_warn(OuterLayers.describe(apart, ranks, pipe.ranks[0], when))

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self._refuse_stage_grad_norms("At the end of training")
        self._agree_on_outer_layers("At the end of training")

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self._trainer()
        if trainer is not None:  # after every callback's and the module's on_train_start
            self._refuse_uneven_training(trainer)
            trainer.should_stop = self._any_stops(trainer.should_stop)

    def _refuse_uneven_training(self, trainer: "pl.Trainer", epoch: Optional[int] = None) -> None:
        """Refuse, on every rank, a fit whose ranks would run different numbers of training batches an epoch.

        The stages of a pipeline must get the same batches, and every rank agrees with all the others at the end of
        each batch. Loaders whose batches are equal while both last pass the batch check, and the rank that ran out
        first left the others waiting: a deadlock, named only after ``failure_timeout`` + 5 s. Unknown lengths (an
        IterableDataset) cannot be compared here; the deadlock check names those. ``epoch``: the epoch whose loaders
        were made anew (``reload_dataloaders_every_n_epochs``), compared at its first batch: without a reload the
        lengths cannot change after the start of training.
        """
        if self.pipe is None or self.world_size == 1:
            return
        mine = torch.tensor([float(trainer.num_training_batches)], device=self.root_device)
        gathered = distributed.all_gather(mine, watch=self._watch("the training batch counts of every rank"))
        counts = gathered[:, 0].tolist()
        if all(c == counts[0] for c in counts) or any(math.isinf(c) for c in counts):
            return
        raise ValueError(_uneven_training(counts, self.layout.stage_of, epoch))

    @override
    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        """Run ``configure_optimizers``; a stage may hold none of an optimizer's parameters.

        Every stage runs the user's code once, as one device does. An optimizer given no parameters here
        (``SGD(filter(lambda p: p.requires_grad, self.parameters()))`` on a frozen stage) gets one empty
        param group (see :func:`~lightning_gpipe.engine.optimizers.accept_empty_parameter_lists`): its step
        is a no-op on this stage, and it joins the loop, the schedulers and the checkpoints like the others.
        A layer another stage holds reads as its ``meta`` copy here (``GPipe.all_layers``), so that param groups
        selected by position (``self.backbone[-1].parameters()``, one per layer) come out alike on every stage;
        the ``meta`` parameters are then dropped from them, leaving this stage's.
        """
        self._states_at_the_end = {}  # a new fit's optimizers
        # a layer another stage holds reads as its meta copy: `self.backbone[-1].parameters()`, then dropped
        every_layer = self.pipe.all_layers() if self.pipe is not None else nullcontext()
        try:
            with accept_empty_parameter_lists() as emptied, every_layer:
                super().setup_optimizers(trainer)
        except Exception as error:
            refusals.optimizer_built_on_meta(error, self.layout.pipe_size)
            raise
        self._emptied = emptied
        refusals.whole_gradient_optimizers([_unwrap(o) for o in self.optimizers], self.layout.pipe_size)
        refusals.sharded_optimizer_state([_unwrap(o) for o in self.optimizers], self.layout.pipe_size)
        finetuning = finetuning_callbacks(trainer)
        if finetuning:
            refusals.unsupported_finetuning(type(finetuning[0]).__name__, self.layout, self.pipe, self.backbone)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)  # the other stages' layers are not submodules any more: they stay put

    def _sync_metrics_over_replicas(self) -> None:
        """Make the module's torchmetrics metrics sync over this stage's replicas, not over every rank.

        A metric syncs over the default group (every rank) unless given a ``process_group``. Every stage of a
        pipeline updates its metrics with the same values, so over every rank a sum would count each sample
        once per stage. The replica group (DeviceMesh dim ``dp``) holds this rank alone with one pipeline,
        which makes the sync a no-op. A metric given a group by the user keeps it. Metrics the module does not hold
        (a callback's) are routed by :mod:`lightning_gpipe.metric_sync`.
        """
        module = self.lightning_module
        if self._mesh is None or module is None:
            return
        metric_sync.keep_over([module])
        # and the metrics outside the module (a callback's, one built in a hook), until teardown
        metric_sync.sync_over_replicas(lambda: self.replica_group)

    def _sync_replicated(self) -> None:
        """Give every stage the first stage's copy of the layers outside the backbone, and its random state.

        Those layers are replicated, so they must start equal; the random state must be equal so that a
        ``RandomSampler`` (which draws from it) orders the data alike on every stage.
        """
        pipe = self.pipe
        module = self.lightning_module
        assert pipe is not None and module is not None
        self._outer = OuterLayers(module, pipe)
        # replicas of a stage start equal, as under DDP: the first replica's weights everywhere
        broadcast_from_first_replica([*module.parameters(), *module.buffers()], pipe.replica_group)
        if pipe.group is None:
            return
        self._outer.copy_first_stages()
        set_rng_state(pipe.broadcast(get_rng_state(self.root_device)), self.root_device)

    def _cut_averaged_copies(self, trainer: "pl.Trainer") -> None:
        """Cut the weight averages' copies of the backbone like the pipe (:mod:`lightning_gpipe.weight_averages`)."""
        pipe, module = self.pipe, self.lightning_module
        assert pipe is not None and module is not None
        cut = weight_averages.cut_copies(
            trainer,
            module,
            pipe,
            self._backbone_owner,
            self.chunks if self.deferred_batch_norm else None,
            self._gather_unless_failed,
        )
        self._copies, self._mirrors = cut.copies, cut.mirrors
        if cut.inside_the_module:
            self._outer = OuterLayers(module, pipe)  # without the cut copies' tensors, which differ by stage
        whole = [*module.modules(), *pipe.full_sequential().modules()]
        tell_swa_about_batch_norm(trainer, any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in whole))

    def _gather_unless_failed(self, obj: Any, to_all: bool) -> Optional[list[Any]]:
        """The pipe's gather, or this stage's ``obj`` alone once a rank failed (the others will not join)."""
        if self.pipe is None or self.failed:
            return [obj]
        return self.pipe.gather(obj, to_all)

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
    def backward(
        self, closure_loss: Tensor, optimizer: Optional[torch.optim.Optimizer], *args: Any, **kwargs: Any
    ) -> Tensor:
        """Lightning's; where a backward meets a graph the drain freed, the error says how a pipeline gets there."""
        try:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        except RuntimeError as error:
            if isinstance(error, PipelineError) or self.pipe is None or "graph a second time" not in str(error):
                raise
            raise RuntimeError(f"{error}\n{FREED_BY_THE_DRAIN}") from error

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        """Average gradients over the data-parallel replicas (a no-op with one pipeline)."""
        if self.pipe is not None:
            self.pipe.sync_gradients(self._outer.parameters if self._outer is not None else [])

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No gradient averaging while Lightning accumulates gradients over several batches."""
        self._buffers_due = False  # DDP's forward under no_sync leaves the next one without a buffer broadcast
        if self.pipe is None:
            yield None
            return
        with self.pipe.no_sync():
            yield None

    # -- collectives: over a stage's data-parallel replicas by default, decisions over every rank -----

    def _active(self) -> bool:
        """Whether collectives run: distributed, and this rank has not failed."""
        return distributed.is_distributed() and not self.failed

    def _watch(self, doing: str, whole_pipeline: bool = True) -> distributed.Watch:
        """What a collective polls: the pipeline's watch for collectives that every stage joins, else the board."""
        if whole_pipeline and self.pipe is not None:
            return self.pipe.watch(doing)
        board = self._board
        if board is None:
            return distributed.Watching(lambda: None, doing)
        return distributed.Watching(board.raise_if_failed, doing, board.lost)

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if self._active():
            distributed.barrier(watch=self._watch(f"Lightning's barrier {name!r}" if name else "a barrier"))

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not self._active():
            return obj
        return distributed.broadcast_object(obj, src, watch=self._watch("a broadcast"), device=self.root_device)

    @property
    def replica_group(self) -> Optional[dist.ProcessGroup]:
        """This rank's stage in every pipeline (DeviceMesh dim ``dp``): the group to reduce over.

        ``None`` with one pipeline. torchmetrics metrics sync over it without user code, the module's (see
        ``_sync_metrics_over_replicas``) and those kept outside it (:mod:`lightning_gpipe.metric_sync`).
        """
        if self._mesh is None or self.layout.num_replicas == 1:
            return None
        return self._mesh.get_group("dp")

    def _over(self, group: Optional[Any]) -> Optional[Any]:
        """The group a reduce or gather of user code runs over: this stage's replicas, for the default group.

        The stages of one pipeline hold the same values, so over every rank a sum would count them once per
        stage. ``LightningModule.all_gather`` passes ``group.WORLD`` for "every data-parallel rank", so the
        whole world counts as the default too. ``None``: no other replica (nothing to reduce).
        """
        return self.replica_group if group is None or group is dist.group.WORLD else group

    @override
    def reduce(
        self,
        tensor: Union[Tensor, Any],
        group: Optional[Any] = None,
        reduce_op: Optional[Union[dist.ReduceOp, str]] = "mean",
    ) -> Union[Tensor, Any]:
        """Reduce over the data-parallel replicas (by default): every stage gets the same result."""
        if not isinstance(tensor, Tensor) or not self._active():
            return tensor
        group = self._over(group)
        if group is None:
            return tensor.clone()
        torch_op, mean = distributed.reduce_op(reduce_op)
        tensor = tensor.float() if mean and not tensor.is_floating_point() else tensor.clone()
        distributed.all_reduce(tensor, torch_op, group, self._watch("a reduce", whole_pipeline=False))
        if mean:
            tensor = tensor / dist.get_world_size(group)
        return tensor

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        """Gather from the data-parallel replicas (by default), stacked in replica order.

        Polled like every collective of the strategy, ``sync_grads`` too (whose backward sums each row's gradient
        over the replicas: torch's differentiable gather, which Lightning's uses, fails over a subgroup on gloo).
        """
        group = self._over(group)
        if group is None or not self._active():
            return tensor.unsqueeze(0)
        watch = self._watch("a gather", whole_pipeline=False)
        if sync_grads:
            return distributed.all_gather_with_gradients(tensor, group, watch)
        return distributed.all_gather(tensor, group, watch)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Decided over every rank (stopping, say): the stages of a pipeline must go on or stop together."""
        if not self._active():
            return decision
        votes = torch.tensor(int(decision), device=self.root_device)
        distributed.all_reduce(votes, watch=self._watch("a decision of every rank (stop or go on)"))
        return bool(votes == self.world_size) if all else bool(votes)

    # -- data ------------------------------------------------------------------------------------------

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Seed every loader's workers by replica; make the training loader resumable mid-epoch (see
        :mod:`lightning_gpipe.checkpointing.resumable`)."""
        refusals.stage_sharded_sampler(dataloader, self.distributed_sampler_kwargs, self.world_size)
        self._seed_workers_by_replica(dataloader)
        trainer = self._trainer()
        if trainer is None or not trainer.training or not isinstance(dataloader, torch.utils.data.DataLoader):
            return dataloader
        loader = resumable(dataloader, consumed=lambda: self._batch_idx + 1, device=self.root_device)
        if self._loader_position is not None and hasattr(loader, "restore"):
            loader.restore(self._loader_position)
            self._loader_position = None
        self._loaders = [loader]
        return loader

    def _seed_workers_by_replica(self, dataloader: object) -> None:
        """``seed_everything(seed, workers=True)`` (LightningCLI's default): each worker's seeds from the replica.

        Lightning gives each DataLoader worker seeds mixed from the process's global rank, right after this
        hook, so that data-parallel ranks draw different augmentations. The stages of one pipeline are
        different global ranks of one replica: with those seeds their random transforms differ, and the
        first step stops on the batch check. Set first, Lightning keeps this one (it adds its own only
        where ``worker_init_fn`` is None): Lightning's own seeding, given the replica's index, so a
        pipeline draws one device's augmentations and replicas draw DDP's.
        """
        seed_workers(dataloader, self.layout.replica_of(self.global_rank))

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._batch_idx = batch_idx
        trainer = self._trainer()
        if trainer is not None and batch_idx == 0 and getattr(trainer, "reload_dataloaders_every_n_epochs", False):
            self._refuse_uneven_training(trainer, trainer.current_epoch)  # over every rank, replicas too
        self._refuse_stage_grad_norms(f"Before training batch {batch_idx}")
        self._first_replicas_buffers()
        self._buffers_due = True  # unless the step accumulates (`block_backward_sync`)
        self._check_balance()
        for loader in self._loaders:  # resumed mid-epoch: go on as if never stopped
            if hasattr(loader, "restore_random_state"):
                loader.restore_random_state()
        self._agree_before_step()

    def _first_replicas_buffers(self) -> None:
        """With replicas: every replica takes the first one's buffers (BatchNorm's running statistics, in the backbone
        or outside it) where DDP's ``broadcast_buffers`` gives every rank rank 0's. Each replica's own data would move
        them apart: a validation on another replica's statistics, a monitored value 0.068 off DDP's in a reported run.

        DDP broadcasts before a forward of its wrapped module when the forward before it had gradients and
        synchronized them: before a fit's first forward, each training step after one that did not accumulate,
        and a fit's validation's first forward after training; not before a step after a validation or after an
        accumulating step (``no_sync``), nor in a ``validate`` outside ``fit`` (Lightning wraps the module for
        fitting only). ``_buffers_due`` follows that rule."""
        pipe, module, trainer = self.pipe, self.lightning_module, self._trainer()
        due, self._buffers_due = self._buffers_due, False
        if pipe is None or module is None or pipe.replica_group is None or not due:
            return
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return
        broadcast_buffers_from_first_replica(module.buffers(), pipe.replica_group)

    def _refuse_uneven_evaluation(self, what: str) -> None:
        """Refuse, on every rank, an evaluation whose ranks would run different numbers of batches.

        Every rank agrees with all the others at the end of each evaluation batch (signals, a stop), so a replica that
        ran out first would leave the others waiting, and the job would end on a deadlock or a lost connection a minute
        later. DDP finishes such a loop, each rank on its own shard; Lightning's predict sampler does not pad (33
        samples in batches of 16 over 2 replicas: 2 batches and 1), nor does a sampler of the user's. The stages of one
        pipeline must run the same batches: loaders of other lengths on them (a sampler of the user's built per rank)
        passed the batch check while both lasted and then ended on "fell out of step", naming no cause.
        """
        trainer = self._trainer()
        if trainer is None or self.pipe is None or self.world_size == 1:
            return
        counts = evaluation_batches(trainer)[:8]  # a fixed size for the gather: the loaders' count and 8 lengths
        mine = torch.tensor([len(counts), *counts, *[-1.0] * (8 - len(counts))], device=self.root_device)
        rows = distributed.all_gather(mine, watch=self._watch(f"the {what} batch counts of every rank")).tolist()
        if all(row == rows[0] for row in rows) or any(math.isinf(c) for row in rows for c in row):
            return
        pipe_size = self.layout.pipe_size
        pipelines = [rows[start : start + pipe_size] for start in range(0, len(rows), pipe_size)]
        if any(row != pipeline[0] for pipeline in pipelines for row in pipeline):
            shown = ", ".join(
                f"rank {rank} (stage {self.layout.stage_of(rank)}): {[int(c) for c in row[1 : 1 + int(row[0])]]}"
                for rank, row in enumerate(rows)
            )
            raise ValueError(_uneven_batches(f"{what} batches per loader", shown))
        per_replica = {self.layout.replica_of(rank): row[1 : 1 + int(row[0])] for rank, row in enumerate(rows)}
        shown = ", ".join(f"replica {r}: {[int(c) for c in n]}" for r, n in sorted(per_replica.items()))
        raise ValueError(
            f"The data-parallel replicas would run different numbers of {what} batches per loader ({shown}). Every "
            "replica's pipeline agrees with the others at the end of each batch, so one that ran out first would leave "
            "the others waiting (DDP lets each rank finish its own shard). Lightning's predict sampler does not pad, "
            "nor may a sampler of your own: give the data a size that splits into as many batches on every replica (a "
            "multiple of the batch size times the replicas), or run one pipeline (pipe_size equal to the devices)."
        )

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        self._refuse_uneven_evaluation("test")

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._refuse_uneven_evaluation("predict")

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._refuse_uneven_evaluation("validation")
        self._first_replicas_buffers()
        self._agree_on_outer_layers(f"At the start of a validation (after training batch {self._batch_idx})")
        if self._tally is not None:  # the check compares training steps
            self._tally.paused = True

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        trainer = self._trainer()
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:  # after the callbacks' and module's hooks
            trainer.should_stop = self._any_stops(trainer.should_stop)
        if self._tally is not None:
            self._tally.paused = False

    def _check_balance(self) -> None:
        """Time each stage's compute in training batches 2 to 5 (0 and 1 warm up: allocations, lazy setup),
        then compare with the profile on every rank and log the verdict on rank 0; collective, once."""
        if self._check_costs is None or self.pipe is None or self.failed:
            return
        batch, self._train_batches = self._train_batches, self._train_batches + 1
        if batch == _CHECK_FROM:
            self._tally = ComputeTally(self.root_device, self.pipe.tracer)  # passes reports on to a monitor's timer
            self.pipe.tracer = self._tally
        elif batch == _CHECK_FROM + _CHECK_STEPS and self._tally is not None:
            tally, self._tally, costs, self._check_costs = self._tally, None, self._check_costs, None
            if self.pipe.tracer is tally:
                self.pipe.tracer = tally.inner
            times = self.pipe.gather(tally.seconds(), to_all=True)
            assert times is not None
            self.balance_check = compare(costs, list(self.pipe.balance), times, steps=_CHECK_STEPS)
            (rank_zero_warn if self.balance_check.wrong else rank_zero_info)(self.balance_check.message())

    # -- checkpoints -------------------------------------------------------------------------------------

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # restore into the partitioned model: each stage loads only the entries of its own layers
        return True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole model's state_dict under its original keys on the first stage of each pipeline, and ``{}`` on
        the other stages, whatever ``state_dict_type``; collective over the pipeline.

        For the user who asks for the model. An other stage gets nothing rather than its own part under the whole
        model's keys, which saved or loaded would silently lose the other stages' layers (as Lightning's FSDP gives
        the full state on rank 0 alone). Lightning's checkpoint dump takes :meth:`_checkpoint_state_dict` instead.
        """
        if not self._dump_routed or self.pipe is None or self.pipe.group is None:
            return self._checkpoint_state_dict()  # the whole model (or, after a sharded run, the refusal)
        if self.failed:
            raise RuntimeError(
                "lightning_module_state_dict() was called after a stage of the pipeline failed: the stages cannot "
                "be gathered into the whole model any more. Use the last checkpoint saved before the failure."
            )
        whole = self._whole_state()
        return whole if whole is not None else {}

    def _checkpoint_state_dict(self) -> dict[str, Any]:
        """The module's state for Lightning's checkpoint dump: the whole model on the first stage; collective.

        With ``state_dict_type="sharded"`` every stage keeps its own part; the checkpoint writer stores it.
        """
        if self.pipe is None or self.pipe.group is None or self.state_dict_type == "sharded" or self.failed:
            return self._stage_module_state()  # after a failure nothing is gathered: save_checkpoint writes nothing
        whole = self._whole_state()
        return whole if whole is not None else self._stage_module_state()

    def _stage_module_state(self) -> dict[str, Any]:
        """The module's state_dict with this stage's part of the backbone (the whole module where it is whole)."""
        module = self.lightning_module
        assert module is not None
        with self._stage_state():
            return module.state_dict()

    def _whole_state(self) -> Optional[dict[str, Any]]:
        """The whole model's state_dict under its original keys on the pipeline's first stage, ``None`` on the other
        stages; collective over the pipeline."""
        assert self.pipe is not None
        full_backbone = model_state.gather_state_dict(self.pipe)
        if full_backbone is None:
            return None
        local = self._stage_module_state()
        return model_state.merge_backbone(local, full_backbone, self.backbone + ".", self.lightning_module)

    def _optimizer_layout(self, optimizer: Any) -> optim_state.Layout:
        module = self.lightning_module
        assert module is not None
        names = optim_state.param_names(_unwrap(optimizer), module)
        everyone = self.pipe.gather(names, to_all=True) if self.pipe is not None else [names]
        return optim_state.layout(everyone or [names], self._full_names)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's state for the whole model, numbered as on one device, on the first stage; collective."""
        optimizer = _unwrap(optimizer)
        if self.pipe is None and self._stage_optimizers:
            if id(optimizer) in self._states_at_the_end:
                return self._states_at_the_end[id(optimizer)]
            raise RuntimeError(
                "trainer.save_checkpoint() was called after the pipelined run ended: each rank's optimizer holds only "
                "its own stage's state, and the stages no longer run to gather it (they gather it at the end of a "
                "fit, for the optimizers that fit trained). Save while the run is under way (a ModelCheckpoint "
                "callback, or trainer.save_checkpoint in a hook such as on_train_end), or save the weights alone now: "
                "trainer.save_checkpoint(path, weights_only=True)."
            )
        if self.pipe is None or self.lightning_module is None or self.failed:
            return optimizer.state_dict()
        named = optim_state.named_state(optimizer, self.lightning_module)
        if self.state_dict_type == "sharded":
            return named
        parts = self.pipe.gather(named, to_all=False)
        if parts is None:
            return {}
        # the groups as they are now: a callback (BackboneFinetuning) may have added some since setup
        groups = optim_state.layout([optim_state.group_names(part) for part in parts], self._full_names)
        return optim_state.merge(parts, groups)

    def _gather_states_at_the_end(self) -> dict[int, dict[str, Any]]:
        """Every optimizer's whole-model state, on the CPU of each pipeline's first stage (``{}`` on the other stages,
        whose checkpoint is not written); collective over the pipeline, at the end of a full-mode run.

        After ``fit`` the pipe is closed, so the stages cannot be asked any more, while a one-device script commonly
        calls ``trainer.save_checkpoint(path)`` then. Gathering once here costs what one checkpoint save during the run
        costs, and keeps the whole optimizer state in the first stage's host memory (with Adam, twice the model's
        size; every rank already holds the whole backbone there after the run).
        """
        if self.layout.pipe_size == 1 or not self.optimizers:
            return {}
        states = {id(_unwrap(o)): self.optimizer_state(o) for o in self.optimizers}
        return {key: move_data_to_device(state, torch.device("cpu")) for key, state in states.items()}

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Each stage takes its parameters' state, by name, from a checkpoint of any split or of one device."""
        module = self.lightning_module
        assert module is not None
        # BaseFinetuning's groups first, as one device has them before it loads the optimizers' state
        restore_finetuning_param_groups(
            module.trainer, lambda groups: optim_state.local_groups(groups, module, self._full_names)
        )
        if self.pipe is not None:  # the groups may have changed since setup; collective
            self._layouts = [self._optimizer_layout(o) for o in self.optimizers]
        for optimizer, saved, layout in zip(self.optimizers, checkpoint["optimizer_states"], self._layouts):
            optimizer = _unwrap(optimizer)
            if "groups" in saved:  # a sharded checkpoint keeps the named form
                saved = optim_state.from_named(saved)
            optimizer.load_state_dict(optim_state.localize(saved, optimizer, module, layout))
        optimizers_to_device(self.optimizers, self.root_device)
        # after the callbacks' restore, which may load weights too (EMAWeightAveraging's current weights)
        self._note_split_weights(self._split_weights.watching)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write atomically: the whole file on the first rank, or (sharded) every stage's part.

        Nothing is written once a rank has failed (``OnExceptionCheckpoint``, say): the stages may stand at
        different steps and the failed one cannot be asked, so a checkpoint would not be consistent.
        """
        if self.failed:
            why = (
                f"the pipeline's processes (start_method={self._start_method!r}) ended with an error or an interrupt, "
                "and Lightning runs `on_exception` in the main process, which holds the model as it was before the "
                "run, not what the stages trained. Run the job as a script (start_method='popen', the default) for "
                "`OnExceptionCheckpoint`, or resume from the last checkpoint the stages saved."
                if self._in_main_process
                else "a stage of the pipeline failed, and the stages' states may not belong to the same step. Resume "
                "from the last checkpoint saved before the failure."
            )
            rank_zero_warn(f"Not saving the checkpoint {str(filepath)!r}: {why}")
            return
        if self.pipe is not None:
            self._merge_finetuning_groups(checkpoint)
            checkpoint["gpipe"] = {
                "calls": self.pipe.calls,
                "seed": self.pipe.seed,
                "chunks": self.pipe.chunks,
                "stages": self.layout.pipe_size,
                "balance": list(self.pipe.balance),
            }
            if self._loaders and hasattr(self._loaders[0], "position"):
                checkpoint["gpipe"]["loader"] = self._loaders[0].position()
        path = str(filepath)
        if self.state_dict_type == "sharded":
            if self.pipe is not None:  # the key order of a one-device state_dict, for `consolidate`
                with self.pipe.stage_state():
                    own = list(self.pipe.state_dict())
                keys = self.pipe.gather(own, to_all=False)
                full = {k: None for part in keys or [] for k in part}
                checkpoint["gpipe"]["state_dict_keys"] = list(
                    model_state.merge_backbone(
                        checkpoint["state_dict"], full, self.backbone + ".", self.lightning_module
                    )
                )
            save_sharded(checkpoint, path, writer=self.is_global_zero)
        elif self.is_global_zero:  # atomic in the thread that writes (AsyncCheckpointIO's own, say)
            atomic_checkpoint_io(self.checkpoint_io).save_checkpoint(checkpoint, path, storage_options=storage_options)

    def _merge_finetuning_groups(self, checkpoint: dict[str, Any]) -> None:
        """BaseFinetuning callbacks' saved param groups with every stage's parameters; collective.

        Each stage's callback names its own stage's parameters (and the layers outside the backbone); the
        file holds the first stage's state, which must name them all for a resume, on one device or on K.
        """
        module = self.lightning_module
        assert self.pipe is not None and module is not None
        states = checkpoint.get("callbacks") or {}
        names = finetuning_group_names(module.trainer, states)
        if not names:  # the same on every rank: the same callbacks
            return
        canonical = tied.canonical_names(module)
        local = {n: canonical.get(id(p), n) for n, p in module.named_parameters()}
        names = {
            key: {i: [[local.get(n, n) for n in g] for g in groups] for i, groups in per.items()}
            for key, per in names.items()
        }
        parts = self.pipe.gather(names, to_all=False)
        if parts is None:
            return
        merged = {
            key: {i: optim_state.layout([part[key][i] for part in parts], self._full_names) for i in per}
            for key, per in names.items()
        }
        checkpoint["callbacks"] = with_finetuning_group_names(states, merged)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Read a full file (``weights_only=True`` unless asked otherwise) or this stage's part of a sharded one: global
        rank 0's path on every rank (collective).

        Lightning resolves ``ckpt_path`` on each rank: ``"best"`` is each rank's own ``ModelCheckpoint`` view, which
        differs between data-parallel replicas where the monitored value is not synced over them (``self.log``
        without ``sync_dist=True``). Under DDP the model then still holds rank 0's weights (DDP broadcasts them when
        it wraps the restored model); here each stage restores after setup, so replicas loaded different files and
        trained or evaluated apart, or the stages of one pipeline could mix two files. Every rank reads rank 0's
        file, as DDP's weights come out, and a rank whose path differed warns.
        """
        path = self.broadcast(str(checkpoint_path))
        if path != str(checkpoint_path):  # on this rank only: rank 0's own path is the one loaded
            warnings.warn(
                f"Rank {self.global_rank} was given the checkpoint {str(checkpoint_path)!r} and rank 0 {path!r}: every "
                "rank loads rank 0's, as DDP's model holds rank 0's weights. A `ckpt_path='best'` differs between "
                "ranks where the monitored value differs between the data-parallel replicas: log it with "
                "`sync_dist=True` so that every rank picks the same best checkpoint.",
                stacklevel=2,
            )
        checkpoint_path = path
        self._saved_model_keys = None
        if is_sharded(path):
            checkpoint = load_sharded(path, self._stage_selector())
            order = {k: i for i, k in enumerate(checkpoint.get("gpipe", {}).get("state_dict_keys") or [])}
            self._saved_model_keys = sorted(sharded_model_keys(path), key=lambda k: order.get(k, len(order)))
        else:
            checkpoint = super().load_checkpoint(
                checkpoint_path, weights_only=True if weights_only is None else weights_only
            )
        saved = checkpoint.get("gpipe")
        if saved is not None and self.pipe is not None:  # the random streams go on where they stopped
            self.pipe.calls = saved["calls"]
            if self.seed is None:  # an explicit seed= wins (and warns), else the checkpoint's
                self.pipe.seed = saved["seed"]
            self._warn_if_random_streams_change(saved)
        trainer = self._trainer()
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        if saved is not None and saved.get("loader") is not None and fitting:
            # for the training loader the loop makes next; a `validate`/`test`/`predict(ckpt_path=...)` restores the
            # weights only, as on one device, and must not leave the position to a later `fit`'s loader
            self._loader_position = saved["loader"]
            if self._loaders and hasattr(self._loaders[0], "restore") and trainer is not None:
                # built before the restore, in this fit (`estimated_stepping_batches` read in configure_optimizers):
                # Lightning keeps it, and the iterator it began then, so the epoch begins again from the position
                self._loaders[0].restore(self._loader_position)
                self._loader_position = None
                restart_training_iterator(trainer, self._loaders[0])
            silence_not_resumable_warning()
        return checkpoint

    def _warn_if_random_streams_change(self, saved: dict[str, Any]) -> None:
        """Warn once (rank 0) when a training resume draws other dropout masks than the run it continues.

        The masks are keyed by (seed, call, micro-batch, layer): another ``chunks`` cuts other
        micro-batches, another seed draws other streams. Another K or balance changes neither.
        """
        module = self.lightning_module
        trainer = module.trainer if module is not None else None
        if trainer is None or trainer.state.fn != TrainerFn.FITTING or self.pipe is None:
            return
        changed = [
            f"{name}={now} (the checkpoint's: {then})"
            for name, now, then in (
                ("chunks", self.pipe.chunks, saved.get("chunks")),
                ("seed", self.pipe.seed, saved.get("seed")),
            )
            if then is not None and now != then
        ]
        if changed:
            rank_zero_warn(
                f"Resuming with {' and '.join(changed)}. Dropout's random streams are keyed by (seed, call, "
                "micro-batch, layer), so the random layers draw other masks and the results will differ from "
                f"an uninterrupted run. To keep them, resume with GPipeStrategy(chunks={saved.get('chunks')}) "
                "and leave `seed` unset (the checkpoint's seed is then used) or set it to "
                f"{saved.get('seed')}. A different number of stages or balance is fine.",
                category=UserWarning,
            )

    def _stage_selector(self) -> Callable[[tuple], bool]:
        """Which entries of a sharded checkpoint this stage reads: its own layers, the rest of the model."""
        module = self.lightning_module
        assert module is not None
        params = {n for n, _ in module.named_parameters()} | set(tied.canonical_names(module).values())
        with self._stage_state():
            return stage_selector(set(module.state_dict()), params)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        module = self.lightning_module
        assert module is not None
        state_dict = checkpoint["state_dict"]
        if strict:  # every rank checks the whole model's keys: each loads only its own layers' entries
            prefix = self.backbone + "."
            expected = model_state.full_keys(module, self.pipe, prefix) if self.pipe else list(module.state_dict())
            saved = self._saved_model_keys if self._saved_model_keys is not None else list(state_dict)
            model_state.check_keys(expected, saved, type(module).__name__)
        if self.pipe is not None:  # partitioned: this stage takes its layers' entries only
            state_dict = model_state.local_state_dict(state_dict, self.pipe, self.backbone + ".")
        module.load_state_dict(state_dict, strict=strict)
        trainer = self._trainer()  # a restore after setup (a resume, the learning rate finder's): its values count
        self._note_split_weights(trainer is not None and trainer.state.fn == TrainerFn.FITTING)

    # -- failure and teardown --------------------------------------------------------------------------

    def _report_failure(self, exception: BaseException) -> Optional[BaseException]:
        """Tell the other ranks at once (before Lightning runs any callback's ``on_exception``), then stop
        every collective of this rank: the peers will not join them.

        Returns the error to raise instead: the one a background check of this rank found, when the
        exception is only how the blocked call it found ended (a peer closed the connection).
        """
        if self._sigterm.is_agreed_stop(exception) or self._interrupt.is_agreed_stop(exception):
            return None  # raised by every rank at one point: their collectives meet
        self._failed = True
        board = self._board
        if board is not None:
            board.publish(exception)
        if self.pipe is not None and self.pipe.has_peers:  # threads may wait on dead peers
            exit_without_finalizers(board, error=exception)
        found = board.found if board is not None else None
        return found if found is not None and found is not exception else None

    def _end_call_together(self) -> None:
        """On each rank whose Trainer call ended without an error, after Lightning's last hook of the call: wait until
        every rank's call has ended, then stop watching for failures.

        Lightning calls ``on_fit_end`` and the module's ``teardown`` hook after the strategy's teardown. A rank that
        failed there exited 1 while the others had returned from ``fit``, and the job exited 0 under the default
        launcher (an outside tester's report; one device exits 1). Each rank now meets the others here, and a failure
        of theirs, published on the board, is raised as this rank's ``PipelineError`` naming it. A peer that ended
        without reporting breaks the barrier, and the board names it.
        """
        board = self._board
        if board is None or self._failed:
            return
        if self.world_size > 1 and distributed.is_distributed():
            doing = "the end of the Trainer's call, which every rank reaches"
            try:
                distributed.barrier(watch=distributed.Watching(board.raise_if_failed, doing, board.lost))
            except BaseException as error:
                replacement = self._report_failure(error)
                # the barrier may still be pending (a peer that failed in those hooks and lives on): destroying the
                # process group at exit then blocked (measured: ranks 1 and 2 never ended, until rank 0 killed them)
                exit_without_finalizers(board, error=error)
                if replacement is not None:
                    raise replacement from error
                raise
        board.stop()

    def _workers_failed(self, exception: BaseException) -> None:
        """In the main process of a spawn or fork launch, which is no rank: its workers failed or were interrupted.
        Lightning runs ``on_exception`` here next, on this process's model as it was before the run: nothing of it may
        be saved as the run's state (see ``save_checkpoint``)."""
        self._failed = self._in_main_process = True

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

        Full mode: the whole trained backbone, on every rank (the other stages' layers on the CPU), and likewise
        the averaged backbone of every weight-averaging callback's model copy; after a fit, the whole optimizer
        state on each pipeline's first stage too, for ``trainer.save_checkpoint`` after ``fit``.
        Sharded mode is for models that do not fit one host, so nothing is gathered: each rank keeps its
        own stage's trained layers and the other stages' layers stay on ``meta``, where any use fails
        loudly instead of running with untrained weights.
        """
        sharded: Optional[tuple[nn.Module, str, nn.Sequential]] = None
        trainer = self._trainer()
        if self.pipe is not None and not self._failed:
            module = self.lightning_module
            assert module is not None
            owner, name = self._backbone_owner(module)
            if self.state_dict_type == "sharded":  # put in after Lightning's `module.cpu()`, which meta would fail
                sharded = (owner, name, self.pipe.full_sequential())
                sharded_leftover.leave(sharded[2], self.pipe.balance, int(self.chunks), self.checkpoint)
            else:
                if trainer is not None and trainer.state.fn == TrainerFn.FITTING:  # while the pipe names their params
                    self._states_at_the_end = self._gather_states_at_the_end()
                for copy_owner, copy_name, cut in self._copies:  # the weight averages, whole on every rank too
                    setattr(copy_owner, copy_name, model_state.reassemble_copy(cut))
                setattr(owner, name, model_state.reassemble(self.pipe))
            self._stage_optimizers = self.layout.pipe_size > 1
            self.pipe.close()
        self._copies = []
        self.pipe = None
        self._sigterm.uninstall()
        self._requeue.uninstall()
        self._interrupt.uninstall()
        if trainer is not None and self._mesh is not None:  # their metrics, computed after `fit`, count samples once
            metric_sync.keep_over(trainer.callbacks)  # type: ignore[attr-defined]
        metric_sync.sync_over_replicas(None, kept=self.replica_group)
        if trainer is not None:  # the trainer's callbacks and checkpoint dump as the user left them
            dump_model_state_with(trainer, None)
            trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, StopTogether)]  # type: ignore[attr-defined]
        if self._board is not None and not self._failed and (trainer is None or trainer.interrupted):
            # A stop every rank agreed on (SIGTERM, Ctrl-C: Lightning's `on_exception` hooks and this teardown still
            # ran collectives) ends here. After a failure the board keeps watching until the exit; after a call that
            # ended normally, until every rank has ended it (`_end_call_together`, after Lightning's last hooks).
            self._board.stop()
        with self._meta_backbone_aside():
            super().teardown()
        if sharded is not None:
            owner, name, sequential = sharded
            whole = "For the whole model, load the sharded checkpoint with "
            whole += "`lightning_gpipe.checkpointing.consolidate(path)`."
            model_state.refuse_meta_state(sequential, self.layout.stage_of(self.global_rank), whole)
            setattr(owner, name, sequential)
            rank_zero_info(
                f"state_dict_type='sharded': after the run each rank holds only its own stage of `{self.backbone}` "
                f"(the other layers are on the meta device; the module's state_dict() refuses). {whole}"
            )

    @contextmanager
    def _meta_backbone_aside(self) -> Generator[None, None, None]:
        """Lightning's teardown moves the module to the CPU, which fails on ``meta`` tensors: a backbone a sharded
        run left (a later run that failed on it, or the main process of a spawn launch) stays aside meanwhile, so
        that the run's own error is the one raised."""
        module = self.lightning_module
        try:
            owner, name = self._backbone_owner(module) if module is not None else (None, "")
        except (AttributeError, TypeError, ValueError):  # no backbone: nothing of it to keep aside
            owner = None
        sequential = getattr(owner, name, None) if owner is not None else None
        if not isinstance(sequential, nn.Sequential) or not sharded_leftover.meta_layers(sequential):
            yield
            return
        setattr(owner, name, nn.Sequential())
        try:
            yield
        finally:
            setattr(owner, name, sequential)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        entries = (("gpipe", "popen"), ("gpipe_spawn", "spawn"), ("gpipe_fork", "fork"), ("gpipe_notebook", "fork"))
        for name, start_method in entries:
            strategy_registry.register(
                name,
                cls,
                description=f"GPipe pipeline, processes started with {start_method!r}",
                start_method=start_method,
            )


def _unwrap(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps the user's


def _uneven_training(counts: list[float], stage_of: Callable[[int], int], epoch: Optional[int]) -> str:
    """The error for ranks that would run different numbers of training batches an epoch (``epoch``: the epoch whose
    loaders were made anew, or ``None`` at the start of training)."""
    shown = ", ".join(f"rank {r} (stage {stage_of(r)}): {int(c)}" for r, c in enumerate(counts))
    when = "an epoch" if epoch is None else f"in epoch {epoch}, whose loaders were made anew"
    return _uneven_batches(f"training batches {when}", shown)


def _uneven_batches(what: str, shown: str) -> str:
    """The error for ranks of a pipeline that would run different numbers of ``what`` (``shown``: each rank's)."""
    return (
        f"The ranks would run different numbers of {what} ({shown}). The stages of a pipeline "
        "must get the same batches, and every rank agrees with the others at the end of each batch, so the rank "
        "that ran out first would leave the others waiting. Usual causes: a sampler, DataLoader or Dataset of your "
        "own built differently per rank (its length from the global rank, or from data drawn unseeded). Shard by "
        "data-parallel replica (`trainer.strategy.distributed_sampler_kwargs`, which Lightning's own sampler "
        "uses), never by global rank, and give every rank of a pipeline the same data."
    )
