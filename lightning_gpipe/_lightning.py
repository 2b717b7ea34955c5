"""Every access to Lightning's private API, in one place, so that a Lightning upgrade breaks here only.

Each helper says which private name it uses and why no public one serves. The strategy, the
monitor and the checkpoints use Lightning's public API everywhere else.
"""

from __future__ import annotations

import atexit
import copy
import operator
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Literal, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.data import _auto_add_worker_init_fn
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.callbacks import (
    BaseFinetuning,
    ModelSummary,
    StochasticWeightAveraging,
    ThroughputMonitor,
    WeightAveraging,
)
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.trainer.connectors.data_connector import _request_dataloader
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import CombinedLoader
from lightning.pytorch.utilities.exceptions import _TunerExitException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.model_summary.model_summary import ModelSummary as Summary
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.optim.swa_utils import AveragedModel
from torch.utils.data import DataLoader

from lightning_gpipe._subclass import copy_as
from lightning_gpipe.checkpointing import sharded_leftover
from lightning_gpipe.checkpointing.files import atomic_write
from lightning_gpipe.checkpointing.model_state import meta_state_allowed
from lightning_gpipe.engine.failure import exit_without_finalizers
from lightning_gpipe.engine.pipe import GPipe
from lightning_gpipe.engine.rng import isolated_rng

__all__ = [
    "MainProcessLauncher",
    "START_METHODS",
    "PipelineSummary",
    "atomic_checkpoint_io",
    "averaged_copies",
    "current_hook",
    "evaluation_batches",
    "finetuning_callbacks",
    "finetuning_group_names",
    "first_batch",
    "init_process_group",
    "launcher",
    "log_to_loggers",
    "optimizers_to_device",
    "restart_training_iterator",
    "restore_finetuning_param_groups",
    "sample_loaders",
    "seed_workers",
    "should_update_logs",
    "silence_sync_dist_advice",
    "silence_not_resumable_warning",
    "tell_swa_about_batch_norm",
    "use_pipeline_summaries",
    "validation_interval_seconds",
    "walk_stages_in_finetuning",
    "with_finetuning_group_names",
]


def validation_interval_seconds(trainer: "pl.Trainer") -> Optional[float]:
    """``val_check_interval`` in seconds when it was given as a time ("00:00:10:00", a timedelta, a dict), else None.

    Lightning keeps the parsed time only in a private attribute; ``trainer.val_check_interval`` is then unset.
    """
    return getattr(trainer, "_val_check_time_interval", None)


def current_hook(module: "pl.LightningModule") -> str:
    """The name of the hook Lightning is running on ``module`` (``training_step``, ``on_train_batch_end``...).

    Lightning keeps it in a private attribute, set around every strategy, module and callback hook it
    calls; there is no public accessor. Empty outside a hook.
    """
    return getattr(module, "_current_fx_name", None) or ""


OnFailure = Callable[[BaseException], Optional[BaseException]]
#: Called on each rank whose Trainer call ended without an error, last of all (after the module's ``teardown`` hook).
OnSuccess = Callable[[], None]


def _reporting(function: Callable, on_failure: OnFailure, on_success: OnSuccess) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            result = function(*args, **kwargs)
        except _TunerExitException:
            # how Lightning's tuner (`Tuner.lr_find`) ends the fit it ran on every rank, which Lightning then tears
            # down as a finished fit: not a failure (reported as one, the backbone stayed partitioned after it)
            on_success()
            raise
        except BaseException as error:
            replacement = on_failure(error)
            if replacement is not None:
                raise replacement from error
            raise
        # Lightning's last hooks (`on_fit_end`, the module's `teardown`) run after the strategy's teardown, inside this
        # call: a rank failing there exited 1 while the others had returned, and the job exited 0 (an outside tester's
        # report). `on_success` waits for every rank's call to end, and raises another rank's failure.
        on_success()
        return result

    return run


@dataclass(frozen=True)
class _WorkerStopped:
    """What rank 0's worker hands the main process of a spawn or fork launch when its run ended in a ``SystemExit``
    (Lightning's ``SIGTERMException`` after a SIGTERM) or a ``KeyboardInterrupt``, instead of its results.

    torch's worker wrapper reports neither to the main process: such a worker exits as if it had finished, and
    Lightning's launch then waited for its results for good (measured: SIGTERM to the workers of a spawn launch, the
    main process still waiting after 90 s). The main process raises the same instead."""

    stop: BaseException


class MainProcessLauncher(_MultiProcessingLauncher):
    """Lightning's spawn/fork launcher, but a sharded run leaves no untrained layers in the main process.

    Lightning hands rank 0's ``state_dict`` back to the main process and loads it with ``strict=False``
    (a private method, overridden here only). After a sharded run rank 0 holds the other stages'
    layers on ``meta`` (nothing is gathered), and copying from ``meta`` fails. Skipping those entries
    would leave the main process silently holding the untrained initial weights of the other stages;
    so those tensors become ``meta`` in the main process too, where any use fails loudly, and a
    warning says how to get the whole model.
    """

    def _collect_rank_zero_results(self, trainer: "pl.Trainer", results: Any) -> Any:
        with meta_state_allowed():  # after a sharded run: handed back as meta, made meta in the main process below
            return super()._collect_rank_zero_results(trainer, results)

    def _recover_results_in_main_process(self, worker_output: Any, trainer: "pl.Trainer") -> None:
        if isinstance(worker_output, _WorkerStopped):  # rank 0's run stopped (see _WorkerStopped): stop here alike
            raise worker_output.stop
        path = worker_output.weights_path
        if path is None or getattr(self._strategy, "state_dict_type", "full") != "sharded":
            return super()._recover_results_in_main_process(worker_output, trainer)
        weights = self._strategy.checkpoint_io.load_checkpoint(path)
        module = trainer.lightning_module
        meta = [k for k, v in weights.items() if isinstance(v, torch.Tensor) and v.is_meta]
        for key in meta:
            owner_name, _, name = key.rpartition(".")
            owner = module.get_submodule(owner_name)
            param, buffer = owner._parameters.get(name), owner._buffers.get(name)
            if param is not None:
                owner._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            elif buffer is not None:
                owner._buffers[name] = buffer.to("meta")
        module.load_state_dict({k: v for k, v in weights.items() if k not in set(meta)}, strict=False)
        self._strategy.checkpoint_io.remove_checkpoint(path)
        if meta:
            backbone = operator.attrgetter(getattr(self._strategy, "backbone", "backbone"))(module)
            if isinstance(backbone, nn.Sequential):  # a later run on this copy is refused, naming why
                sharded_leftover.leave_in_main_process(backbone)
            rank_zero_warn(
                f"state_dict_type='sharded': the model in the main process holds only the first stage's trained "
                f"layers; {len(meta)} tensors of the other stages are on the meta device. Load the whole model from "
                "the sharded checkpoint with `lightning_gpipe.checkpointing.consolidate(path)`.",
                category=UserWarning,
            )
        super()._recover_results_in_main_process(worker_output._replace(weights_path=None), trainer)


