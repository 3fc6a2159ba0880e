"""attnkit.mods: walking a score_mod's autograd graph to the tensors it captures."""

from __future__ import annotations

import torch

from attnkit import masks as M
from attnkit.mods import autograd_leaves, grad_leaves


class _Node:
    """An autograd node as torch 2.11 hands them out: its next nodes are new Python objects
    at every access, freed as soon as nothing holds them (so their ids get reused)."""

    def __init__(self, children: tuple = (), variable: torch.Tensor | None = None) -> None:
        self._children, self.variable = children, variable

    @property
    def next_functions(self) -> tuple:
        return tuple((None if c is None else _Node(*c), 0) for c in self._children)


def test_a_node_whose_id_was_freed_is_still_walked():
    """Regression: the walk marked nodes seen by id() without keeping them alive, so a new
    node reusing a freed one's id was skipped; on torch 2.11 a learned ALiBi slope was then
    never found and its gradient was dropped (found on the first GPU run)."""
    params = [torch.zeros(1, requires_grad=True) for _ in range(6)]
    # a node is (children, variable); a chain of ops, each with one more leaf beside it
    chain: tuple = ((), params[0])
    for p in params[1:]:
        chain = ((chain, None, ((), p)), None)
    root = _Node(*chain)
    found = autograd_leaves(root)
    assert {id(t) for t in found} == {id(p) for p in params}


def test_learned_tensors_are_found_however_reached():
    slopes = torch.nn.Parameter(torch.rand(4))
    table = torch.nn.Parameter(torch.randn(4, 7))
    holder = {"w": torch.nn.Parameter(torch.rand(4))}
    cases = [
        (M.alibi(4, slopes), [slopes]),
        (M.relative_bias(table), [table]),
        (lambda s, b, h, q, kv: s * holder["w"][h] + slopes[h], [holder["w"], slopes]),
        (M.alibi(4), []),  # fixed slopes: nothing to learn
    ]
    for mod, want in cases:
        got = grad_leaves(mod, torch.float32, torch.device("cpu"))
        assert {id(t) for t in got} == {id(t) for t in want}
