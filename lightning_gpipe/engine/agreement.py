"""What the stages of a pipeline must hold alike before a step besides the batch: their optimizers' settings
(compared, see below) and their random states (made one by the strategy); and the digest both are compared by.

Each stage steps its own layers with its own copy of the user's optimizers, which one device holds once.
So every stage must step with the same settings: the same learning rate, momentum, betas and weight decay
in each param group, at the same global step. Nothing in the pipeline's messages would show it if they
did not. A scheduler or callback that changes them from a value that differs per stage does that:
``ReduceLROnPlateau`` monitoring a statistic over ``self.parameters()`` (which holds one stage's layers),
or a learning rate set under ``@rank_zero_only``. The stages then train with different rates, silently.
Comparing a digest of the settings (one integer per stage, in a gather the strategy makes anyway) finds
it before the next step; :func:`first_difference` says where.
"""

from __future__ import annotations

import hashlib
import io
import pickle
from collections.abc import Sequence
from typing import Any, Optional

import torch

from lightning_gpipe.engine.microbatch import host_bytes

__all__ = [
    "DIFFERENT_LOSS_CAUSES",
    "DIFFERENT_SETTINGS_CAUSES",
    "FREED_BY_THE_DRAIN",
    "NO_LOSS",
    "digest",
    "first_difference",
    "loss_bits",
    "losses_apart",
    "optimizer_settings",
]

#: Why the stages' optimizer settings can differ, and what to do instead.
DIFFERENT_SETTINGS_CAUSES = (
    "Each stage steps its own layers with its own copy of the optimizers, so every stage must hold the same "
    "settings, as one device's single optimizer does. Usual causes: `configure_optimizers`, a learning-rate "
    "scheduler or a callback that set them from a value that differs per stage (a count or statistic over "
    "`self.parameters()`, which holds only this rank's stage during a fit, such as a rate scaled by the model's "
    "size or `ReduceLROnPlateau` monitoring a weight norm; use a logged loss or metric, which every stage shares, "
    "or count the model before `fit`), or code under `@rank_zero_only` or `if trainer.is_global_zero:` that "
    "changes a learning rate or the GradScaler's scale: change it on every rank."
)

#: Why the stages' losses can differ, and what to do instead.
DIFFERENT_LOSS_CAUSES = (
    "Every stage computes the loss from the same backbone output with the same layers outside it, so the loss "
    "used something that each stage holds differently. Usually that is a sum over `self.parameters()` (an L2 or L1 "
    "penalty, a weight norm), which during a fit holds only this rank's stage of the backbone: each stage adds its "
    "own part, the loss that is logged is one stage's, and a loss scaled by such a value trains each stage "
    "differently. Another cause is a value a backbone layer keeps during its forward (an auxiliary loss, a "
    "mixture-of-experts balancing term read from the layer after the call): only the stage that holds the layer "
    "computes it, and per micro-batch. Use the optimizer's `weight_decay` for an L2 penalty, compute penalties over "
    "layers outside the backbone only (every stage holds those whole), and compute an auxiliary term from the "
    "backbone's output; the loss must not depend on which stage computes it."
)
#: Why a backward through a pipeline can find a graph already freed where one device's would not.
FREED_BY_THE_DRAIN = (
    "In a pipeline this also happens when the loss uses a tensor that a backbone layer kept during its forward (an "
    "auxiliary loss, a mixture-of-experts balancing term read from the layer after the call): the pipeline's "
    "backward (the drain) has already back-propagated and freed each micro-batch's graph through that layer, and "
    "only the stage that holds the layer has the term at all. Compute such a term from the backbone's output, or "
    "in a layer outside the backbone."
)
#: :func:`loss_bits` of a step that returned no loss (manual optimization, a skipped batch): not compared.
NO_LOSS = -(2**63)


def loss_bits(loss: Optional[torch.Tensor]) -> int:
    """The loss's value as float64 bits in an int64, to ride in a gather of int64 digests; :data:`NO_LOSS` if none."""
    if loss is None or loss.numel() != 1:
        return NO_LOSS
    bits = int(torch.tensor(float(loss), dtype=torch.float64).view(torch.int64))
    return bits if bits != NO_LOSS else NO_LOSS + 1  # -0.0's bits: still a loss


