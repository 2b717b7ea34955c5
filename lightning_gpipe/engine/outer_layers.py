"""The layers outside the backbone (a stem, a head): every stage holds a copy, and the copies must stay one.

Each stage computes the loss from the shared output with its own copy of those layers and steps them with its
own optimizer, alike on every stage; nothing in the pipeline's messages would show it if the copies parted.
Code that changes them on some ranks only does that: a ``@rank_zero_only`` callback that rescales a head's
weights, or the module's own hook under ``if trainer.is_global_zero:`` that resets a statistic. Each stage
would then train on with its own copy, silently (measured in ``tests/test_compatibility.py``: 0.30 off one
device after 8 steps). So the stages compare a fingerprint of the copies' parameters and buffers
(:func:`~lightning_gpipe.engine.microbatch.fingerprint`: CRC-32 on the CPU), and where they differ every stage
takes the first stage's: rank 0's under rank-zero-only code, which is what one device holds after the same code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_gpipe.engine import distributed
from lightning_gpipe.engine.microbatch import fingerprint
from lightning_gpipe.engine.pipe import GPipe
from lightning_gpipe.engine.stage_copy import StageCopy

__all__ = ["OuterLayers"]


class OuterLayers:
    """The named parameters and buffers of ``module`` that are not ``pipe``'s (the backbone's), every stage's copy."""

    def __init__(self, module: nn.Module, pipe: GPipe) -> None:
        # the backbone's, and those of a weight average's copy of it cut like the pipe (each stage holds its own part)
        cuts = [m for m in module.modules() if isinstance(m, StageCopy)]
        backbone = {id(t) for part in (pipe, *cuts) for t in [*part.parameters(), *part.buffers()]}
        #: their parameters: the gradients every stage averages over its replicas besides its stage's
        self.parameters = [p for p in module.parameters() if id(p) not in backbone]
        named = [*module.named_parameters(), *module.named_buffers()]
        self.tensors: list[tuple[str, Tensor]] = [(name, t) for name, t in named if id(t) not in backbone]
        self.pipe = pipe

    def fingerprint(self) -> int:
        """One integer for all of them, equal on stages that hold equal copies (a pass over their bytes)."""
        return fingerprint([t for _, t in self.tensors])

    def apart(self, digests: Tensor) -> list[str]:
        """The names of the tensors that differ between the stages, where ``digests`` (every stage's
        :meth:`fingerprint`, in stage order) differ; none where they agree. Collective over the pipeline whenever
        the digests differ, which every stage sees alike, and every stage gets the same names."""
        pipe = self.pipe
        if pipe.group is None or bool((digests == digests[0]).all()):
            return []
        every = pipe.gather([fingerprint(t) for _, t in self.tensors])
        assert every is not None  # gathered to every stage
        return [name for i, (name, _) in enumerate(self.tensors) if any(o[i] != every[0][i] for o in every[1:])]

    def copy_first_stages(self, watch: Optional[distributed.Watch] = None) -> None:
        """Give every stage the first stage's values of all of them (collective over the pipeline): at setup, and
        where :meth:`apart` found them apart."""
        pipe = self.pipe
        if pipe.group is None:
            return
        with torch.no_grad():
            for _, tensor in self.tensors:
                carrier = tensor.detach().to(pipe.device).contiguous()  # NCCL sends device tensors only
                work = dist.broadcast(carrier, src=pipe.ranks[0], group=pipe.group, async_op=True)
                distributed.wait(work, watch, "broadcast", pipe.group)
                if carrier.data_ptr() != tensor.data_ptr():
                    tensor.copy_(carrier)

    @staticmethod
    def describe(apart: Sequence[str], ranks: Sequence[int], first: int, when: str) -> str:
        """The warning for copies found apart: which tensors, on which ranks, the likely causes, what was done."""
        shown = ", ".join(f"`{n}`" for n in apart[:5]) + (f" and {len(apart) - 5} more" if len(apart) > 5 else "")
        return (
            f"{when}, the layers outside the backbone on rank(s) {list(ranks)} differed from the first stage's "
            f"(rank {first}): {shown}. Every stage holds a copy of them and steps it alike, so code changed them on "
            "some ranks only (a `@rank_zero_only` callback, or code under `if trainer.is_global_zero:`, that sets "
            "weights), or a kernel that is not deterministic computed them. Every stage took the first stage's copy, "
            "which is what one device holds after the same code; this is checked before every training step (said "
            "once)."
        )
