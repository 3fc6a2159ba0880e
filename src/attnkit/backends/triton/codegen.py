"""A traced mod (:class:`attnkit.mod_graph.ModGraph`) as Triton source for the kernels.

:func:`module_source` writes one Python module with three ``@triton.jit`` functions of
fixed signatures, which the kernels take as ``constexpr`` arguments (:mod:`._fwd`,
:mod:`._bwd`); ``s`` is a ``(m, n)`` float32 score tile, ``b``/``h`` the program's batch
and query head, ``qi (m, 1)``/``ki (1, n)`` int32 query/key positions, ``valid (m, n)`` the
in-bounds elements, and ``CF``/``CI`` the captured tensors packed as float32 / int32
(:class:`Layout`: strides and offsets are constants of the source):

* ``score_mod(s, b, h, qi, ki, valid, CF, CI, LIBDEVICE, WANT_D) -> (out, d)``: the
  modded tile and, when ``WANT_D``, ``d out / d s`` (reverse mode over the graph, with
  an incoming gradient of one);
* ``score_grads(s, g, b, h, qi, ki, valid, CF, CI, GP, LIBDEVICE)``: for the incoming
  gradient ``g = d loss / d out``, adds ``d loss / d t`` for every floating captured tensor
  ``t`` that requires grad into the program's private buffer ``GP`` (``Slot.grad_offset``):
  a whole tile's sum for a load whose index is the same across the tile (``slopes[h]``),
  else a one-hot reduction over the tile's index range (:func:`._modlib.grad_scatter`).
  No atomics: the autograd function sums the programs' buffers in a fixed order;
* ``mask_mod(b, h, qi, ki, valid, CF, CI, LIBDEVICE) -> keep`` for a mask graph.

The derivative is this module's own pass (the graph holds no derivatives): each float
node's adjoint is the sum over its users of the user's adjoint times the local partial,
the rules of torch's autograd formulas (``minimum``/``maximum`` split a tie evenly, the
derivative of ``abs`` at 0 is 0, ``floor``/``round``/... have none).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from attnkit.mod_graph import ModGraph, Node

__all__ = ["Layout", "layout", "module_source"]

#: Indices of a tile's range handled per step of a captured gradient's one-hot reduction.
SCATTER_CHUNK = 16


@dataclass(frozen=True)
class Slot:
    """Where one captured tensor lives in the packed buffers."""

    buffer: str  # "f" (float32) or "i" (int32; bools as 0/1)
    offset: int
    shape: tuple[int, ...]
    grad_offset: int = -1  # where its gradient goes in a program's private buffer (-1: none)


@dataclass(frozen=True)
class Layout:
    """The captured tensors of one or more graphs, packed contiguously into ``CF`` (floats)
    and ``CI`` (ints and bools), in slot order; ``slots[g][k]`` is graph ``g``'s slot ``k``.
    The score graph's tensors that get a gradient (:meth:`ModGraph.grad_slots`) also have a
    place in each dQ program's private gradient buffer of ``grad_size`` floats."""

    slots: tuple[tuple[Slot, ...], ...]
    float_size: int
    int_size: int
    grad_size: int = 0


def layout(graphs: Sequence[ModGraph | None]) -> Layout:
    """The packing of the tensors the ``graphs`` capture (a tensor captured twice is packed
    twice; captured tensors are small tables)."""
    sizes = {"f": 0, "i": 0, "g": 0}
    out = []
    for g in graphs:
        slots = []
        grads = set(g.grad_slots()) if g is not None and g.kind == "score" else set()
        for k, t in enumerate(g.tensors if g is not None else ()):
            buf = "f" if t.is_floating_point() else "i"
            goff = sizes["g"] if k in grads else -1
            slots.append(Slot(buf, sizes[buf], tuple(t.shape), goff))
            sizes[buf] += t.numel()
            sizes["g"] += t.numel() if k in grads else 0
        out.append(tuple(slots))
    return Layout(tuple(out), sizes["f"], sizes["i"], sizes["g"])


def _const(node: Node) -> str:
    v = node.value
    if node.dtype == "bool":
        return f"tl.full([], {int(bool(v))}, tl.int1)"
    if node.dtype == "int":
        return f"tl.full([], {int(v)}, tl.int32)"
    f = float(v)
    lit = repr(f) if math.isfinite(f) else f"float('{f}')"
    return f"tl.full([], {lit}, tl.float32)"


