"""Split a Sequential into contiguous stages: layer costs in, layers per stage out; pure."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Optional

from torch import nn

from lightning_gpipe.engine.microbatch import whole_number

__all__ = [
    "balance",
    "balance_by_params",
    "balance_keeping_together",
    "check_balance_entries",
    "kept_together",
    "layer_span",
    "parameter_costs",
    "layer_names",
    "shared_modules",
    "shared_spans",
    "split_table",
    "stage_bounds",
    "stage_costs",
    "validate_balance",
]


def _check_stages(layers: int, stages: int) -> None:
    if stages < 1:
        raise ValueError(f"The number of stages must be at least 1, got {stages}.")
    if layers == 0:
        raise ValueError("The backbone has no layers: an empty nn.Sequential has nothing to split into stages.")
    if stages > layers:
        raise ValueError(
            f"Cannot split {layers} layers into {stages} stages: every stage needs at least one layer. "
            f"Use at most {layers} devices, or give the backbone more layers."
        )


def balance(costs: Sequence[float], stages: int) -> list[int]:
    """Layers per stage for a contiguous split of ``costs`` into ``stages`` that minimizes the largest stage cost.

    This is exact, not a heuristic: the bottleneck is found by dynamic programming over prefix sums.
    Ties between optimal splits are broken deterministically: first the smaller sum of squared stage
    costs (the more even split), then the lexicographically smallest list.

    >>> balance([1, 1, 1, 1, 4], 2)
    [4, 1]
    """
    n = len(costs)
    _check_stages(n, stages)
    if any(c < 0 or math.isnan(c) for c in costs):
        raise ValueError(f"Layer costs must be non-negative numbers, got {list(costs)}.")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))

    def cost(i: int, j: int) -> float:  # layers i..j-1
        return prefix[j] - prefix[i]

    # best[s][j]: smallest bottleneck for the first j layers in s stages
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            best[s][j] = min(max(best[s - 1][i], cost(i, j)) for i in range(s - 1, j))
    bottleneck = best[stages][n]
    limit = bottleneck + 1e-9 * max(1.0, abs(bottleneck))

    # Among splits under the bottleneck: smallest sum of squares, then lexicographically smallest.
    # squares[s][i]: the best (sum of squares, sizes) for layers i..n-1 in s stages.
    squares: list[list[tuple[float, tuple[int, ...]] | None]] = [[None] * (n + 1) for _ in range(stages + 1)]
    squares[0][n] = (0.0, ())
    for s in range(1, stages + 1):
        for i in range(n - s, -1, -1):
            choice = None
            for j in range(i + 1, n - s + 2):
                rest = squares[s - 1][j]
                c = cost(i, j)
                if rest is None or c > limit:
                    continue
                candidate = (c * c + rest[0], (j - i, *rest[1]))
                if (
                    choice is None
                    or candidate[0] < choice[0] - 1e-12 * max(1.0, choice[0])
                    or (abs(candidate[0] - choice[0]) <= 1e-12 * max(1.0, choice[0]) and candidate[1] < choice[1])
                ):
                    choice = candidate
            squares[s][i] = choice
    result = squares[stages][0]
    assert result is not None  # the bottleneck split itself satisfies the limit
    return list(result[1])


def parameter_costs(module: nn.Sequential) -> list[float]:
    """Parameter count of each layer: the cost behind ``balance="params"``."""
    return [float(sum(p.numel() for p in layer.parameters())) for layer in module]


def balance_by_params(module: nn.Sequential, stages: int) -> list[int]:
    """The optimal split of ``module`` by parameter count that keeps each of its :func:`shared_spans` on one stage."""
    return balance_keeping_together(parameter_costs(module), stages, shared_spans(module))


def layer_names(module: nn.Sequential) -> list[str]:
    """The names of ``module``'s layers, in order: ``"0"``, ``"1"``, ... unless it was built from an ``OrderedDict``.

    A stage keeps its layers under these names, so that ``state_dict`` keys, ``named_parameters()`` and attribute
    access (``backbone.head``) read as on one device: code that selects parameters by name (a param group for
    ``backbone.head``) must find them under the same names on every stage.
    """
    return list(module._modules)


def shared_modules(module: nn.Sequential) -> list[tuple[nn.Module, str, list[int]]]:
    """Each module object with parameters or buffers that appears in several layers of ``module``: the object, its
    name at its first place, and its layers, outer modules first.

    Such a module cannot run on two stages: its state and its code would live in two processes (stateless ones,
    a shared ``nn.ReLU``, can). An automatic split keeps its places on one stage (:func:`shared_spans`); a given
    split that does not is refused (``tied.find_ties``).
    """
    owners: dict[int, tuple[nn.Module, str, list[int]]] = {}
    for index, (name, layer) in enumerate(zip(layer_names(module), module)):
        for path, sub in layer.named_modules(prefix=name):
            if any(True for _ in sub.parameters()) or any(True for _ in sub.buffers()):
                entry = owners.setdefault(id(sub), (sub, path, []))
                if index not in entry[2]:
                    entry[2].append(index)
    return [entry for entry in owners.values() if len(entry[2]) > 1]


def shared_spans(module: nn.Sequential) -> list[tuple[int, int]]:
    """The layer ranges ``(first, last)`` of :func:`shared_modules` that a split must keep on one stage, merged
    where they overlap.

    >>> block = nn.Linear(2, 2)
    >>> shared_spans(nn.Sequential(nn.Linear(2, 2), block, nn.Tanh(), block, nn.Linear(2, 2)))
    [(1, 3)]
    """
    return _merged([(layers[0], layers[-1]) for _, _, layers in shared_modules(module)])


def kept_together(module: nn.Sequential, crossable: Sequence[bool] = ()) -> list[tuple[int, int]]:
    """The layer ranges an automatic split keeps on one stage, merged: :func:`shared_spans`, and each layer whose
    output cannot leave a stage (``crossable[i]`` false, from the profile: see
    :func:`~lightning_gpipe.engine.structure.crosses`) with the layer after it.

    >>> kept_together(nn.Sequential(*[nn.Tanh() for _ in range(5)]), [True, False, False, True, True])
    [(1, 3)]
    """
    stuck = [(i, i + 1) for i, ok in enumerate(crossable[: len(module) - 1]) if not ok]
    return _merged([*shared_spans(module), *stuck])


def _merged(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for first, last in sorted(ranges):
        if merged and first <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(last, merged[-1][1]))
        else:
            merged.append((first, last))
    return merged


def balance_keeping_together(costs: Sequence[float], stages: int, spans: Sequence[tuple[int, int]]) -> list[int]:
    """:func:`balance` of ``costs`` with each span of layers (``(first, last)``, disjoint) kept on one stage.

    >>> balance_keeping_together([1, 1, 1, 1], 2, [(1, 2)])
    [1, 3]
    """
    if not spans:
        return balance(costs, stages)
    ends = dict(spans)
    sizes: list[int] = []  # layers per group: a span, or a layer outside every span
    start = 0
    while start < len(costs):
        sizes.append(ends.get(start, start) - start + 1)
        start += sizes[-1]
    if len(sizes) < stages:
        together = ", ".join(f"layers {first}-{last}" for first, last in spans)
        raise ValueError(
            f"Cannot split {len(costs)} layers into {stages} stages: {together} must stay on one stage, which leaves "
            f"{len(sizes)} part(s). Layers stay together where one module object with parameters or buffers is in "
            "several places: use a separate module for each place and share only the parameters (e.g. "
            "`second.weight = first.weight`), which the pipeline keeps tied across stages. A layer also stays with "
            "the next where its output cannot leave a stage: a tensor without the samples in dim 0 (an LSTM's h and "
            "c), or an object other than tensors in tuples, lists and dicts with constants beside them. Make such "
            "layers return per-sample tensors (batch first), or use fewer devices."
        )
    bounds = [0, *itertools.accumulate(sizes)]
    grouped = balance([sum(costs[bounds[g] : bounds[g + 1]]) for g in range(len(sizes))], stages)
    layers, group = [], 0
    for count in grouped:
        layers.append(bounds[group + count] - bounds[group])
        group += count
    return layers


def validate_balance(balance: Sequence[int], layers: int, stages: int | None = None) -> list[int]:
    """Check an explicit ``balance`` list against the backbone and the number of stages."""
    values = check_balance_entries(balance)
    _check_stages(layers, max(stages or 0, len(values)))  # more stages than layers: no balance can help
    if stages is not None and len(values) != stages:
        raise ValueError(
            f"`balance` has {len(values)} entries but the pipeline has {stages} stages (one per device); "
            f"give one entry per stage, e.g. balance={_even(layers, stages)}."
        )
    if sum(values) != layers:
        raise ValueError(
            f"`balance={values}` sums to {sum(values)} but the backbone has {layers} layers; the entries must sum to "
            f"the number of layers, e.g. balance={_even(layers, len(values))}."
        )
    return values


def check_balance_entries(balance: object) -> list[int]:
    """``balance`` as a list, if it is a non-empty sequence of positive integers (layers per stage); else a ValueError.

    The whole check needs the backbone (:func:`validate_balance`); this part runs when the strategy is made, before
    any process starts.
    """
    entries = list(balance) if isinstance(balance, Sequence) and not isinstance(balance, str) else None
    values = [whole_number(b) for b in entries or []]
    if not entries or any(b is None or b < 1 for b in values):
        shown = entries if entries is not None else balance
        raise ValueError(f"`balance` must be a list of positive integers (layers per stage), got {shown!r}.")
    return [b for b in values if b is not None]  # all of them: checked above


def _even(layers: int, stages: int) -> list[int]:
    base, extra = divmod(layers, max(stages, 1))
    return [base + 1 if i < extra else base for i in range(stages)]


def stage_bounds(balance: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, stop)`` layer indices of each stage.

    >>> stage_bounds([2, 3])
    [(0, 2), (2, 5)]
    """
    bounds, start = [], 0
    for size in balance:
        bounds.append((start, start + size))
        start += size
    return bounds


