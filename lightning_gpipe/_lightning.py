"""Lightning-side helpers: the few private Lightning accesses, in one place, so that an upgrade breaks here only."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import CombinedLoader
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_gpipe.microbatch import batch_size
from lightning_gpipe.profiling import capture_input, sample_micro_batch

__all__ = [
    "MainProcessLauncher", "backbone_sample", "current_hook", "first_batch", "init_process_group", "launcher",
    "log_to_loggers", "optimizers_to_device", "preserved_rng", "should_update_logs", "silence_not_resumable_warning",
]


def current_hook(module: "pl.LightningModule") -> str:
    """The name of the hook Lightning is running on ``module`` (``training_step``, ``on_train_batch_end``...).

    Lightning keeps it in a private attribute, set around every strategy, module and callback hook it
    calls; there is no public accessor. Empty outside a hook.
    """
    return getattr(module, "_current_fx_name", None) or ""


OnFailure = Callable[[BaseException], Optional[BaseException]]


def _reporting(function: Callable, on_failure: OnFailure) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except BaseException as error:
            replacement = on_failure(error)
            if replacement is not None:
                raise replacement from error
            raise

    return run


class MainProcessLauncher(_MultiProcessingLauncher):
    """Lightning's spawn/fork launcher, but a sharded run leaves no untrained layers in the main process.

    Lightning hands rank 0's ``state_dict`` back to the main process and loads it with ``strict=False``
    (a private method, overridden here only). After a sharded run rank 0 holds the other stages'
    layers on ``meta`` (nothing is gathered), and copying from ``meta`` fails. Skipping those entries
    would leave the main process silently holding the untrained initial weights of the other stages;
    so those tensors become ``meta`` in the main process too, where any use fails loudly, and a
    warning says how to get the whole model.
    """

    def _recover_results_in_main_process(self, worker_output: Any, trainer: "pl.Trainer") -> None:
        path = worker_output.weights_path
        if path is None or getattr(self._strategy, "state_dict_type", "full") != "sharded":
            return super()._recover_results_in_main_process(worker_output, trainer)
        weights = self._strategy.checkpoint_io.load_checkpoint(path)
        module = trainer.lightning_module
        meta = [k for k, v in weights.items() if isinstance(v, torch.Tensor) and v.is_meta]
        for key in meta:
            owner_name, _, name = key.rpartition(".")
            owner = module.get_submodule(owner_name)
            if name in owner._parameters:
                owner._parameters[name] = nn.Parameter(owner._parameters[name].to("meta"),
                                                       requires_grad=owner._parameters[name].requires_grad)
            elif name in owner._buffers:
                owner._buffers[name] = owner._buffers[name].to("meta")
        module.load_state_dict({k: v for k, v in weights.items() if k not in set(meta)}, strict=False)
        self._strategy.checkpoint_io.remove_checkpoint(path)
        if meta:
            rank_zero_warn(
                f"state_dict_type='sharded': the model in the main process holds only the first stage's trained "
                f"layers; {len(meta)} tensors of the other stages are on the meta device. Load the whole model from "
                "the sharded checkpoint with `lightning_gpipe.checkpoint.consolidate(path)`.", category=UserWarning)
        super()._recover_results_in_main_process(worker_output._replace(weights_path=None), trainer)


class _ReportingSubprocessLauncher(_SubprocessScriptLauncher):
    on_failure: OnFailure

    def launch(self, function: Callable, *args: Any, trainer: Optional["pl.Trainer"] = None, **kwargs: Any) -> Any:
        return super().launch(_reporting(function, self.on_failure), *args, trainer=trainer, **kwargs)


class _ReportingMultiProcessingLauncher(MainProcessLauncher):
    on_failure: OnFailure

    def _wrapping_function(self, process_idx: int, trainer: Optional["pl.Trainer"], function: Callable, *args: Any,
                           **kwargs: Any) -> None:
        super()._wrapping_function(process_idx, trainer, _reporting(function, self.on_failure), *args, **kwargs)


def launcher(strategy: Any, start_method: str, on_failure: OnFailure) -> _Launcher:
    """Lightning's launcher for ``start_method``, reporting an exception of the trainer function first.

    Lightning catches an exception of ``fit`` (or ``validate``...) above the launcher and then calls
    every callback's ``on_exception`` before the strategy's: a callback such as
    ``OnExceptionCheckpoint`` would start a collective that the other stages, still waiting for
    the failed one, never join. Reported here, inside the launcher (inside each spawned process for
    spawn and fork), the failure reaches the other ranks before any callback runs. Lightning has no
    hook at that point, so these subclass its launchers (private classes). ``on_failure`` may return
    another exception to raise instead (from the original).
    """
    chosen: Any
    if start_method == "popen":
        chosen = _ReportingSubprocessLauncher(strategy.cluster_environment, strategy.num_processes, strategy.num_nodes)
    else:
        chosen = _ReportingMultiProcessingLauncher(strategy, start_method=start_method)
    chosen.on_failure = on_failure
    return chosen


def init_process_group(environment: ClusterEnvironment, backend: str, device: torch.device,
                       timeout: timedelta) -> None:
    """Initialize the default process group the way Lightning's DDP does (a no-op when it exists)."""
    kwargs = {"timeout": timeout}
    if device.type == "cuda":
        kwargs["device_id"] = device  # type: ignore[assignment]
    _init_dist_connection(environment, backend, **kwargs)


