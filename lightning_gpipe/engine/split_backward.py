"""Input gradients first: one micro-batch's backward on a stage in two passes, in the spirit of zero-bubble pipelines.

In a fill-drain drain, the previous stage waits for this stage's input gradient, and nobody waits for
its weight gradients. So the backward is split: :func:`inputs_first` computes only the gradients of
the stage's inputs (the engine skips every weight-gradient product), while prehooks keep the
gradient that reaches each *intermediate*, a node on the input path from which a parameter hangs;
the stage sends the input gradient at once; then the returned :class:`WeightPass` back-propagates
the kept gradients from those intermediates into the parameters only. The activation gradients are
computed once, in the first pass; the second runs the weight-gradient half of each intermediate and
the parameter branches below it, through ``AccumulateGrad`` as a whole backward does (so gradient
hooks, such as data-parallel gradient sync, fire as usual).

The second pass makes one autograd call per depth of the input path's intermediates (see :func:`_calls`),
each about 15-30 us on a CPU here, so the split pays only when the weight gradients of a micro-batch are
large beside that. ``None`` from :func:`inputs_first` means
the graph cannot be split safely (the caller runs the whole backward): for example a layer under
``torch.utils.checkpoint(..., use_reentrant=True)``, which refuses a backward restricted to some inputs.

A hook on an activation (``tensor.register_hook``, ``retain_grad``) whose node is an intermediate runs in
both passes: in the first on the real gradient, in the weight pass on zeros, which the weight pass then
replaces by the gradient kept in the first. So the parameters get the gradient of a whole backward and a
retained ``.grad`` is the same; only a hook that records what it sees also records one tensor of zeros.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightPass", "inputs_first"]


def _node(t: Tensor) -> Node:
    return get_gradient_edge(t).node  # the grad_fn, or a leaf's AccumulateGrad


def _children(node: Node) -> list[Node]:
    return [child for child, _ in node.next_functions if child is not None]


class WeightPass:
    """The second pass: the parameter gradients from the gradients kept at the intermediates."""

    def __init__(self, groups: list[tuple[list[Node], list[Tensor]]], extra: list[tuple[Tensor, Tensor]]) -> None:
        self._groups, self._extra = groups, extra
        self.kept: dict[Node, tuple[Optional[Tensor], ...]] = {}

    def __call__(self) -> None:
        """Accumulate every parameter's gradient; frees what the first pass kept."""
        for intermediates, params in self._groups:
            edges, grads = [], []
            for node in intermediates:
                for index, grad in enumerate(self.kept.get(node, ())):
                    if grad is not None:
                        edges.append(GradientEdge(node, index))
                        grads.append(grad.new_zeros(()).expand_as(grad))  # replaced by the kept one, see below
            if not edges:
                continue  # no gradient reached this group: the whole backward gives it none either
            # Each intermediate must get exactly the gradient kept for it. Two things would change it: (1) with
            # several intermediates in one group (a weight used in two places), the gradient that the upper one
            # sends down again to the lower one; (2) the hooks on the activation an intermediate consumes
            # (``tensor.register_hook``, ``retain_grad``): they ran in the first pass, before the gradient was
            # kept, and run again here on the root's gradient. So the roots carry zeros (a hook that adds or
            # scales adds nothing; ``retain_grad`` adds 0 to ``.grad``), and a node prehook, which runs after
            # the tensor hooks, puts the kept gradient in their place.
            handles = [
                node.register_prehook(lambda _, kept=self.kept[node]: kept)
                for node in intermediates
                if node in self.kept
            ]
            try:
                torch.autograd.backward(edges, grads, inputs=params, retain_graph=True)  # groups may share nodes
            finally:
                for handle in handles:
                    handle.remove()
        for output, grad in self._extra:
            torch.autograd.backward([output], [grad], inputs=self._params_of(output), retain_graph=True)
        self.kept.clear()
        self._groups, self._extra = [], []

    @staticmethod
    def _params_of(output: Tensor) -> list[Tensor]:
        params, stack, seen = [], [_node(output)], set()
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            variable = getattr(node, "variable", None)
            if variable is not None:
                params.append(variable)
            stack += _children(node)
        return params


#: Backward nodes that refuse a backward restricted to some inputs (``torch.autograd.grad`` or ``inputs=``):
#: ``torch.utils.checkpoint(..., use_reentrant=True)`` inside a layer raises there, so such a graph runs whole.
_WHOLE_ONLY = frozenset({"CheckpointFunctionBackward"})


class _Unsplittable(Exception):
    """The graph holds a node of :data:`_WHOLE_ONLY`."""


def _reaching(roots: Sequence[Node], targets: set[Node]) -> set[Node]:
    """The nodes under ``roots`` from which a node of ``targets`` can be reached (targets included).

    Raises :class:`_Unsplittable` if any node under ``roots`` is one of :data:`_WHOLE_ONLY`."""
    reaches: dict[Node, bool] = {}
    stack: list[tuple[Node, bool]] = [(root, False) for root in roots]
    while stack:  # iterative post-order: the graph of a deep stage would overflow Python's recursion
        node, expanded = stack.pop()
        if expanded:
            reaches[node] = node in targets or any(reaches[child] for child in _children(node))
        elif node not in reaches:
            if node.name() in _WHOLE_ONLY:
                raise _Unsplittable(node.name())
            reaches[node] = False  # visiting; an autograd graph has no cycles, so this is settled below
            stack.append((node, True))
            stack += [(child, False) for child in _children(node) if child not in reaches]
    return {node for node, yes in reaches.items() if yes}