def losses_apart(bits: Sequence[int], rtol: float = 1e-6, atol: float = 1e-8) -> Optional[tuple[int, float, float]]:
    """The first stage whose loss (:func:`loss_bits`, one per stage in stage order) differs from the first stage's,
    with both values; None where they agree, or where a stage had none.

    The stages compute the same loss from the same output, bit for bit on the CPU; the tolerance lets a device's
    kernels that are not deterministic through, and nothing that a penalty over one stage's parameters adds.
    """
    if NO_LOSS in bits:
        return None
    values = torch.tensor(list(bits), dtype=torch.int64).view(torch.float64)
    close = torch.isclose(values, values[:1].expand_as(values), rtol=rtol, atol=atol, equal_nan=True)
    if bool(close.all()):
        return None
    stage = int((~close).nonzero()[0])
    return stage, float(values[0]), float(values[stage])


def _plain(value: Any) -> Any:
    """``value`` as numbers, strings, tensors and tuples of them; anything else (a function a custom optimizer
    keeps in its group, say) by its type alone, whose ``repr`` would hold a per-process memory address."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return f"<{type(value).__name__}>"


def optimizer_settings(
    optimizers: Sequence[torch.optim.Optimizer], step: int, loss_scale: Optional[tuple[float, int]] = None
) -> dict[str, Any]:
    """The global step, float16's loss scale and growth tracker (:func:`~.grad_scaler.loss_scale_state`) and every
    param group's settings (all but its parameters), per optimizer, in order."""
    return {
        "global step": step,
        "loss scale": loss_scale,
        "optimizers": [
            (type(o).__name__, [{k: _plain(v) for k, v in g.items() if k != "params"} for g in o.param_groups])
            for o in optimizers
        ],
    }


class _TensorsAsBytes(pickle.Pickler):
    """Pickles a tensor as its dtype, shape and bytes: pickling the tensor itself gives other bytes each time
    (measured), so equal states would not give equal digests. Plain numbers, strings and containers never
    reach ``reducer_override``, so Python's random state (625 integers) costs nothing extra."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            flat = obj.detach().cpu().contiguous().reshape(-1)
            return tuple, ((str(obj.dtype), tuple(obj.shape), bytes(host_bytes(flat))),)
        return NotImplemented


def digest(value: Any) -> int:
    """A 63-bit digest of numbers, strings, tensors, NumPy arrays and containers of them, equal on every process
    that holds equal values: the stages compare optimizer settings and random states (``rng.get_rng_state``)
    through it with one small gather instead of sending them."""
    data = io.BytesIO()
    _TensorsAsBytes(data).dump(value)
    return int.from_bytes(hashlib.blake2b(data.getbuffer(), digest_size=8).digest(), "little") >> 1


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b))
    return bool(a != b)


def first_difference(a: dict[str, Any], b: dict[str, Any]) -> Optional[tuple[str, Any, Any]]:
    """Where two :func:`optimizer_settings` first differ: (what, ``a``'s value, ``b``'s), or ``None``.

    >>> sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    >>> before = optimizer_settings([sgd], 3)
    >>> sgd.param_groups[0]["lr"] = 0.05
    >>> first_difference(before, optimizer_settings([sgd], 3))
    ('SGD (optimizer 0), param group 0, lr', 0.1, 0.05)
    """
    if a["global step"] != b["global step"]:
        return "the global step", a["global step"], b["global step"]
    if a.get("loss scale") != b.get("loss scale"):
        return "the GradScaler's (scale, growth tracker)", a.get("loss scale"), b.get("loss scale")
    if len(a["optimizers"]) != len(b["optimizers"]):
        return "the number of optimizers", len(a["optimizers"]), len(b["optimizers"])
    for index, ((name, groups), (other, others)) in enumerate(zip(a["optimizers"], b["optimizers"])):
        where = f"{name} (optimizer {index})"
        if name != other or len(groups) != len(others):
            return f"{where}'s type and number of param groups", (name, len(groups)), (other, len(others))
        for number, (group, theirs) in enumerate(zip(groups, others)):
            for key in sorted(set(group) | set(theirs)):
                if _differs(group.get(key), theirs.get(key)):
                    return f"{where}, param group {number}, {key}", group.get(key), theirs.get(key)
    return None