class _ReportingSubprocessLauncher(_SubprocessScriptLauncher):
    on_failure: OnFailure
    on_success: OnSuccess
    #: seconds from a failure on rank 0 to its exit after which the ranks it started that still run are killed
    children_grace: float
    #: seconds from a rank's death to Lightning's killing of every rank (see _patient_observer)
    observer_grace: float

    def launch(self, function: Callable, *args: Any, trainer: Optional["pl.Trainer"] = None, **kwargs: Any) -> Any:
        def observed(*args: Any, **kwargs: Any) -> Any:  # runs once Lightning started the other ranks and its observer
            _patient_observer(self.observer_grace)
            return function(*args, **kwargs)

        try:
            return super().launch(
                _reporting(observed, self.on_failure, self.on_success), *args, trainer=trainer, **kwargs
            )
        except _TunerExitException:
            raise
        except BaseException:
            if self.procs:  # rank 0, which started the other ranks of this node
                # the observer polls every few seconds: a rank whose death ended this one may not be named yet
                _say_which_children_died(self.procs, "")
                _end_children_at_exit(self.procs, self.children_grace)
            raise


#: The ranks this process killed at its exit (``_end_children_at_exit``): the observer says nothing of them.
_KILLED_AT_EXIT: set[int] = set()
#: The processes whose end :func:`_say_which_children_died` has told, by pid: each is told once.
_TOLD: set[int] = set()


def _say_which_children_died(children: list[Any], then: str) -> bool:
    """Write one line for each rank this process started that has ended with an error and was not told of yet; whether
    any rank has ended so. ``then`` ends the line (what happens next)."""
    ended = False
    for rank, child in enumerate(children, start=1):
        if not child.poll():
            continue
        ended = True
        if child.pid in _KILLED_AT_EXIT or child.pid in _TOLD:
            continue
        _TOLD.add(child.pid)
        code = child.returncode
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        sys.stderr.write(f"[lightning_gpipe] rank {rank} (pid {child.pid}) ended with {how}{then}\n")
        sys.stderr.flush()
    return ended


def _patient_observer(grace: float) -> None:
    """Make Lightning's child-process observer say which rank died, and wait ``grace`` seconds before it kills every
    rank (itself with SIGKILL).

    Lightning's popen launcher watches the ranks it started and, once one exits with an error, kills all of them and
    the main process at once: the job ended with code 137 and "Child process with PID 31044 terminated with code -9",
    naming no rank, before the pipeline could say which stage was gone and why. The failure board names it within a
    second or two and ends every rank by itself; the observer's kill stays as the last resort. Private: the observer
    thread (named ``child-process-observer``) and its ``_run`` and ``_child_processes``.
    """
    for thread in threading.enumerate():
        run, children = getattr(thread, "_run", None), getattr(thread, "_child_processes", None)
        if thread.name != "child-process-observer" or run is None or children is None:
            continue
        if getattr(run, "patient", False):  # made patient by an earlier fit of this script
            continue
        first_death: list[float] = []
        next_ = "; the other ranks end with the pipeline's error that names it (Lightning's launcher kills them after "
        next_ += f"{grace:.0f}s)"

        def patient(
            run: Callable[[], bool] = run, children: list[Any] = children, first: list = first_death, then: str = next_
        ) -> bool:
            if _say_which_children_died(children, then) and not first:
                first.append(time.monotonic())
            if first and time.monotonic() - first[0] < grace:
                return False
            return run()

        patient.patient = True  # type: ignore[attr-defined]
        thread._run = patient  # type: ignore[attr-defined]


def _end_children_at_exit(children: list[Any], grace: float) -> None:
    """At this process's exit, kill the ranks it started that still run ``grace`` seconds after now.

    Lightning's popen launcher kills every rank when a child dies, but not when rank 0 (this process) fails: a rank
    that cannot end itself outlived the job. A frozen one (SIGSTOP, a debugger, a stuck driver call in the kernel) runs
    no watchdog: measured, it stayed stopped for good, and a reader of the job's output (`subprocess.run` with
    `capture_output`, a CI step's pipe) waited for it without end. Ranks that can end themselves do so first: with the
    failure (within a second) or by their watchdog (``watchdog_grace``).
    """
    deadline = time.monotonic() + grace

    def _end() -> None:
        for child in children:
            try:
                child.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                sys.stderr.write(
                    f"[lightning_gpipe] rank 0: killing the process {child.pid} this rank started, which has not ended "
                    f"{grace:.0f}s after the run failed (frozen or stopped: it cannot end itself)\n"
                )
                sys.stderr.flush()
                _KILLED_AT_EXIT.add(child.pid)
                child.kill()
                child.wait()
        # a rank that published its failure and then ended while this one was already on its way out
        _say_which_children_died(children, "")

    atexit.register(_end)


#: How the strategy's processes can be started: Lightning's subprocess launcher, or its multiprocessing one
START_METHODS = ("popen", "spawn", "fork", "forkserver")

#: Seconds the main process of a spawn or fork launch waits for its workers to end after a Ctrl-C, before it kills them.
CHILDREN_GRACE = 30.0