_UNARY = {
    "exp": "tl.exp({0})",
    "log": "tl.log({0})",
    "tanh": "_tanh({0}, LIBDEVICE)",
    "sigmoid": "tl.div_rn(1.0, 1.0 + tl.exp(-{0}))",
    "sqrt": "tl.sqrt_rn({0})",
    "rsqrt": "tl.rsqrt({0})",
    "sin": "tl.sin({0})",
    "cos": "tl.cos({0})",
    "floor": "tl.floor({0})",
    "ceil": "tl.ceil({0})",
    "trunc": "trunc_f({0})",
    "round": "round_f({0})",
    "neg": "-{0}",
    "abs": "tl.abs({0})",
    "not": "~{0}",
}
_CMP = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
_ARITH = {"add": "+", "sub": "-", "mul": "*", "and": "&", "or": "|", "xor": "^"}
_TL_TYPE = {"float": "tl.float32", "int": "tl.int32", "bool": "tl.int1"}


def _pow(a: str, exp_node: Node | None, b: str) -> str:
    """``a ** b``, specialised when the exponent is a constant."""
    if exp_node is not None and exp_node.op == "const":
        return _pow_const(a, float(exp_node.value))
    return f"pow_f({a}, {b}, LIBDEVICE)"


def _pow_const(a: str, c: float) -> str:
    if c == 0:
        return f"({a} * 0.0 + 1.0)"
    if c == 1:
        return a
    if c == 2:
        return f"({a} * {a})"
    if c == 3:
        return f"({a} * {a} * {a})"
    if c == 0.5:
        return f"tl.sqrt_rn({a})"
    if c == -0.5:
        return f"tl.rsqrt({a})"
    if c == -1:
        return f"tl.div_rn(1.0, {a})"
    return f"pow_f({a}, tl.full([], {c!r}, tl.float32), LIBDEVICE)"


class _Emitter:
    """The forward lines of a graph (``v{n}`` per node, ``f{n}`` the flat index of a load)."""

    def __init__(self, graph: ModGraph, slots: tuple[Slot, ...]) -> None:
        self.g, self.slots = graph, slots
        self.live = graph.live()
        self.varying = self._varying()

    def _varying(self) -> set[int]:
        """Nodes whose value may differ across a tile (depend on score, q_idx or kv_idx)."""
        out: set[int] = set()
        for n, node in enumerate(self.g.nodes):
            if (node.op == "input" and node.value in ("score", "q_idx", "kv_idx")) or any(
                a in out for a in node.args
            ):
                out.add(n)
        return out

    def lines(self) -> list[str]:
        out = []
        for n in self.live:
            out.extend(self._node(n))
        return out

    def _node(self, n: int) -> list[str]:
        node, v = self.g.nodes[n], f"v{n}"
        a = [f"v{x}" for x in node.args]
        op = node.op
        if op == "input":
            name = {"score": "s", "b": "b", "h": "h", "q_idx": "qi", "kv_idx": "ki"}[node.value]
            return [f"{v} = {name}"]
        if op == "const":
            return [f"{v} = {_const(node)}"]
        if op == "load":
            return self._load(n, node)
        if op == "cast":
            src = self.g.nodes[node.args[0]].dtype
            if node.dtype == "bool":
                return [f"{v} = {a[0]} != 0"]
            return [
                f"{v} = {a[0]}.to({_TL_TYPE[node.dtype]})" if src != node.dtype else f"{v} = {a[0]}"
            ]
        if op in _UNARY:
            return [f"{v} = " + _UNARY[op].format(a[0])]
        if op in _CMP:
            return [f"{v} = {a[0]} {_CMP[op]} {a[1]}"]
        if op in _ARITH:
            return [f"{v} = {a[0]} {_ARITH[op]} {a[1]}"]
        if op == "div":
            return [f"{v} = tl.div_rn({a[0]}, {a[1]})"]
        if op in ("min", "max"):
            if node.dtype == "bool":
                return [f"{v} = {a[0]} {'&' if op == 'min' else '|'} {a[1]}"]
            return [f"{v} = tl.{op}imum({a[0]}, {a[1]})"]
        if op == "floordiv":
            if node.dtype == "int":
                return [f"{v} = floordiv_i({a[0]}, {a[1]})"]
            return [f"{v} = tl.floor(tl.div_rn({a[0]}, {a[1]}))"]
        if op == "mod":
            if node.dtype == "int":
                return [f"{v} = mod_i({a[0]}, {a[1]})"]
            return [f"{v} = {a[0]} - {a[1]} * tl.floor(tl.div_rn({a[0]}, {a[1]}))"]
        if op == "pow":
            return [f"{v} = " + _pow(a[0], self.g.nodes[node.args[1]], a[1])]
        if op == "where":
            return [f"{v} = tl.where({a[0]}, {a[1]}, {a[2]})"]
        raise ValueError(f"no Triton code for op {op!r}")  # pragma: no cover - OPS are covered

    def _load(self, n: int, node: Node) -> list[str]:
        slot = self.slots[node.value]
        stride, strides = 1, []
        for size in reversed(slot.shape):
            strides.append(stride)
            stride *= size
        strides.reverse()
        terms = []
        for d, x in enumerate(node.args):
            size = slot.shape[d]
            idx = f"tl.where(v{x} < 0, v{x} + {size}, v{x})"
            terms.append(f"{idx} * {strides[d]}" if strides[d] != 1 else idx)
        flat = " + ".join(terms) if terms else "tl.full([], 0, tl.int32)"
        ptr = f"{'CF' if slot.buffer == 'f' else 'CI'} + {slot.offset} + f{n}"
        varying = any(x in self.varying for x in node.args)
        if varying:  # out-of-bounds rows and columns may index anywhere: not read
            lines = [
                f"f{n} = tl.where(valid, {flat}, 0)",
                f"v{n} = tl.load({ptr}, mask=valid, other=0)",
            ]
        else:
            lines = [f"f{n} = {flat}", f"v{n} = tl.load({ptr})"]
        if node.dtype == "bool":
            lines.append(f"v{n} = v{n} != 0")
        return lines