def inputs_first(outputs: Sequence[Tensor], grads: Sequence[Tensor], inputs: Sequence[Tensor]) -> Optional[WeightPass]:
    """Back-propagate ``grads`` from ``outputs`` into the leaves ``inputs`` only (their ``.grad`` accumulates,
    as a whole backward's would); returns the weight pass, which fills every other leaf's (the parameters'),
    or ``None`` (nothing run) if the graph cannot be split: then the caller runs the whole backward."""
    if not outputs or not inputs or any(t.grad_fn is None for t in outputs):
        return None
    try:
        input_nodes = {_node(t) for t in inputs}
        roots: list[Node] = [t.grad_fn for t in outputs]  # type: ignore[misc]
        on_input_path = _reaching(roots, input_nodes)
        groups = _param_groups(roots, on_input_path, input_nodes)
    except (RuntimeError, TypeError, _Unsplittable):  # a graph this module cannot split: the whole backward
        return None
    extra = [(o, g) for o, g in zip(outputs, grads) if o.grad_fn not in on_input_path]
    weight_pass = WeightPass(groups, extra)
    handles = []
    for node in {n for intermediates, _ in groups for n in intermediates}:

        def keep(grad_outputs: tuple[Any, ...], node: Node = node) -> None:
            weight_pass.kept[node] = tuple(g.detach() if g is not None else None for g in grad_outputs)

        handles.append(node.register_prehook(keep))
    try:
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.grad_fn in on_input_path]
        if pairs:
            found = torch.autograd.grad(
                [o for o, _ in pairs], list(inputs), [g for _, g in pairs], retain_graph=True, allow_unused=True
            )
            for leaf, grad in zip(inputs, found):
                if grad is not None:
                    leaf.grad = grad if leaf.grad is None else leaf.grad + grad
    finally:
        for handle in handles:
            handle.remove()
    return weight_pass


def _param_groups(
    roots: Sequence[Node], on_input_path: set[Node], input_nodes: set[Node]
) -> list[tuple[list[Node], list[Tensor]]]:
    """The parameters grouped by their intermediates: the input-path nodes from which each one hangs.

    A parameter's branch is walked up from the outputs: every input-path node with a child off the
    input path that leads to the parameter is an intermediate of it. Parameters that share an
    intermediate share a group (one autograd call in the weight pass).
    """
    reaches_param: dict[Node, set[Node]] = {}  # off-path node -> the parameter nodes under it
    variables: dict[Node, Tensor] = {}

    def params_under(node: Node) -> set[Node]:
        found = reaches_param.get(node)
        if found is None:
            variable = getattr(node, "variable", None)  # an AccumulateGrad's leaf
            found = set()
            if variable is not None and node not in input_nodes:
                variables[node] = variable
                found = {node}
            for child in _children(node):
                if child not in on_input_path:
                    found = found | params_under(child)
            reaches_param[node] = found
        return found

    owners: dict[Node, set[Node]] = {}  # intermediate -> parameter nodes hanging from it
    seen, stack = set(), [r for r in roots if r in on_input_path]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for child in _children(node):
            if child in on_input_path:
                stack.append(child)
            else:
                under = params_under(child)
                if under:
                    owners.setdefault(node, set()).update(under)
    # union intermediates that share a parameter
    groups: list[tuple[set[Node], set[Node]]] = []
    for node, under in owners.items():
        merged = ({node}, set(under))
        for group in [g for g in groups if g[1] & under]:
            groups.remove(group)
            merged = (merged[0] | group[0], merged[1] | group[1])
        groups.append(merged)
    return _calls(roots, on_input_path, [(list(nodes), [variables[p] for p in ps]) for nodes, ps in groups])


def _calls(
    roots: Sequence[Node], on_input_path: set[Node], groups: list[tuple[list[Node], list[Tensor]]]
) -> list[tuple[list[Node], list[Tensor]]]:
    """The groups merged into as few weight-pass calls as can run without recomputing an activation gradient.

    One call from two intermediates where one lies above the other on the input path would send the upper
    one's gradient down to the lower one again (the activation gradients between them, computed twice). So
    the single-intermediate groups are merged by *depth*, the most intermediates on a path above one: two
    intermediates of the same depth never lie on one path. A chain (a Transformer) gains nothing; parallel
    branches (an AmoebaNet cell's operations) share calls. A group of several intermediates stays alone.
    """
    intermediates = {node for nodes, _ in groups for node in nodes}
    order: list[Node] = []  # the input path, every node after all its parents
    done: set[Node] = set()
    stack: list[tuple[Node, bool]] = [(root, False) for root in roots if root in on_input_path]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
        elif node not in done:
            done.add(node)
            stack.append((node, True))
            stack += [(child, False) for child in _children(node) if child in on_input_path and child not in done]
    depth = dict.fromkeys(order, 0)
    for node in reversed(order):  # post-order reversed: parents first
        below = depth[node] + (node in intermediates)
        for child in _children(node):
            if child in on_input_path and depth[child] < below:
                depth[child] = below
    merged: dict[int, tuple[list[Node], list[Tensor]]] = {}
    calls = []
    for nodes, params in groups:
        if len(nodes) > 1:
            calls.append((nodes, params))
        else:
            call = merged.setdefault(depth[nodes[0]], ([], []))
            call[0].extend(nodes)
            call[1].extend(params)
    return calls + [merged[d] for d in sorted(merged)]
