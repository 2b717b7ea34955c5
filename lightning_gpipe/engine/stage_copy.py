"""``StageCopy``: a copy of a pipelined Sequential cut like the pipe, so that weight averaging pairs layer by layer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, NoReturn, Optional

from torch import Tensor, nn

from lightning_gpipe.engine.partition import layer_names, stage_bounds, validate_balance
from lightning_gpipe.engine.tied import Tie, keep_stage

__all__ = ["Gather", "StageCopy", "retie"]

#: ``gather(obj, to_all)``: ``obj`` from every stage in stage order (everywhere if ``to_all``, else on the first
#: stage and ``None`` on the others), as :meth:`lightning_gpipe.GPipe.gather` does; collective.
Gather = Callable[[Any, bool], Optional[list[Any]]]


class StageCopy(nn.Module):
    """This stage's layers of a *copy* of the Sequential a :class:`~lightning_gpipe.GPipe` runs; the rest on ``meta``.

    Weight averaging (``torch.optim.swa_utils.AveragedModel``, Lightning's ``StochasticWeightAveraging`` and
    ``EMAWeightAveraging``) keeps a deep copy of the model and pairs the copy's parameters and buffers with the
    live model's one by one (``zip(copy.parameters(), model.parameters())``). Where the live Sequential is a
    ``GPipe``, that lists this stage's layers only. A ``StageCopy`` in the copy's place holds the same layers
    under the same indices, in the same order, with the same tied copies (see :mod:`lightning_gpipe.engine.tied`),
    so the two pair up exactly and each stage averages its own layers (averaging is elementwise).

    - ``state_dict()`` is collective over the pipeline: the first stage gets every stage's entries, in layer order,
      under the whole Sequential's keys (what a checkpoint of the average needs); the other stages their own.
    - ``load_state_dict`` takes the whole Sequential's state: each stage loads its own layers' entries, and every
      stage reports the same missing keys.
    - It cannot run: only the live ``GPipe`` runs the backbone. :meth:`full_sequential` is the copy, whole once
      ``lightning_gpipe.checkpointing.model_state.reassemble_copy`` has filled it in.

    Example (on each stage, after ``pipe = GPipe(sequential, balance)`` from ``sequential``'s twin ``twin``)::

        average = StageCopy(twin, pipe.balance, pipe.stage, pipe.gather)
        for a, p in zip(average.parameters(), pipe.parameters()):   # the same layers, in the same order
            a.detach().lerp_(p.detach(), 0.1)

    Args:
        module: the whole copy, taken before the pipe was built from its twin (its parameters are not the pipe's).
        balance: the pipe's layers per stage.
        stage: this process's stage.
        gather: how to collect an object from every stage (the pipe's :meth:`~lightning_gpipe.GPipe.gather`).
    """

    def __init__(self, module: nn.Sequential, balance: Sequence[int], stage: int, gather: Gather) -> None:
        super().__init__()
        if not isinstance(module, nn.Sequential):
            raise TypeError(f"StageCopy cuts an nn.Sequential, got {type(module).__name__}.")
        self.balance = validate_balance(balance, len(module), len(balance))
        self.stage, self.gather = stage, gather
        start, stop = stage_bounds(self.balance)[stage]
        # cut as the pipe is; the layers stay on their device: the averaging code places the copy
        self.ties: list[Tie] = keep_stage(self, module, self.balance, stage)
        self._full = [module]  # in a list, so that it is not a submodule: only this stage's layers are registered
        names = layer_names(module)
        self._layer_index = {name: index for index, name in enumerate(names)}
        own = set(names[start:stop])
        #: the other stages' state_dict entries, relative to this module ("3.weight"): a whole state must hold them
        self.elsewhere = [k for k in module.state_dict(keep_vars=True) if k.split(".", 1)[0] not in own]
        self.register_state_dict_post_hook(_gather_stages)

    def local_layers(self) -> list[tuple[int, nn.Module]]:
        """This stage's ``(index, layer)`` pairs."""
        return [(self._layer_index[name], layer) for name, layer in self._modules.items() if layer is not None]

    def full_sequential(self) -> nn.Sequential:
        """The copy this was cut from (other stages' layers are on ``meta`` until reassembled)."""
        return self._full[0]

    def forward(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(
            f"This is stage {self.stage}'s part of a copy of the pipelined backbone (a weight average's): it holds "
            f"layers {[i for i, _ in self.local_layers()]} only and cannot run. The LightningModule's backbone runs "
            "the pipeline (swap the averaged weights into it, as the weight-averaging callbacks do: to evaluate an "
            "average during a fit, use Lightning's EMAWeightAveraging or StochasticWeightAveraging callback); after "
            "`fit` the copy is a whole nn.Sequential again."
        )

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
        # `state_dict` is the loader's own copy of this module's entries: the other stages' entries are taken out
        # (their layers load on their stages), and those it lacks are missing on every stage alike.
        for key in self.elsewhere:
            if state_dict.pop(prefix + key, None) is None and strict:
                missing_keys.append(prefix + key)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def extra_repr(self) -> str:
        return f"stage={self.stage} of {len(self.balance)}, balance={self.balance}"


def _gather_stages(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """``state_dict`` post-hook of :class:`StageCopy`: the first stage's entries become every stage's (collective).

    The copy's own entries are the last ones in ``state_dict`` when its hook runs (its children have just
    written them), so taking them out and putting every stage's in keeps a one-device key order.
    """
    assert isinstance(module, StageCopy)
    own = {k[len(prefix) :]: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(prefix)]}
    parts = module.gather({k: _detached_cpu(v) for k, v in own.items()}, False)
    for part in parts if parts is not None else [own]:
        for key, value in part.items():
            state_dict[prefix + key] = value


def _detached_cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, Tensor) else value


def retie(module: nn.Sequential, ties: list[Tie], stage: int) -> None:
    """Make every tie one Parameter again in a reassembled ``module``: this stage's copy where it holds one (the
    one that was averaged here), else the parameter at the tie's first spot."""
    for tie in ties:
        shared = module.get_parameter(tie.spot_on(stage) if stage in tie.spot_stages else tie.name)
        for spot in tie.spots:
            path, _, attr = spot.rpartition(".")
            setattr(module.get_submodule(path), attr, shared)
