"""Zero-bubble backward split: B computes input gradients only, W the weight gradients from where B stopped.

Qi et al. 2023 ("Zero Bubble Pipeline Parallelism") split a stage's backward into B (gradients of
the stage's inputs, needed at once by the previous stage) and W (gradients of its weights, which can
wait). On autograd's graph: the *input nodes* are the backward nodes on some path from the outputs
to an input leaf; B runs exactly those. A *frontier edge* leaves an input node into the weight-only
part of the graph (e.g. a linear's backward: its input gradient is B's, its weight
gradient W's). B asks autograd for the input leaves AND the gradients on the frontier edges into
the weight-only graph (``torch.autograd.graph.GradientEdge`` inputs, where the engine stops); W
restarts autograd from those edges asking for the weights, so nothing of B runs twice. Outputs whose backward never
reaches an input (the first stage, fed token ids) are W's roots, seeded with their output gradient.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch.autograd.graph import GradientEdge

__all__ = ["SplitBackward"]


def _reaching(roots: list, is_target) -> set:
    """Backward nodes (by id) from which some node with ``is_target(node)`` is reachable."""
    memo: dict[int, bool] = {}
    stack = [(n, False) for n in roots if n is not None]
    while stack:
        node, expanded = stack.pop()
        key = id(node)
        if key in memo and not expanded:
            continue
        children = [c for c, _ in node.next_functions if c is not None]
        if not expanded:
            memo.setdefault(key, False)
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in memo)
        else:
            memo[key] = bool(is_target(node)) or any(memo.get(id(c), False) for c in children)
    return {k for k, v in memo.items() if v}


def _accumulates(tensors: list):
    ids = {id(t) for t in tensors}
    return lambda node: id(getattr(node, "variable", None)) in ids if hasattr(node, "variable") else False


@dataclass(eq=False)
class SplitBackward:
    """One microbatch's B then W. ``outputs``/``seeds``: what backward starts from; ``leaves``: the
    received values requiring grad; ``params``: the stage's weights requiring grad."""
    outputs: list
    seeds: list
    leaves: list
    params: list
    frontier: list = field(default_factory=list)   # (edge into the weight-only graph, its gradient)
    roots: list = field(default_factory=list)      # (output reaching weights only, its seed)

    def input_grads(self) -> list:
        """B: gradients of ``leaves`` (None where unused); records the frontier gradients W needs."""
        roots = [o.grad_fn for o in self.outputs]
        on_input = _reaching(roots, _accumulates(self.leaves))
        to_param = _reaching(roots, _accumulates(self.params))
        seen, edges, keys = set(), [], set()
        stack = [n for n in roots if n is not None and id(n) in on_input]
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            for child, nr in node.next_functions:
                if child is None:
                    continue
                if id(child) in on_input:
                    stack.append(child)
                elif id(child) in to_param and (id(child), nr) not in keys:
                    keys.add((id(child), nr))
                    edges.append((child, nr))
        self.roots = [(o, g) for o, g in zip(self.outputs, self.seeds)
                      if o.grad_fn is not None and id(o.grad_fn) not in on_input and id(o.grad_fn) in to_param]
        wanted = list(self.leaves) + [GradientEdge(c, nr) for c, nr in edges]
        start = [(o, g) for o, g in zip(self.outputs, self.seeds) if id(o.grad_fn) in on_input]
        if not wanted or not start:
            return [None] * len(self.leaves)
        got = torch.autograd.grad([o for o, _ in start], wanted, [g for _, g in start], retain_graph=True,
                                  allow_unused=True)
        self.frontier = [(edge, g) for edge, g in zip(edges, got[len(self.leaves):]) if g is not None]
        return list(got[:len(self.leaves)])

    def weight_grads(self, on_ready: Optional[Callable[[torch.Tensor], None]] = None,
                     chunk_bytes: int = 4 * 2**20) -> None:
        """W: accumulate the weights' gradients into ``.grad`` (only the weight-only graph runs).

        The weights are done in chunks of about ``chunk_bytes``, last parameter first (the order a
        full backward finishes them), and ``on_ready(p)`` is called as each one's gradient lands, so
        a data-parallel all-reduce of the first chunks can run while the later ones compute."""
        param_of = {id(p): p for p in self.params}
        direct, edges, grads = [], [], []
        for (node, nr), g in self.frontier:
            p = param_of.get(id(getattr(node, "variable", None)))
            if p is not None:  # the edge IS the weight's accumulator
                direct.append((p, g))
            else:
                edges.append(GradientEdge(node, nr))
                grads.append(g)
        for o, g in self.roots:
            edges.append(o)
            grads.append(g)
        chunks: list[list[torch.Tensor]] = []
        filled = chunk_bytes
        for p in reversed(self.params):
            if filled >= chunk_bytes:
                chunks.append([])
                filled = 0
            chunks[-1].append(p)
            filled += p.numel() * p.element_size()
        _accumulate(direct)
        for k, chunk in enumerate(chunks):
            if edges:
                got = torch.autograd.grad(edges, chunk, grads, allow_unused=True, retain_graph=k < len(chunks) - 1)
                _accumulate(list(zip(chunk, got)))
            for p in chunk if on_ready is not None else ():
                on_ready(p)  # every contribution to p (direct ones came first) is in
        self.frontier, self.roots = [], []


def _accumulate(pairs: list) -> None:
    with torch.no_grad():
        for p, g in pairs:
            if g is not None:
                p.grad = g.detach().clone() if p.grad is None else p.grad.add_(g)