class _ReportingMultiProcessingLauncher(MainProcessLauncher):
    on_failure: OnFailure
    on_success: OnSuccess
    on_workers_failure: Callable[[BaseException], None]
    _main_pid: Optional[int] = None  # the process that forwards SIGTERM (see launch)

    def launch(self, function: Callable, *args: Any, trainer: Optional["pl.Trainer"] = None, **kwargs: Any) -> Any:
        """Lightning's launch, and in the main process, which is no rank, what follows a worker's failure or a Ctrl-C.

        Lightning runs ``on_exception`` (``OnExceptionCheckpoint``) in this process, on its copy of the model as it
        was before the run: ``on_workers_failure`` makes the strategy refuse to save it (measured: a stage raising
        under ``start_method="spawn"`` left an ``on_exception.ckpt`` of the untrained model, global step 0). A Ctrl-C
        that reached this process alone (``kill -INT``) left the workers training while its exit waited for them;
        it is passed on to them, and the ones still running after ``CHILDREN_GRACE`` seconds are killed. A SIGTERM
        to this process alone (a scheduler's, which signals the job's first process) killed it at once, since
        Lightning sets no handler here: while the workers run it is passed on to them instead, and they stop together
        (:mod:`lightning_gpipe.sigterm`).
        """
        forwarding = threading.current_thread() is threading.main_thread()
        forwarding = forwarding and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # not over a user's handler
        if forwarding:
            self._main_pid = os.getpid()
            signal.signal(signal.SIGTERM, self._forward_sigterm)
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        except KeyboardInterrupt as error:
            self._end_workers(signal.SIGINT)
            self.on_workers_failure(error)
            raise
        except BaseException as error:
            self.on_workers_failure(error)
            raise
        finally:
            if forwarding:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def _forward_sigterm(self, signum: int, _: Any) -> None:
        """The main process's SIGTERM handler while the workers run. A forked worker inherits it (and Lightning's
        handler there calls it too): it does nothing outside the main process. Before any worker runs, the signal ends
        this process, as it did without the handler."""
        if os.getpid() != self._main_pid:
            return
        if not self._pass_on(signum):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def _pass_on(self, signum: int) -> list[Any]:
        """Send ``signum`` to the workers that run; those workers."""
        workers: list[Any] = [p for p in self.procs if p.is_alive() and p.pid is not None]
        for worker in workers:
            try:
                os.kill(worker.pid, signum)
            except ProcessLookupError:  # ended meanwhile
                pass
        return workers

    def _end_workers(self, signum: int) -> None:
        workers = self._pass_on(signum)
        deadline = time.monotonic() + CHILDREN_GRACE
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        for worker in workers:
            if worker.is_alive():
                worker.kill()

    def _wrapping_function(
        self, process_idx: int, trainer: Optional["pl.Trainer"], function: Callable, *args: Any, **kwargs: Any
    ) -> None:
        try:
            super()._wrapping_function(
                process_idx, trainer, _reporting(function, self.on_failure, self.on_success), *args, **kwargs
            )
        except (SystemExit, KeyboardInterrupt) as stop:
            strategy = trainer.strategy if trainer is not None else None
            if getattr(strategy, "failed", False):  # this rank's own failure, not a stop the ranks agreed on
                # torch's worker wrapper hands the main process an Exception's traceback only: a `sys.exit(3)` on one
                # rank read "process 1 terminated with exit code 1" there, its cause lost
                raise RuntimeError(f"rank {process_idx} failed: {type(stop).__name__}: {stop}") from stop
            if process_idx == 0:  # Lightning's arguments after the function: args, kwargs, the return queue
                args[2].put(_WorkerStopped(stop.with_traceback(None)))
            # Lightning tears the run down in the main process only: this worker's pipeline threads and process group
            # are still up, and the interpreter's finalizers aborted it on their way out (SIGABRT, 1 run in 3)
            exit_without_finalizers(code=0)
            raise


def launcher(
    strategy: Any,
    start_method: str,
    on_failure: OnFailure,
    on_success: OnSuccess,
    on_workers_failure: Callable[[BaseException], None],
) -> _Launcher:
    """Lightning's launcher for ``start_method``, reporting an exception of the trainer function first.

    Lightning catches an exception of ``fit`` (or ``validate``...) above the launcher and then calls
    every callback's ``on_exception`` before the strategy's: a callback such as
    ``OnExceptionCheckpoint`` would start a collective that the other stages, still waiting for
    the failed one, never join. Reported here, inside the launcher (inside each spawned process for
    spawn and fork), the failure reaches the other ranks before any callback runs. Lightning has no
    hook at that point, so these subclass its launchers (private classes). ``on_failure`` may return
    another exception to raise instead (from the original). ``on_success`` is called on each rank whose call ended
    without an error, after Lightning's last hook of the call. ``on_workers_failure`` is called in the main process
    of a spawn or fork launch when its workers failed or were interrupted.
    """
    chosen: Any
    if start_method == "popen":
        chosen = _ReportingSubprocessLauncher(strategy.cluster_environment, strategy.num_processes, strategy.num_nodes)
    else:
        if start_method not in START_METHODS:
            raise ValueError(f"`start_method` must be one of {START_METHODS}, got {start_method!r}.")
        chosen = _ReportingMultiProcessingLauncher(strategy, start_method=start_method)  # type: ignore[arg-type]
        chosen.on_workers_failure = on_workers_failure
    chosen.on_failure, chosen.on_success = on_failure, on_success
    if isinstance(chosen, _ReportingSubprocessLauncher):  # the ranks end themselves by then
        chosen.children_grace = strategy.watchdog_grace + 5.0
        chosen.observer_grace = strategy.failure_timeout + strategy.watchdog_grace + 5.0
    return chosen


def init_process_group(environment: ClusterEnvironment, backend: str, device: torch.device, timeout: timedelta) -> None:
    """Initialize the default process group the way Lightning's DDP does (a no-op when it exists)."""
    _init_dist_connection(environment, backend, timeout=timeout, device_id=device if device.type == "cuda" else None)


optimizers_to_device = _optimizers_to_device


def silence_not_resumable_warning() -> None:
    """Drop Lightning's warning that a plain DataLoader cannot resume mid-epoch: the strategy resumes it.

    Lightning warns when the loader lacks its stateful-loader protocol, which this package does not use
    (see ``resumable.py``), so the warning is matched by its text.
    """
    from lightning.fabric.utilities.warnings import PossibleUserWarning

    warnings.filterwarnings(
        "ignore",
        message="You're resuming from a checkpoint that ended before the epoch ended",
        category=PossibleUserWarning,
    )