def _reaches(graph: ModGraph, targets: set[int]) -> set[int]:
    """Float nodes through which a derivative flows from the output to ``targets``."""
    out: set[int] = set()
    for n, node in enumerate(graph.nodes):
        if node.dtype == "float" and (n in targets or any(a in out for a in node.args)):
            out.add(n)
    return out


def _adjoint(graph: ModGraph, targets: set[int], live: list[int]) -> list[str]:
    """Reverse-mode lines: ``a{n}`` = d out / d node n times the incoming ``g``, for the
    float nodes between the output and ``targets`` (``a{target}`` is left defined)."""
    flows = _reaches(graph, targets)
    lines: list[str] = []
    seen: set[int] = set()

    def add(n: int, expr: str) -> None:
        if n not in flows:
            return
        if n in seen:
            lines.append(f"a{n} = a{n} + {expr}")
        else:
            lines.append(f"a{n} = {expr}")
            seen.add(n)

    if graph.output not in flows:
        return lines
    lines.append(f"a{graph.output} = g")
    seen.add(graph.output)
    for n in reversed(live):
        if n not in seen or (n in targets and graph.nodes[n].op in ("input", "load")):
            continue
        node, A = graph.nodes[n], f"a{n}"
        x = node.args
        va = [f"v{i}" for i in x]
        op = node.op
        if op in ("add",):
            add(x[0], A)
            add(x[1], A)
        elif op == "sub":
            add(x[0], A)
            add(x[1], f"-{A}")
        elif op == "mul":
            add(x[0], f"{A} * {va[1]}")
            add(x[1], f"{A} * {va[0]}")
        elif op == "div":
            add(x[0], f"tl.div_rn({A}, {va[1]})")
            add(x[1], f"-tl.div_rn({A} * v{n}, {va[1]})")
        elif op == "neg":
            add(x[0], f"-{A}")
        elif op == "abs":
            add(x[0], f"tl.where({va[0]} > 0, {A}, tl.where({va[0]} < 0, -{A}, 0.0))")
        elif op == "exp":
            add(x[0], f"{A} * v{n}")
        elif op == "log":
            add(x[0], f"tl.div_rn({A}, {va[0]})")
        elif op == "tanh":
            add(x[0], f"{A} * (1.0 - v{n} * v{n})")
        elif op == "sigmoid":
            add(x[0], f"{A} * v{n} * (1.0 - v{n})")
        elif op == "sqrt":
            add(x[0], f"tl.div_rn({A} * 0.5, v{n})")
        elif op == "rsqrt":
            add(x[0], f"-0.5 * {A} * tl.div_rn(v{n}, {va[0]})")
        elif op == "sin":
            add(x[0], f"{A} * tl.cos({va[0]})")
        elif op == "cos":
            add(x[0], f"-{A} * tl.sin({va[0]})")
        elif op in ("min", "max"):
            win = "<" if op == "min" else ">"
            w = f"tl.where({va[0]} == {va[1]}, 0.5, tl.where({va[0]} {win} {va[1]}, 1.0, 0.0))"
            add(x[0], f"{A} * {w}")
            add(x[1], f"{A} * (1.0 - {w})")
        elif op == "mod":  # float remainder: a - b * floor(a / b)
            add(x[0], A)
            add(x[1], f"-{A} * tl.floor(tl.div_rn({va[0]}, {va[1]}))")
        elif op == "pow":
            e = graph.nodes[x[1]]
            if e.op == "const":
                c = float(e.value)
                add(x[0], f"{A} * {c!r} * " + _pow_const(va[0], c - 1.0))
            else:
                add(x[0], f"{A} * {va[1]} * pow_f({va[0]}, {va[1]} - 1.0, LIBDEVICE)")
                add(x[1], f"{A} * v{n} * tl.log({va[0]})")
        elif op == "where":
            add(x[1], f"tl.where({va[0]}, {A}, 0.0)")
            add(x[2], f"tl.where({va[0]}, 0.0, {A})")
        # floor/ceil/trunc/round/floordiv: derivative 0; casts from int/bool: none
    return lines