optimizers_to_device = _optimizers_to_device


def silence_not_resumable_warning() -> None:
    """Drop Lightning's warning that a plain DataLoader cannot resume mid-epoch: the strategy resumes it.

    Lightning warns when the loader lacks its stateful-loader protocol, which this package does not use
    (see ``resumable.py``), so the warning is matched by its text.
    """
    from lightning.fabric.utilities.warnings import PossibleUserWarning

    warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended",
                            category=PossibleUserWarning)


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
@contextmanager
def preserved_rng() -> Iterator[None]:
    """Put the torch CPU, numpy and Python random states back as they were after the block.

    Not CUDA's: collecting it would create a context on every GPU of the node; the profiler keeps
    its own device's generator isolated itself.
    """
    states = _collect_rng_states(include_cuda=False)
    try:
        yield
    finally:
        _set_rng_states(states)


def first_batch(trainer: "pl.Trainer") -> Optional[tuple[Any, str, str]]:
    """The first batch of the running stage's dataloader, the step that takes it, and the loader's name.

    Lightning attaches the dataloaders (from ``fit(model, loader)``, a datamodule or the module's
    hooks) to its loops before ``Strategy.setup`` but requests them only later, and it has no
    public accessor for them: the loops' ``_data_source`` is the one way (Lightning's own
    DeepSpeedStrategy reads it in its setup too). ``None`` if there is no dataloader or it is empty.
    """
    loops = {
        TrainerFn.FITTING: (trainer.fit_loop, "training_step", "train"),
        TrainerFn.VALIDATING: (trainer.validate_loop, "validation_step", "val"),
        TrainerFn.TESTING: (trainer.test_loop, "test_step", "test"),
        TrainerFn.PREDICTING: (trainer.predict_loop, "predict_step", "predict"),
    }
    if trainer.state.fn not in loops:
        return None
    loop, step, name = loops[trainer.state.fn]
    source = loop._data_source
    if not source.is_defined():
        return None
    loaders = source.dataloader()
    if loaders is None:
        return None
    mode = "max_size_cycle" if trainer.state.fn == TrainerFn.FITTING else "sequential"
    combined = loaders if isinstance(loaders, CombinedLoader) else CombinedLoader(loaders, mode)
    try:
        batch, _, _ = next(iter(combined))
    except StopIteration:
        return None
    return batch, step, f"{name} dataloader"


def backbone_sample(module: "pl.LightningModule", backbone: nn.Module, name: str, chunks: int) -> tuple[Any, str]:
    """One micro-batch of what ``module`` feeds its ``backbone`` (the attribute ``name``), and where it came from.

    First choice: the first batch of the running stage's dataloader, run through the batch-transfer
    hooks and the stage's step (``training_step`` when fitting) until the step calls the backbone.
    Second: ``example_input_array``, run through ``forward``. Nothing after the backbone's input
    runs; see :func:`lightning_gpipe.profiling.capture_input`. Raises ``ValueError`` if neither works.
    """
    tried = []
    found = first_batch(module.trainer)
    if found is None:
        tried.append("the running stage has no dataloader, or it is empty")
    else:
        batch, step, loader = found
        batch = module.on_after_batch_transfer(module.on_before_batch_transfer(batch, 0), 0)
        try:
            x = capture_input(backbone, lambda: getattr(module, step)(batch, 0), owner=module)
            return _described(sample_micro_batch(x, chunks), f"the first batch of the {loader}")
        except Exception as error:
            tried.append(f"`{step}` on the first batch of the {loader} did not call `self.{name}` "
                         f"({type(error).__name__}: {error})")
    example = module.example_input_array
    if example is None:
        tried.append(f"`{type(module).__name__}.example_input_array` is not set")
    else:
        def forward() -> Any:  # the way Lightning's ModelSummary feeds it
            if isinstance(example, (list, tuple)):
                return module(*example)
            return module(**example) if isinstance(example, dict) else module(example)

        try:
            x = capture_input(backbone, forward, owner=module)
            return _described(sample_micro_batch(x, chunks), "`example_input_array`")
        except Exception as error:
            tried.append(f"`forward(example_input_array)` did not call `self.{name}` ({type(error).__name__}: {error})")
    raise ValueError(
        "Profiling the backbone (balance='time' or 'memory') needs a sample micro-batch, but none could be taken: "
        + "; ".join(tried) + ". Set `self.example_input_array` to an input of `forward` that calls the backbone, "
        "or use balance='params' or an explicit list."
    )


def _described(sample: Any, origin: str) -> tuple[Any, str]:
    return sample, f"a micro-batch of {batch_size(sample)} samples from {origin}"