def silence_sync_dist_advice() -> None:
    """Drop Lightning's advice to log epoch-level values with ``sync_dist=True``, with one pipeline.

    Lightning syncs logged values only under a strategy whose ``is_distributed`` is true, and it is false
    with one pipeline (so that no DistributedSampler is injected). It then advises ``sync_dist=True`` on
    every epoch-level value, even one logged with it; and there is nothing to sync: every stage of the
    one pipeline holds the same values. With replicas the advice is real, so it is dropped only here.
    """
    from lightning.fabric.utilities.warnings import PossibleUserWarning

    warnings.filterwarnings(
        "ignore",
        message=r"It is recommended to use `self\.log\(.*sync_dist=True\)` when logging on epoch level",
        category=PossibleUserWarning,
    )


def should_update_logs(trainer: "pl.Trainer") -> bool:
    """Whether Lightning writes step metrics to the loggers after this batch.

    Lightning has no public accessor; its own monitors (LearningRateMonitor, DeviceStatsMonitor,
    ThroughputMonitor) read this same private property. It depends only on the loop's progress, so
    every rank gets the same answer, which makes it safe to gate a collective on it.
    """
    return trainer._logger_connector.should_update_logs


def log_to_loggers(trainer: "pl.Trainer", metrics: dict[str, float]) -> None:
    """Send ``metrics`` to every logger at the current training step, with the ``epoch`` key that Lightning adds.

    This is the path Lightning's ThroughputMonitor takes. ``LightningModule.log`` costs about half a
    millisecond per key (it builds a result-collection entry), which for tens of per-stage keys would
    cost more than the measurement; the loggers themselves write on rank 0 only.
    """
    trainer._logger_connector.log_metrics(metrics)  # type: ignore[arg-type]


def _running_loop(trainer: "pl.Trainer") -> Optional[tuple[Any, str, str]]:
    """The loop of the running stage (fit, validate, test, predict), its step's name and its loader's name."""
    loops = {
        TrainerFn.FITTING: (trainer.fit_loop, "training_step", "train"),
        TrainerFn.VALIDATING: (trainer.validate_loop, "validation_step", "val"),
        TrainerFn.TESTING: (trainer.test_loop, "test_step", "test"),
        TrainerFn.PREDICTING: (trainer.predict_loop, "predict_step", "predict"),
    }
    return loops.get(trainer.state.fn)  # type: ignore[arg-type]


def sample_loaders(trainer: "pl.Trainer") -> Optional[Any]:
    """The running stage's loaders, built now for the profile's first batch (:func:`first_batch`) and dropped then.

    Rank 0 profiles the backbone on the first batch during setup, before Lightning asks for the loaders, so a
    loader hook (the module's or the datamodule's ``*_dataloader``) is called here, once, on every rank at the
    same point: a hook that joins a collective (a seed broadcast from rank 0) meets the other ranks' call. The
    loaders Lightning trains on are not these: its own request calls the hook again at its usual point, after a
    resume has restored the datamodule's and the module's state and after the ``on_fit_start`` hooks, so they
    are built from the state they set, as on one device. (Handed over to that request instead, a resumed
    datamodule's level of difficulty was the one before the restore: 0.17 off one device, silently.) The call
    here runs with every random generator put back afterwards, so a hook that draws its data at random draws it
    at Lightning's request as on one device. A hook called for its count is called once more than on one
    device, as Lightning's own ``estimated_stepping_batches`` and DeepSpeed's batch-size lookup call it. Loaders
    given to ``fit`` are the user's objects: no hook runs. ``None`` where the stage has no loaders.

    A stage whose loop will ask for loaders that nobody defined (``trainer.predict`` on a datamodule without
    ``predict_dataloader``) gets Lightning's own error here, on every rank, from the hook's default: the profile
    would otherwise fail first, naming a missing sample and ``example_input_array``, and following that advice led
    to Lightning's error only after it.
    """
    running = _running_loop(trainer)
    if running is None:
        return None
    loop = running[0]
    source = loop._data_source  # private: Lightning has no public accessor (its DeepSpeedStrategy reads it too)
    if not source.is_defined():
        if _asks_for_loaders(trainer):
            _request_dataloader(source)  # the LightningModule's default hook raises Lightning's error
        return None
    kept = _kept_loaders(loop)
    if kept is not None:  # Lightning will not ask: it keeps the loaders of an earlier fit
        return kept
    device = trainer.strategy.root_device
    with isolated_rng(device, everything=True):
        return _request_dataloader(source)


def _asks_for_loaders(trainer: "pl.Trainer") -> bool:
    """Whether the running stage's loop will request its loaders (Lightning's ``setup_data`` skips a loop limited to
    0 batches, and a validation or test without its step)."""
    module = trainer.lightning_module
    fn = trainer.state.fn
    if fn == TrainerFn.PREDICTING:
        return trainer.limit_predict_batches != 0
    if fn in (TrainerFn.VALIDATING, TrainerFn.TESTING):
        testing = fn == TrainerFn.TESTING
        limit = trainer.limit_test_batches if testing else trainer.limit_val_batches
        return limit != 0 and is_overridden("test_step" if testing else "validation_step", module)
    return fn == TrainerFn.FITTING


def evaluation_batches(trainer: "pl.Trainer") -> list[float]:
    """The number of batches of each loader the running validation, test or predict loop will run on this rank
    (``inf`` where unknown). Private: ``Trainer._evaluation_loop``, the loop Lightning itself picks for the stage."""
    predicting = trainer.state.fn == TrainerFn.PREDICTING
    loop = trainer.predict_loop if predicting else trainer._evaluation_loop
    return [float(batches) for batches in loop.max_batches]


def restart_training_iterator(trainer: "pl.Trainer", loader: Any) -> None:
    """Make the fit loop's training iterator anew where it holds ``loader`` and has begun iterating.

    Lightning begins the training iterator where it sets up the training data (``FitLoop.setup_data``), and a
    resumed fit goes on with that iterator. Set up before the checkpoint was read (``estimated_stepping_batches``
    read in ``configure_optimizers`` sets it up then), it began the epoch from its start, before the loader was
    given its position (``resumable``): begun again, it starts at the position. Private: the loop's
    ``_data_fetcher``, whose ``iter()`` is the call Lightning itself makes to begin an epoch.
    """
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    combined = getattr(fetcher, "_combined_loader", None)
    if fetcher is None or combined is None or fetcher.iterator is None:
        return
    if any(held is loader for held in combined.flattened):
        iter(fetcher)