_HEADER = '''"""Generated by attnkit.backends.triton.codegen from a traced mod: do not edit.

{describe}
"""
import triton
import triton.language as tl

from attnkit.backends.triton._modlib import (
    _tanh, floordiv_i, grad_scatter, grad_sum, mod_i, pow_f, round_f, trunc_f,
)
'''


def _defines(lines: list[str], n: int) -> bool:
    return any(line.startswith(f"a{n} = ") for line in lines)


def _indent(lines: list[str], depth: int = 1) -> str:
    return "".join("    " * depth + line + "\n" for line in lines)


def _score_functions(graph: ModGraph, slots: tuple[Slot, ...]) -> str:
    em = _Emitter(graph, slots)
    fwd = em.lines()
    score = {n for n in em.live if graph.nodes[n].op == "input" and graph.nodes[n].value == "score"}
    d_lines = _adjoint(graph, score, em.live)
    d_value = next((f"a{n}" for n in score if _defines(d_lines, n)), "tl.zeros_like(s)")
    out = f"v{graph.output} + tl.zeros_like(s)"
    text = "\n\n@triton.jit\ndef score_mod(s, b, h, qi, ki, valid, CF, CI, LIBDEVICE: tl.constexpr, WANT_D: tl.constexpr):\n"
    text += _indent(fwd)
    text += "    d = 1.0\n    if WANT_D:\n        g = tl.full(s.shape, 1.0, tl.float32)\n"
    text += _indent(d_lines, 2)
    text += f"        d = {d_value} + tl.zeros_like(s)\n"
    text += f"    return {out}, d\n"
    # captured gradients
    text += "\n\n@triton.jit\ndef score_grads(s, g, b, h, qi, ki, valid, CF, CI, GP, LIBDEVICE: tl.constexpr):\n"
    loads = [
        n
        for n in em.live
        if graph.nodes[n].op == "load"
        and graph.nodes[n].dtype == "float"
        and graph.nodes[n].value in graph.grad_slots()
    ]
    if not loads:
        return text + "    pass\n"
    text += _indent(fwd)
    text += "    live = valid & (g != 0.0)\n"
    defined = "\n".join(_adjoint(graph, set(loads), em.live))
    text += _indent(defined.splitlines())
    for n in loads:
        if not _defines(defined.splitlines(), n):
            continue
        slot = slots[graph.nodes[n].value]
        contrib = f"tl.where(live, a{n}, 0.0)"
        if any(x in em.varying for x in graph.nodes[n].args):
            text += f"    grad_scatter(GP + {slot.grad_offset}, f{n} + tl.zeros_like(qi + ki), {contrib}, live, {SCATTER_CHUNK})\n"
        else:
            text += f"    grad_sum(GP + {slot.grad_offset} + f{n}, {contrib}, live)\n"
    return text


def _mask_function(graph: ModGraph, slots: tuple[Slot, ...]) -> str:
    em = _Emitter(graph, slots)
    text = "\n\n@triton.jit\ndef mask_mod(b, h, qi, ki, valid, CF, CI, LIBDEVICE: tl.constexpr):\n"
    text += _indent(em.lines())
    return text + f"    return v{graph.output} & valid\n"


def module_source(score: ModGraph | None, mask: ModGraph | None, lay: Layout) -> str:
    """The generated module for a score graph and/or a mask graph (see the module docs);
    ``lay`` is :func:`layout` of ``(score, mask)``."""
    parts = []
    for g in (score, mask):
        if g is not None:
            parts.append(f"{g.kind}_mod {g.name}:\n{g.describe()}")
            for k, t in enumerate(g.tensors):
                parts.append(f"  t{k}: {tuple(t.shape)} {t.dtype}")
    text = _HEADER.format(describe="\n".join(parts).replace('"""', "'''"))
    if score is not None:
        text += _score_functions(score, lay.slots[0])
    if mask is not None:
        text += _mask_function(mask, lay.slots[1])
    return text
