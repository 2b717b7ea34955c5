"""What a ``state_dict_type="sharded"`` run leaves in each process, and how a later run goes on from it.

After a sharded run nothing is gathered: each process keeps its own stage's trained layers and the other
stages' layers stay on ``meta``. ``trainer.fit(model)`` followed by ``trainer.test(model)`` (or
``validate``, ``predict``, a second ``fit``) is the usual Lightning script, and it can go on from there
when the next run puts the same layers on the same processes: each stage then holds what it trained. A
split chosen anew (profiling, the planner, a split by parameter count) would need the other stages'
values, which are nowhere in this process, so the next run takes the split the sharded run used. Where it
cannot (another number of stages, another split asked for, a process that did not run that stage), it is
refused before anything runs, naming why, instead of torch's "Cannot copy out of meta tensor" from deep
inside the profile.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from torch import nn

__all__ = ["Leftover", "continue_from", "leave", "leave_in_main_process", "meta_layers"]

_ATTRIBUTE = "_lightning_gpipe_sharded_leftover"

WHOLE = "load the whole model from the sharded checkpoint with `lightning_gpipe.checkpointing.consolidate(path)`"


@dataclass(frozen=True)
class Leftover:
    """The split (and the micro-batching) of the sharded run whose stages the processes hold."""

    balance: tuple[int, ...]
    chunks: int
    checkpoint: str
    #: The copy in the main process of a spawn or fork launch, which holds the first stage only.
    main_process: bool = False


def leave(sequential: nn.Sequential, balance: Sequence[int], chunks: int, checkpoint: str) -> None:
    """Mark ``sequential``, which holds one stage of ``balance`` and ``meta`` elsewhere, as a sharded run left it."""
    setattr(sequential, _ATTRIBUTE, Leftover(tuple(balance), int(chunks), str(checkpoint)))


def leave_in_main_process(sequential: nn.Sequential) -> None:
    """Mark the main process's copy after a sharded spawn or fork launch (rank 0's stage, ``meta`` elsewhere)."""
    setattr(sequential, _ATTRIBUTE, Leftover((), 0, "", main_process=True))


def meta_layers(sequential: nn.Sequential) -> list[int]:
    """The layers of ``sequential`` with a parameter or buffer on ``meta`` (no values)."""
    return [
        index
        for index, layer in enumerate(sequential)
        if any(t.is_meta for t in itertools.chain(layer.parameters(), layer.buffers()))
    ]


def _ranges(layers: Sequence[int]) -> str:
    return ", ".join(str(i) for i in layers) if len(layers) <= 6 else f"{layers[0]}-{layers[-1]} ({len(layers)} layers)"


def continue_from(
    sequential: nn.Sequential,
    name: str,
    stages: int,
    stage: int,
    balance: Union[None, str, Sequence[int]],
) -> Optional[Leftover]:
    """``None`` where every layer of ``sequential`` has values; else the sharded run to go on from, or an error.

    ``stages`` is the new run's number of stages per pipeline, ``stage`` this process's, and ``balance`` the
    split asked for (a list, or a way to choose one). Raises ``ValueError`` alike on every process where the
    settings rule the leftover out, and on the processes that lack their stage's values otherwise.
    """
    meta = meta_layers(sequential)
    if not meta:
        return None
    left: Optional[Leftover] = getattr(sequential, _ATTRIBUTE, None)
    if left is None:
        raise ValueError(
            f"Layers {_ranges(meta)} of `{name}` hold tensors on the meta device, which have shapes but no values, so "
            "the pipeline can neither measure nor run them. Give the backbone its weights before the run: build it "
            "on a real device, or materialize it (`to_empty(device=...)`, then initialize or "
            "`load_state_dict(state, assign=True)`)."
        )
    if left.main_process:
        raise ValueError(
            f"`{name}` is the main process's copy after a run with state_dict_type='sharded' under "
            "GPipeStrategy(start_method='spawn' or 'fork'): it holds the first stage's trained layers only, the "
            f"others (layers {_ranges(meta)}) on the meta device, and a later run's workers get this copy. Use the "
            f"default start_method='popen', which keeps each stage in its own process for the next run, or {WHOLE}."
        )
    split = list(left.balance)
    ran = f"a run with state_dict_type='sharded' over {len(split)} stages (balance={split})"
    given = None if balance is None or isinstance(balance, str) else list(balance)  # a split, not a way to choose
    if stages != len(split) or (given is not None and given != split):
        asked = f"{stages} stages" + ("" if given is None else f" with balance={given}")
        raise ValueError(
            f"`{name}` holds what {ran} left in each process: its own stage's trained layers, the other stages' "
            f"layers on the meta device (layers {_ranges(meta)} here). This run asks for {asked}, so some stage "
            f"would need layers this process never trained. Run with {len(split)} stages per pipeline and that "
            f"balance (each process goes on with its own stage), or {WHOLE}."
        )
    start = sum(split[:stage])
    own = range(start, start + split[stage])
    missing = [i for i in meta if i in own]
    if missing:
        raise ValueError(
            f"`{name}` holds what {ran} left, but this process has no values for layers {_ranges(missing)} of its "
            f"stage {stage}: another process ran it. Run with the same devices and nodes, so that each process "
            f"goes on with the stage it trained, or {WHOLE}."
        )
    return left