def _kept_loaders(loop: Any) -> Optional[list[Any]]:
    """The loaders a fit loop keeps from an earlier ``fit`` on the same Trainer: it requests none then.

    Private: the fit loop's ``_combined_loader`` and ``_should_reload_train_dl``, the test its ``setup_data`` makes.
    """
    kept = getattr(loop, "_combined_loader", None)
    if loop is not loop.trainer.fit_loop or kept is None or loop._should_reload_train_dl:
        return None
    return list(kept.flattened)


def first_batch(trainer: "pl.Trainer", loaders: Any) -> Optional[tuple[Any, str, str]]:
    """The first batch of ``loaders`` (:func:`sample_loaders`), the step that takes it, and the loader's name;
    ``None`` if there is no dataloader or it is empty."""
    running = _running_loop(trainer)
    if running is None or loaders is None:
        return None
    _, step, name = running
    mode: Literal["max_size_cycle", "sequential"] = (
        "max_size_cycle" if trainer.state.fn == TrainerFn.FITTING else "sequential"
    )
    combined = copy.copy(loaders) if isinstance(loaders, CombinedLoader) else CombinedLoader(loaders, mode)
    combined.flattened = [_fresh_copy(x) if isinstance(x, DataLoader) else x for x in combined.flattened]
    # A loader's own generators (``DataLoader(generator=g)``, a sampler's) draw the shuffle and the workers'
    # base seed when an iterator starts. Only the rank that profiles takes this batch: put them back, or
    # its next epoch would be shuffled and augmented apart from the other stages' (and from one device's).
    generators = _generators_of(combined.flattened)
    states = [g.get_state() for g in generators]
    try:
        batch, _, _ = next(iter(combined))
    except StopIteration:
        return None
    finally:
        for generator, state in zip(generators, states):
            generator.set_state(state)
    return batch, step, f"{name} dataloader"


def _fresh_copy(loader: DataLoader) -> DataLoader:
    """A shallow copy of ``loader`` without its persistent workers' iterator (torch's private ``_iterator``).

    A loader with persistent workers keeps the iterator it makes, and reuses one it made before. Iterated
    itself, on the one rank that profiles, its workers would start (before Lightning's worker seeding) or go on,
    and draw for the batches they prefetch: that rank's training epochs would come from workers the other
    stages' do not match. The copy starts workers of its own, which end with it.
    """
    clone = copy.copy(loader)
    clone.__dict__["_iterator"] = None
    return clone


def seed_workers(dataloader: object, rank: int) -> None:
    """Lightning's worker seeding for ``seed_everything(workers=True)`` (where ``worker_init_fn`` is unset), with
    ``rank`` in the seeds. Private ``_auto_add_worker_init_fn``: Lightning calls it with the global rank only,
    and has no public way to give another (see ``GPipeStrategy._seed_workers_by_replica``)."""
    _auto_add_worker_init_fn(dataloader, rank)


def _generators_of(loaders: list[Any]) -> list[torch.Generator]:
    """The ``torch.Generator`` objects a loader, its sampler and its batch sampler hold (each once)."""
    found: dict[int, torch.Generator] = {}
    for loader in loaders:
        batch_sampler = getattr(loader, "batch_sampler", None)
        holders = (loader, getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None))
        for holder in holders:
            generator = getattr(holder, "generator", None)
            if isinstance(generator, torch.Generator):
                found[id(generator)] = generator
    return list(found.values())


def _counts(pipe: GPipe) -> tuple[int, int]:
    """Parameters and trainable parameters of the whole backbone; collective over the pipeline."""
    elsewhere = {id(p) for p in pipe.ties.counted_elsewhere()}  # a tied parameter counts once
    params = [p for p in pipe.parameters() if id(p) not in elsewhere]
    counts = torch.tensor([sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)])
    if pipe.group is not None:
        dist.all_reduce(counts, group=pipe.group)
    return int(counts[0]), int(counts[1])


class PipelineSummary(Summary):
    """A model summary whose totals and backbone row cover every stage: each rank holds only its own stage."""

    def __init__(self, model: Any, max_depth: int, backbone: str, pipe: GPipe) -> None:
        self._backbone, self._pipe = backbone, pipe
        local = list(pipe.parameters())
        full_total, full_trainable = _counts(pipe)
        self._extra_total = full_total - sum(p.numel() for p in local)
        self._extra_trainable = full_trainable - sum(p.numel() for p in local if p.requires_grad)
        self._backbone_total = full_total
        with pipe.whole_batches():  # the layers' sizes and flops of the example batch, as one device sees it
            super().__init__(model, max_depth)  # runs `example_input_array` through the model, if set
        # Each rank counted the flops of its own stage's layers only (and of the layers outside the backbone, which
        # every rank runs): the backbone's are summed over the stages.
        self._local_backbone_flops = sum(self._flops_under(f"{type(model).__name__}.{backbone}").values())
        flops = torch.tensor([self._local_backbone_flops], dtype=torch.float64)
        if pipe.group is not None:
            dist.all_reduce(flops, group=pipe.group)
        self._backbone_flops = int(flops.item())
        # Likewise the modules in train and eval mode: each rank holds its own stage's layers only.
        stage_modules = [m for _, layer in pipe.local_layers() for m in layer.modules()]
        modes = torch.tensor([sum(m.training for m in stage_modules), sum(not m.training for m in stage_modules)])
        self._local_modes = (int(modes[0]), int(modes[1]))
        if pipe.group is not None:
            dist.all_reduce(modes, group=pipe.group)
        self._every_stage_modes = (int(modes[0]), int(modes[1]))

    def _get_summary_data(self) -> list[tuple[str, list[str]]]:
        """The table's columns; with ``max_depth`` above 1, the rows inside the backbone are every stage's.

        Each rank lists the layers of its own stage only (with their sizes and flops, which only that rank
        measured): the rows are gathered from every stage, in layer order, in place of this rank's. Collective
        over the pipeline; the model-summary callback asks every rank for the data.
        """
        arrays = super()._get_summary_data()
        if self._pipe.group is None or self._max_depth == 1:
            return arrays
        inside = self._backbone + "."
        rows = list(zip(*(values for _, values in arrays)))
        name = [column for column, _ in arrays].index("Name")
        parts = self._pipe.gather([row for row in rows if row[name].startswith(inside)], to_all=True) or []
        merged = [row for row in rows if not row[name].startswith(inside)]
        at = next((i + 1 for i, row in enumerate(merged) if row[name] == self._backbone), len(merged))
        merged[at:at] = [row for part in parts for row in part]
        columns = [list(values) for values in zip(*merged)]
        columns[0] = [str(i) for i in range(len(merged))]  # the row numbers
        return [(column, values) for (column, _), values in zip(arrays, columns)]

    def _flops_under(self, name: str) -> dict[Any, int]:
        """The flops the counter attributed to module ``name``, by operator (its submodules included)."""
        return self._flop_counter.get_flop_counts().get(name, {})

    @property
    def total_flops(self) -> int:
        return super().total_flops - self._local_backbone_flops + self._backbone_flops

    @property
    def total_training_modes(self) -> dict[str, int]:
        modes = super().total_training_modes
        (train, evaluating), (every_train, every_eval) = self._local_modes, self._every_stage_modes
        return {"train": modes["train"] - train + every_train, "eval": modes["eval"] - evaluating + every_eval}

    @property
    def flop_counts(self) -> dict[str, dict[Any, int]]:
        counts = super().flop_counts
        if self._backbone in counts:
            counts[self._backbone] = {"every stage": self._backbone_flops}
        return counts

    @property
    def param_nums(self) -> list[int]:
        nums = super().param_nums
        return [self._backbone_total if name == self._backbone else n for name, n in zip(self.layer_names, nums)]

    @property
    def total_parameters(self) -> int:
        return super().total_parameters + self._extra_total

    @property
    def trainable_parameters(self) -> int:
        return super().trainable_parameters + self._extra_trainable

    @property
    def total_layer_params(self) -> int:  # keeps the "other params" row for what lies outside all layers only
        return super().total_layer_params + self._extra_total


