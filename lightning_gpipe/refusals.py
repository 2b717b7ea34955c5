"""What the pipeline refuses before the first step, and why: one function per feature, each raising the error
that names the feature, the reason and what to use instead.

Every rank runs these checks on the same information (the Trainer's settings and callbacks, the
optimizers, the split), so every rank refuses alike, before any batch. Each refusal is a row of
``docs/compatibility.md``; the features that work are there too.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from lightning.pytorch.callbacks import BatchSizeFinder, ModelPruning
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer
from torch.utils.data import DataLoader, DistributedSampler

from lightning_gpipe.engine.optimizers import needs_whole_gradient
from lightning_gpipe.engine.partition import parameter_costs, stage_bounds
from lightning_gpipe.engine.pipe import GPipe
from lightning_gpipe.engine.topology import PipeLayout

__all__ = [
    "callbacks",
    "missing_backbone",
    "graph_logging",
    "stage_sharded_sampler",
    "sync_batchnorm",
    "sharded_optimizer_state",
    "optimizer_built_on_meta",
    "empty_everywhere",
    "timed_validation",
    "unsupported_finetuning",
    "whole_gradient_optimizers",
]


def missing_backbone(module: nn.Module, backbone: str) -> ValueError:
    """The error for a module without the attribute ``backbone``: it names the fix, and the nn.Sequentials the
    module does hold (see :func:`_sequentials`)."""
    found = _sequentials(module)
    sizes = [(path, len(seq), sum(p.numel() for p in seq.parameters())) for path, seq in found[:5]]
    listed = ", ".join(f"`{path}` ({layers} layers, {params:,} parameters)" for path, layers, params in sizes)
    hint = (
        f" {type(module).__name__} holds these nn.Sequential attributes: {listed}; name the one to pipeline, as in "
        f'GPipeStrategy(backbone="{found[0][0]}").'
        if found
        else ""
    )
    return ValueError(
        f"{type(module).__name__} has no attribute `{backbone}`; the gpipe strategy pipelines the nn.Sequential "
        f"found there. Assign your layers to `self.{backbone} = nn.Sequential(...)`, or name the attribute with "
        f"GPipeStrategy(backbone=...).{hint}"
    )


def not_sequential(where: str, backbone: str, found: object) -> TypeError:
    """The error for a ``backbone`` that is no nn.Sequential (a torchvision ``ResNet``, a residual block): it names
    the nn.Sequentials inside it, as dotted paths to pass, the largest first."""
    kind = type(found).__name__
    article = "an" if kind[:1].lower() in "aeiou" else "a"
    inside = _sequentials(found) if isinstance(found, nn.Module) else []
    listed = ", ".join(f"`{backbone}.{path}` ({len(seq)} layer{'s' * (len(seq) != 1)})" for path, seq in inside[:5])
    hint = f" It holds these nn.Sequentials, any of which can be named: {listed}." if inside else ""
    return TypeError(
        f"{where} is {article} {kind}, but the gpipe strategy splits an nn.Sequential into stages. Make the backbone "
        f"an nn.Sequential of its layers, or name one inside it with GPipeStrategy(backbone=...).{hint}"
    )


def _sequentials(module: nn.Module) -> list[tuple[str, nn.Sequential]]:
    """The outermost nn.Sequential submodules of ``module`` (none inside another), by dotted path, those with the
    most parameters first: what a missing backbone's error offers as the ``backbone=`` to name. The strategy never
    picks one itself, since a wrong guess (a classifier head beside the features) would pipeline the wrong part."""
    found: list[tuple[str, nn.Sequential]] = []
    for path, sub in module.named_modules():
        if path and isinstance(sub, nn.Sequential) and not any(path.startswith(p + ".") for p, _ in found):
            found.append((path, sub))
    return sorted(found, key=lambda item: -sum(p.numel() for p in item[1].parameters()))


def sync_batchnorm(layer_sync: Any, module: nn.Module, processes: int) -> None:
    """``Trainer(sync_batchnorm=True)`` (a ``LayerSync`` plugin), which Lightning's own strategies apply in setup."""
    # SyncBatchNorm reduces its statistics over every process of the job: a pipeline's processes hold different
    # layers, so a stage's BatchNorm would wait for stages that never run it. Ignoring the setting instead would
    # leave the user's replicas unsynchronized without a word.
    norms = [name for name, m in module.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if layer_sync is None or processes == 1 or not norms:
        return
    raise ValueError(
        f"Trainer(sync_batchnorm=True) is not supported by the gpipe strategy (BatchNorm in `{norms[0]}`"
        f"{f' and {len(norms) - 1} more' if len(norms) > 1 else ''}): SyncBatchNorm reduces its statistics over "
        "every process of the job, and the "
        "processes of a pipeline hold different layers, so a stage's BatchNorm would wait for stages that never "
        "run it. Leave sync_batchnorm unset. For running statistics over the whole batch, not each micro-batch, use "
        "GPipeStrategy(deferred_batch_norm=True) (training still normalizes each micro-batch); to normalize over "
        "the whole batch too, use chunks=1."
    )


def graph_logging(loggers: list[str], processes: int) -> None:
    """A logger that traces the model for its graph, on rank 0 alone."""
    # Lightning has rank 0 run the model once more through the logger's trace: the backbone call would reach
    # stage 0's layers alone, and the other stages, which never make that call, would fall out of step.
    if loggers and processes > 1:
        raise ValueError(
            f"{loggers[0]}(log_graph=True) is not supported by the gpipe strategy over {processes} processes: "
            "Lightning traces the model for the graph on rank 0 alone, where only the first stage's layers "
            "run, and the other stages never make that call. Set log_graph=False, or log the graph of the "
            "model on one device (devices=1)."
        )


def timed_validation(seconds: Optional[float]) -> None:
    """Validation every so many seconds of each rank's own clock."""
    # Lightning decides on each rank, from that rank's clock, after which batch to validate: the stages
    # would validate after different batches, and a validation pass runs on every stage at once.
    if seconds is not None:
        raise ValueError(
            f"val_check_interval given as a time ({seconds:g}s) is not supported by the gpipe strategy: Lightning "
            "decides on each rank by that rank's own clock after which batch to validate, and the stages of a "
            "pipeline must validate after the same batch. Give val_check_interval as a number of training batches "
            "(an int) or a fraction of the epoch (a float) instead."
        )


def callbacks(callbacks: list[Any], averaging: list[str], state_dict_type: str, processes: int) -> None:
    """Refuse, on every rank before anything runs, the callbacks that would see one stage as the whole model, or
    that each rank would run its own way."""
    for callback in callbacks:
        if isinstance(callback, BatchSizeFinder) and processes > 1:
            # Lightning refuses it for its distributed strategies; a pipeline of one replica does not count as
            # one (so that no DistributedSampler shards the stages' batches), so it must be refused here.
            raise ValueError(
                "The batch size finder (`BatchSizeFinder`, which `Tuner.scale_batch_size` runs) is not supported by "
                f"the gpipe strategy over {processes} processes: each rank would try batch sizes against its own "
                "out-of-memory errors (each stage holds different layers, so they fail at different sizes) and "
                "restore its own temporary checkpoint, so the stages would train with different batch sizes. Find "
                "the batch size on one device (devices=1) and set it, or let GPipeStrategy(chunks='auto', "
                "max_memory=...) fit the micro-batches to memory."
            )
        if isinstance(callback, ModelPruning):
            raise ValueError(
                "ModelPruning is not supported by the gpipe strategy: it picks the layers to prune in its "
                "`setup`, before the strategy splits the backbone (each process then holds one stage's "
                "layers, the others on the meta device), ranks the weights of one stage only when "
                "`use_global_unstructured=True`, and rewrites the checkpoint's state_dict from this process's "
                "layers alone. Prune after `fit` instead: the whole trained backbone is back in the "
                "LightningModule on every rank (use torch.nn.utils.prune on it), or train with ModelPruning on "
                "one device or with DDP."
            )
    if state_dict_type == "sharded":
        for name in averaging:
            raise ValueError(
                f"{name} is not supported with GPipeStrategy(state_dict_type='sharded'): the callback keeps "
                "the averaged model's tensors in the checkpoint's callback state (EMAWeightAveraging also the "
                "current weights beside the averaged ones), which a sharded checkpoint does not split by "
                "stage, and after the run the averaged model would stay split over the processes. Use "
                "state_dict_type='full' (the default) with weight averaging."
            )


def whole_gradient_optimizers(optimizers: list[Optimizer], stages: int) -> None:
    """An optimizer whose step is computed from the whole gradient (LBFGS): with several stages, each would step
    from its own part only (see :func:`~lightning_gpipe.engine.optimizers.needs_whole_gradient`)."""
    if stages == 1:
        return
    for optimizer in optimizers:
        if not needs_whole_gradient(optimizer):
            continue
        cls = type(optimizer)
        base = next(c for c in cls.__mro__ if c.__module__.startswith("torch.optim"))
        name = f"torch.optim.{base.__name__}"
        if cls is not base:
            name = f"{cls.__module__}.{cls.__qualname__} (a {name})"
        raise ValueError(
            f"{name} is not supported by the gpipe strategy with {stages} stages: its step is "
            "computed from the whole gradient (its line search, step size, stopping tests and curvature pairs take "
            "dot products and norms over every parameter), but each stage of the pipeline holds only its own part "
            "of the gradient, so the stages would step differently, and could evaluate the closure a different "
            "number of times and wait on each other forever. Use a first-order optimizer (SGD, Adam, AdamW, ...), "
            "whose step is computed per parameter, or train without pipeline stages (devices=1, or pipe_size=1)."
        )


def sharded_optimizer_state(optimizers: list[Optimizer], stages: int) -> None:
    """torch's ``ZeroRedundancyOptimizer``, which shards the optimizer state over the processes of its group."""
    # Its group is every process of the job by default, and it broadcasts each shard's updated parameters from
    # the process that owns it: in a pipeline those processes hold different layers, so the broadcasts would
    # pair tensors of different layers (or shapes) or wait forever.
    if stages == 1:
        return
    for optimizer in optimizers:
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            raise ValueError(_ZERO.format(stages=stages))


def optimizer_built_on_meta(error: BaseException, stages: int) -> None:
    """Raise a clearer error where ``configure_optimizers`` failed on another stage's ``meta`` parameters."""
    # While it runs, the layers other stages hold read as their meta copies (so that groups chosen by position
    # come out alike on every stage), and torch.optim.Optimizer.__init__ drops them: an optimizer that examines
    # its parameters before that call trips over them with an error that names only the meta device.
    text = str(error)
    if stages == 1 or not re.search(r"\bmeta\b", text):  # the device ("torch.meta.FloatTensor"), not "metadata"
        return
    if "ZeroRedundancyOptimizer" in text:
        raise ValueError(_ZERO.format(stages=stages)) from error
    raise RuntimeError(
        f"configure_optimizers failed under the gpipe strategy with {stages} stages: {type(error).__name__}: {text} "
        "While it runs, the backbone's layers that other stages hold are on the meta device (so that param groups "
        "chosen by position come out alike on every stage), and torch.optim.Optimizer.__init__ drops them; this "
        "optimizer examined its parameters before that. Build it from this stage's parameters only "
        "(`filter(lambda p: not p.is_meta, self.parameters())`), or use a torch.optim optimizer."
    ) from error


_ZERO = (
    "torch.distributed.optim.ZeroRedundancyOptimizer is not supported by the gpipe strategy with {stages} stages: it "
    "shards the optimizer state over the processes of its group (every process of the job by default) and "
    "broadcasts each shard's parameters from the process that owns it, but the processes of a pipeline hold "
    "different layers. Each stage's optimizer already holds only its own stage's state; use the optimizer it "
    "wraps (optimizer_class) directly."
)


def unsupported_finetuning(callback: str, layout: PipeLayout, pipe: Optional[GPipe], backbone: str) -> None:
    """The two cases where a BaseFinetuning callback (BackboneFinetuning) would not train as on one device.

    With data-parallel replicas: each stage averages over its replicas the gradients of the parameters that
    required grad when the pipeline was built (``GradientSync``), and the callback unfreezes the backbone
    later, so the replicas would train it apart (measured: their backbones 2e-2 apart after 3 epochs).
    With a stage that holds no parameters: the callback adds a param group only where the modules it
    unfreezes have some, so that stage's optimizer would miss the group, and ``param_groups[-1]`` (which
    BackboneFinetuning sets the backbone's learning rate on) would be the head's group there.
    """
    if layout.num_replicas > 1:
        raise ValueError(
            f"The {callback} callback is not supported with data-parallel replicas ({layout.num_replicas} "
            f"pipelines of {layout.pipe_size} stage{'s' * (layout.pipe_size > 1)}): the replicas average the "
            "gradients of the parameters that require grad when the pipeline is built, so the layers that the "
            "callback unfreezes later would be trained apart on each replica. Use one pipeline (pipe_size equal "
            "to the number of devices), or unfreeze the layers before `fit`."
        )
    if pipe is None or layout.pipe_size == 1:
        return
    costs = parameter_costs(pipe.full_sequential())
    for stage, (start, stop) in enumerate(stage_bounds(pipe.balance)):
        if not any(costs[start:stop]):
            raise ValueError(
                f"The {callback} callback is not supported with balance={list(pipe.balance)}: stage {stage} "
                f"(layers {start} to {stop - 1} of `{backbone}`) holds no parameters, so when the callback "
                "unfreezes the backbone it adds a param group on the other stages only, and the stages' optimizers "
                "would differ. Choose a `balance` that gives every stage a layer with parameters."
            )


def empty_everywhere(optimizers: list[Optimizer], layouts: list[Any], emptied: Any) -> None:
    """An optimizer given no parameters on any stage fails as on one device (the ``layouts``, per optimizer its
    groups over the whole model, are gathered from every stage, so every rank decides alike)."""
    for optimizer, groups in zip(optimizers, layouts):
        if optimizer in emptied and not any(groups):
            raise ValueError(
                f"optimizer got an empty parameter list: configure_optimizers built "
                f"{type(optimizer).__name__} from no parameters, on every stage of the pipeline (one "
                "device raises this too). Give it parameters that require grad."
            )


def stage_sharded_sampler(loader: object, replicas: dict[str, Any], processes: int) -> None:
    """A ``DistributedSampler`` built by user code that shards over the job's processes rather than the replicas."""
    # Lightning leaves a DistributedSampler it finds in a DataLoader alone. One made with the defaults (a DDP
    # script's `DistributedSampler(dataset)`) reads its rank and size from the process group, which counts every
    # stage: each stage would get other samples. The batch check stops the first step that meets them, with a list of
    # usual causes; this names the sampler itself, for every loader, before its first batch.
    if not isinstance(loader, DataLoader):
        return
    sampler = loader.sampler
    if not isinstance(sampler, DistributedSampler) and loader.batch_sampler is not None:
        sampler = getattr(loader.batch_sampler, "sampler", sampler)
    if not isinstance(sampler, DistributedSampler):
        return
    wanted = (replicas["num_replicas"], replicas["rank"])
    if (sampler.num_replicas, sampler.rank) != wanted:
        raise ValueError(
            f"A DataLoader's sampler is a DistributedSampler over num_replicas={sampler.num_replicas}, "
            f"rank={sampler.rank}, but under the gpipe strategy the {processes} processes are stages of pipelines, "
            f"and only the data-parallel replicas may get different samples (here num_replicas={wanted[0]}, "
            f"rank={wanted[1]}): the stages of one pipeline must read the same batches. Leave the sampler to "
            "Lightning (a plain or shuffled DataLoader; Lightning adds the sampler by replica), or build it with "
            "`DistributedSampler(dataset, **trainer.strategy.distributed_sampler_kwargs)`."
        )
