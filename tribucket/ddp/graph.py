"""Autograd-graph helpers of the reducer: which parameters a forward's outputs reach."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["output_tensors", "reachable_parameters"]


def output_tensors(output: Any) -> list[torch.Tensor]:
    """Every tensor in a (nested) forward output: tuples, lists, dicts, dataclasses..."""
    leaves, _ = tree_flatten(output)
    found = [t for t in leaves if isinstance(t, torch.Tensor)]
    if not found and hasattr(output, "__dict__"):  # plain objects pytree does not know
        for value in vars(output).values():
            found.extend(output_tensors(value))
    return found


def reachable_parameters(outputs: Iterable[torch.Tensor]) -> set[int]:
    """``id()`` of every leaf tensor whose gradient accumulator the outputs' graph reaches."""
    seen_nodes: set = set()
    reached: set[int] = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    for t in outputs:
        if t.grad_fn is None and t.requires_grad:
            reached.add(id(t))  # an output that *is* a parameter
    while stack:
        node = stack.pop()
        if node in seen_nodes:
            continue
        seen_nodes.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if variable is not None:
            reached.add(id(variable))
        for child, _ in node.next_functions:
            if child is not None and child not in seen_nodes:
                stack.append(child)
    return reached