class _Pipeline:
    """Mixed into a ``ModelSummary`` callback: its summary counts every stage while a pipeline runs.

    ``ModelSummary._summary`` (private) is the one method that builds the summary; Lightning offers no
    public way to change what its callback counts.
    """

    _max_depth: int

    def _summary(self, trainer: Any, pl_module: Any) -> Summary:
        strategy = trainer.strategy
        pipe = getattr(strategy, "pipe", None)
        if pipe is None:
            return super()._summary(trainer, pl_module)  # type: ignore[misc]  # ModelSummary comes next in the MRO
        return PipelineSummary(pl_module, self._max_depth, strategy.backbone, pipe)


def _callbacks(trainer: "pl.Trainer") -> list[Any]:
    return trainer.callbacks  # type: ignore[attr-defined]  # set in Trainer.__init__, not declared


def use_pipeline_summaries(trainer: "pl.Trainer") -> None:
    """Make the trainer's model-summary callbacks count the whole pipeline.

    Lightning adds its ``ModelSummary`` callback itself, so each one in ``trainer.callbacks`` is replaced
    by a copy of it (same settings) that derives from :class:`_Pipeline` too (see :mod:`lightning_gpipe._subclass`).
    """
    callbacks = _callbacks(trainer)
    for i, callback in enumerate(callbacks):
        if isinstance(callback, ModelSummary):
            callbacks[i] = copy_as(callback, _Pipeline)


class _PipelineThroughput:
    """Lightning's ``Throughput`` for a pipeline: every sample counted once per pipeline, flops per device.

    ``ThroughputMonitor`` makes its ``Throughput`` with ``world_size=trainer.world_size``, which counts every
    process as a data-parallel device: it multiplies each device's samples and batches by it for the job's
    totals. A pipeline's K processes all see the same batch, so the totals were K times too high. With
    ``world_size`` set to the number of pipelines (data-parallel replicas) the totals are right, and a job of
    one pipeline logs what one device logs (no totals). The flops, though, are the whole model's per batch
    (``flops_per_batch``), spread over K devices: the per-device flops and MFU are divided by K here.
    """

    stages: int
    separator: str

    def compute(self) -> Any:
        metrics = super().compute()  # type: ignore[misc]
        for name in ("flops_per_sec", "mfu"):
            key = f"device{self.separator}{name}"
            if key in metrics:
                metrics[key] /= self.stages
        return metrics


def count_throughput_per_pipeline(trainer: "pl.Trainer", pipelines: int, stages: int) -> None:
    """Make each ``ThroughputMonitor`` count a pipeline of ``stages`` processes as one data-parallel device.

    The monitor builds its ``Throughput`` objects in its ``setup`` hook, before the strategy's ``setup``, and keeps
    them in the private ``_throughputs`` (no public way in): each is replaced by a copy that derives from
    :class:`_PipelineThroughput` too (see :mod:`lightning_gpipe._subclass`).
    """
    if stages == 1:
        return
    for callback in _callbacks(trainer):
        if isinstance(callback, ThroughputMonitor):
            for stage, throughput in list(callback._throughputs.items()):
                counted: Any = copy_as(throughput, _PipelineThroughput)
                counted.world_size, counted.stages = pipelines, stages
                callback._throughputs[stage] = counted


def graph_loggers(trainer: "pl.Trainer") -> list[str]:
    """The names of the trainer's loggers that trace the model for its graph (``TensorBoardLogger(log_graph=True)``).

    Lightning calls ``log_graph(model)`` on rank 0 after ``on_fit_start``; TensorBoard's then runs the model
    (``torch.jit.trace``). The setting is kept only in the private ``_log_graph`` (a truthy requirement check where
    it is on). ``fast_dev_run``'s ``DummyLogger`` answers every attribute with a no-op method, which does not count:
    taken for the setting, it refused every such run that had a logger.
    """
    return [type(logger).__name__ for logger in trainer.loggers if _traces_graph(getattr(logger, "_log_graph", False))]


def _traces_graph(setting: Any) -> bool:
    return not callable(setting) and bool(setting)


def averaged_copies(trainer: "pl.Trainer") -> list[tuple[str, "pl.LightningModule"]]:
    """The LightningModule copies that Lightning's weight-averaging callbacks average into, with the callbacks' names.

    ``StochasticWeightAveraging`` and ``WeightAveraging`` (``EMAWeightAveraging``) deep-copy the module in their
    ``setup`` into the private ``_average_model`` (for ``WeightAveraging`` an ``AveragedModel`` whose ``module``
    is the copy), before the strategy's ``setup`` partitions the backbone; there is no public accessor.
    """
    found = []
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, (StochasticWeightAveraging, WeightAveraging)):
            average = getattr(callback, "_average_model", None)
            copy = average.module if isinstance(average, AveragedModel) else average
            if isinstance(copy, pl.LightningModule):
                found.append((type(callback).__name__, copy))
    return found