def stage_costs(costs: Sequence[float], balance: Sequence[int]) -> list[float]:
    """The summed cost of each stage of a split.

    >>> stage_costs([1, 2, 3, 4], [3, 1])
    [6.0, 4.0]
    """
    return [float(sum(costs[start:stop])) for start, stop in stage_bounds(balance)]


def split_table(
    balance: Sequence[int],
    params: Sequence[float],
    time: Optional[Sequence[float]] = None,
    memory: Optional[Sequence[float]] = None,
) -> str:
    """A markdown table of a split: each stage's layer range, parameter count, and share of time and memory.

    Shares are of the whole backbone; ``n/a`` where that cost was not measured.

    >>> print(split_table([1, 2], [10, 0, 30], time=[1, 1, 2]))
    | stage | layers | params | time | memory |
    |---:|---|---:|---:|---:|
    | 0 | 0 | 10 | 25.0% | n/a |
    | 1 | 1-2 | 30 | 75.0% | n/a |
    """

    def shares(costs: Optional[Sequence[float]]) -> list[str]:
        if costs is None:
            return ["n/a"] * len(balance)
        sums = stage_costs(costs, balance)
        total = sum(sums)
        return [f"{100 * s / total:.1f}%" if total > 0 else "-" for s in sums]

    rows = ["| stage | layers | params | time | memory |", "|---:|---|---:|---:|---:|"]
    counts = stage_costs(params, balance)
    for stage, ((start, stop), count, t, m) in enumerate(
        zip(stage_bounds(balance), counts, shares(time), shares(memory))
    ):
        rows.append(f"| {stage} | {layer_span(start, stop)} | {int(count):,} | {t} | {m} |")
    return "\n".join(rows)


def layer_span(start: int, stop: int) -> str:
    """Layers ``start`` to ``stop - 1`` as tables and messages show them: ``"4-6"``, or ``"4"`` for one layer."""
    return str(start) if stop - start == 1 else f"{start}-{stop - 1}"