def tell_swa_about_batch_norm(trainer: "pl.Trainer", whole_model_has_batch_norm: bool) -> None:
    """Make ``StochasticWeightAveraging`` see BatchNorm layers on every stage, not only its own.

    In ``on_fit_start`` it asks ``pl_module_contains_batch_norm(pl_module)``, which walks this process's modules,
    and adds an epoch that recomputes the BatchNorm statistics when it finds one: stages without BatchNorm
    would skip the epoch the others run, and the pipeline would fall out of step. The instance's method is
    replaced by the whole model's answer (a public static method, consulted only there).
    """

    def pl_module_contains_batch_norm(pl_module: "pl.LightningModule") -> bool:
        return whole_model_has_batch_norm

    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, StochasticWeightAveraging):
            callback.pl_module_contains_batch_norm = pl_module_contains_batch_norm  # type: ignore[method-assign]


# -- BaseFinetuning's param groups --------------------------------------------------------------------------
#
# A BaseFinetuning callback (BackboneFinetuning) adds param groups while training and keeps, in its state
# ("internal_optimizer_metadata", per optimizer index), every group's hyperparameters and parameter names,
# which it puts back on a resumed run. Two things differ under the pipeline. Each stage's callback names
# only its own parameters, and the file holds the first stage's: the names are merged over the stages when a
# checkpoint is saved. And the callback puts the groups back in its ``on_fit_start`` when it has loaded its
# state (private ``_restarting``), but this strategy restores the callbacks after ``on_fit_start`` (it needs
# the partitioned model first): the strategy puts them back itself, before the optimizer's state is loaded,
# which is where one device has them.

_FINETUNING_STATE = "internal_optimizer_metadata"
_FLATTEN = "flatten_modules"


def walk_stages_in_finetuning() -> None:
    """Make BaseFinetuning walk a partitioned backbone through this stage's layers; idempotent.

    Its ``freeze``, ``make_trainable`` and ``filter_params`` find the layers with
    ``BaseFinetuning.flatten_modules``, which iterates a module that is iterable (an ``nn.Sequential``
    yields its layers) and takes ``modules()`` of one that is not. A ``GPipe`` refuses iteration (the other
    stages' layers are elsewhere), so for a ``GPipe`` it is given this stage's layers instead: the stage's
    share of what one device walks, so each stage freezes, unfreezes and adds to the optimizer its own part
    of the backbone. Replaced on the class (a public static method, always called through the class), where a
    subclass of the callback cannot change it; other modules are walked as before.
    """
    original = getattr(BaseFinetuning, _FLATTEN)
    if original.__module__ == __name__:  # already replaced by this function
        return

    def flatten_modules(modules: Any) -> list[nn.Module]:
        if isinstance(modules, GPipe):
            modules = [layer for _, layer in modules.local_layers()]
        return original(modules)

    setattr(BaseFinetuning, _FLATTEN, staticmethod(flatten_modules))


def finetuning_callbacks(trainer: "pl.Trainer") -> list[BaseFinetuning]:
    """The trainer's BaseFinetuning callbacks (BackboneFinetuning and the user's subclasses)."""
    return [c for c in _callbacks(trainer) if isinstance(c, BaseFinetuning)]


def finetuning_group_names(trainer: "pl.Trainer", states: dict[str, Any]) -> dict[str, dict[int, list[list[str]]]]:
    """For each BaseFinetuning callback's state in ``states`` (a checkpoint's ``"callbacks"``): the names of each
    param group it keeps, per optimizer index."""
    out: dict[str, dict[int, list[list[str]]]] = {}
    for callback in finetuning_callbacks(trainer):
        state = states.get(callback.state_key)
        if isinstance(state, dict) and isinstance(state.get(_FINETUNING_STATE), dict):
            out[callback.state_key] = {
                index: [list(group["params"]) for group in groups] for index, groups in state[_FINETUNING_STATE].items()
            }
    return out


def with_finetuning_group_names(states: dict[str, Any], names: dict[str, dict[int, list[list[str]]]]) -> dict[str, Any]:
    """``states`` with each BaseFinetuning group's parameter names replaced by ``names``' (new dicts: the callback's
    own state is left alone)."""
    out = dict(states)
    for key, per_optimizer in names.items():
        saved = out[key][_FINETUNING_STATE]
        out[key] = {
            **out[key],
            _FINETUNING_STATE: {
                index: [{**group, "params": list(new)} for group, new in zip(saved[index], per_optimizer[index])]
                for index in saved
            },
        }
    return out


def restore_finetuning_param_groups(
    trainer: "pl.Trainer", local_groups: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]
) -> None:
    """Do what a BaseFinetuning callback's ``on_fit_start`` does after it loaded its state from a checkpoint.

    Each optimizer's param groups become the ones the callback saved, with this stage's parameters:
    ``local_groups`` turns groups that name parameters into groups that hold them. Then the callback counts
    as restored, as after its own ``on_fit_start`` (private: ``_restarting``, ``_internal_optimizer_metadata``).
    """
    for callback in finetuning_callbacks(trainer):
        if not callback._restarting:
            continue
        saved = callback._internal_optimizer_metadata
        for index, optimizer in enumerate(trainer.optimizers):
            if index in saved:
                optimizer.param_groups = local_groups(saved[index])
        callback._restarting = False


def replace_sigterm_notifier(trainer: "pl.Trainer", notifier: Optional[Callable[[int, Any], None]]) -> None:
    """Make ``notifier`` what the Trainer's SIGTERM handler calls first (``None``: Lightning's own again).

    Private: ``_SignalConnector._sigterm_notifier_fn``, looked up when the Trainer registers its handlers (after the
    strategy's ``setup``); an instance attribute takes the method's place. Lightning has no public hook for what
    SIGTERM does, and its notifier broadcasts from inside the signal handler (see :mod:`lightning_gpipe.sigterm`).
    """
    connector = trainer._signal_connector
    if notifier is None:
        vars(connector).pop("_sigterm_notifier_fn", None)
    else:
        connector._sigterm_notifier_fn = notifier  # type: ignore[method-assign,assignment]


def replace_requeue_handler(trainer: "pl.Trainer", handler: Optional[Callable[[int, Any], None]]) -> None:
    """Make ``handler`` what the Trainer runs on SLURM's requeue signal (``None``: Lightning's own again).

    Private: ``_SignalConnector._slurm_sigusr_handler_fn``, looked up when the Trainer registers its handlers, as
    for :func:`replace_sigterm_notifier`. Lightning's handler saves a checkpoint from inside the signal handler (see
    :mod:`lightning_gpipe.requeue`), and ``SLURMEnvironment`` offers no other way to run it.
    """
    connector = trainer._signal_connector
    if handler is None:
        vars(connector).pop("_slurm_sigusr_handler_fn", None)
    else:
        connector._slurm_sigusr_handler_fn = handler  # type: ignore[method-assign,assignment]


def restore_at_signal_teardown(trainer: "pl.Trainer", signum: int, replaced: Any, handler: Any) -> None:
    """Where the Trainer's signal connector would put ``replaced`` back for ``signum`` at its teardown, put ``handler``.

    Private: ``_SignalConnector._original_handlers``, the handlers it found when it registered its own (after the
    strategy's ``setup``), restored at its teardown, which runs after the strategy's. A handler the strategy set in
    ``setup`` and took back in ``teardown`` would otherwise come back after the run (measured: the SIGINT note of
    :mod:`lightning_gpipe.interrupt` stayed the process's handler, and a later Ctrl-C stopped nothing).
    """
    originals = getattr(trainer._signal_connector, "_original_handlers", None)
    if isinstance(originals, dict) and originals.get(signum) == replaced:
        originals[signum] = handler


def hpc_save_path(trainer: "pl.Trainer") -> str:
    """The next ``hpc_ckpt_<n>.ckpt`` in the Trainer's root directory, as Lightning's requeue handler names it."""
    return trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)


def dump_model_state_with(trainer: "pl.Trainer", state_dict: Optional[Callable[[], dict[str, Any]]]) -> bool:
    """Make Lightning's checkpoint dump take the module's state from ``state_dict`` (``None``: as Lightning does).

    Lightning asks ``strategy.lightning_module_state_dict()`` for it, and so may a user, who wants the whole model,
    while a sharded checkpoint wants each stage's part. The dump's one call goes through the checkpoint connector's
    ``_get_lightning_module_state_dict`` (private), which is replaced on this trainer's connector. False where this
    Lightning has no such method: the dump then comes to ``lightning_module_state_dict`` as before.
    """
    connector = trainer._checkpoint_connector
    if not callable(getattr(type(connector), "_get_lightning_module_state_dict", None)):
        return False
    if state_dict is None:
        vars(connector).pop("_get_lightning_module_state_dict", None)
    else:
        vars(connector)["_get_lightning_module_state_dict"] = state_dict
    return True


def requeue_as_lightning_does(trainer: "pl.Trainer", signum: int, path: str) -> None:
    """Lightning's own requeue handler (finalize the loggers, save ``path``, ``scontrol requeue`` on rank 0), run
    outside a signal handler, with the checkpoint path given.

    Private: ``_SignalConnector._slurm_sigusr_handler_fn`` (the original, from the class) and the checkpoint
    connector's ``hpc_save_path``, which the handler calls to number the file. Each rank numbers it from the files it
    sees, so a rank that looks after rank 0 wrote would pick the next number; every rank takes rank 0's ``path``.
    """
    from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

    checkpoints = trainer._checkpoint_connector
    vars(checkpoints)["hpc_save_path"] = lambda folder: path
    try:
        _SignalConnector._slurm_sigusr_handler_fn(trainer._signal_connector, signum, None)  # type: ignore[arg-type]
    finally:
        vars(checkpoints).pop("hpc_save_path", None)


def mid_accumulation(trainer: "pl.Trainer") -> bool:
    """Whether the training batch that ran last left its gradients accumulated for a later optimizer step
    (``accumulate_grad_batches``): a checkpoint written now would lose them, and its resume would step without them.

    Private: ``_TrainingEpochLoop._should_accumulate``, Lightning's own test (the final batch of an epoch steps);
    the loop exposes no public one.
    """
    return trainer.state.fn == TrainerFn.FITTING and trainer.fit_loop.epoch_loop._should_accumulate()


class _AtomicWrites(CheckpointIO):
    """A run's innermost checkpoint IO, writing each local file through :func:`atomic_write`, in whichever thread
    writes it: the caller's, or ``AsyncCheckpointIO``'s writer thread, which writes after ``save_checkpoint``
    returned (a rename done by the caller would find no file yet). Remote paths (``s3://``...) are the plugin's
    own to make atomic."""

    def __init__(self, io: CheckpointIO) -> None:
        self.io = io

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        target = str(path)
        if "://" in target:
            self.io.save_checkpoint(checkpoint, target, storage_options=storage_options)
        else:
            atomic_write(lambda tmp: self.io.save_checkpoint(checkpoint, tmp, storage_options=storage_options), target)

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.io.load_checkpoint(*args, **kwargs)

    def remove_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        self.io.remove_checkpoint(*args, **kwargs)

    def teardown(self) -> None:
        self.io.teardown()


def atomic_checkpoint_io(io: CheckpointIO) -> CheckpointIO:
    """``io`` with the plugin at its bottom writing atomically (:class:`_AtomicWrites`).

    A wrapping plugin (Lightning's ``AsyncCheckpointIO``, a ``_WrappingCheckpointIO``) hands the write to the
    plugin it wraps, later and in its own thread; so that plugin is wrapped in place, once. Its setter refuses a
    plugin once one is configured, so the private ``_checkpoint_io`` is set: no public way replaces it.
    """
    if not isinstance(io, _WrappingCheckpointIO):
        return io if isinstance(io, _AtomicWrites) else _AtomicWrites(io)
    holder = io
    while isinstance(holder.checkpoint_io, _WrappingCheckpointIO):
        holder = holder.checkpoint_io
    inner = holder.checkpoint_io
    if inner is not None and not isinstance(inner, _AtomicWrites):
        holder._checkpoint_io = _AtomicWrites(inner)
    return io
