"""A ``score_mod`` / ``mask_mod`` traced once into a typed expression graph.

FlexAttention's mods are scalar programs: ``score_mod(score, b, h, q_idx, kv_idx) -> score``
and ``mask_mod(b, h, q_idx, kv_idx) -> bool``. :func:`trace` calls the mod once on
symbolic scalars and records what it computes as a :class:`ModGraph`: a list of
:class:`Node` in topological order over the inputs ``score, b, h, q_idx, kv_idx``,
constants, and loads ``tensor[index, ...]`` from the tensors the mod captures (one index
expression per dimension). Code generators (the native CPU kernel, Triton) read the
graph; nothing else about the mod is needed.

Types follow torch's rules for 0-d tensors, in three categories: ``"float"``, ``"int"``
and ``"bool"`` (a float is computed in the kernel's accumulation dtype, an int in int32:
:meth:`ModGraph.check` proves every int fits and every load index is in range for the
sizes of a call). Supported operations (:data:`OPS`):

* arithmetic ``+ - * / // % **``, unary ``-``, ``abs``; ``torch.minimum/maximum``,
  ``clamp``, ``torch.where`` (and ``Tensor.where``), ``addcmul``/``addcdiv``;
* ``exp log tanh sigmoid sqrt rsqrt sin cos floor ceil trunc round``, ``square``;
* comparisons ``== != < <= > >=``, logical ``& | ^ ~`` on bools
  (``logical_and/or/not``), casts (``.float()``, ``.int()``, ``.long()``, ``.bool()``,
  ``.to(dtype)``), ``zeros_like``/``ones_like``/``full_like`` of an index;
* loads from captured tensors: ``t[i]``, ``t[i][j]``, ``t[i, j]`` with traced or
  constant indices (negative indices wrap as in torch), and 0-d tensors used as values.

Anything else (Python ``if`` on a traced value, slices, reductions such as
``t[h].sum()``, ``math.*`` functions, other torch functions) raises
:class:`Unsupported` with the reason; the call then runs on the tile engine, which
evaluates the mod itself.

:func:`traced` caches the result (graph or :class:`Unsupported`) per mod object and the
state it captures, as :mod:`attnkit.block_mask_cache` caches block masks: a repeated
call traces nothing, a mutated capture is traced again.
"""

from __future__ import annotations

import math
import operator
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from attnkit.block_mask_cache import _state, _Uncacheable  # one way to key a mod's state

__all__ = [
    "INEXACT_FLOAT_OPS",
    "INPUTS",
    "OPS",
    "ModGraph",
    "Node",
    "Unsupported",
    "clear_cache",
    "trace",
    "traced",
]

#: The graph's inputs, by name: the score (score mods only) and the four indices.
INPUTS = ("score", "b", "h", "q_idx", "kv_idx")
#: Every op a node may have, by arity (``"input"``, ``"const"``, ``"load"`` besides).
UNARY = (
    "neg", "abs", "exp", "log", "tanh", "sigmoid", "sqrt", "rsqrt", "sin", "cos",
    "floor", "ceil", "trunc", "round", "not", "cast",
)  # fmt: skip
BINARY = (
    "add", "sub", "mul", "div", "floordiv", "mod", "pow", "min", "max",
    "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "xor",
)  # fmt: skip
TERNARY = ("where",)
OPS = ("input", "const", "load", *UNARY, *BINARY, *TERNARY)
#: Float ops whose float32 value generated code may round differently from torch.
INEXACT_FLOAT_OPS = ("exp", "log", "tanh", "sigmoid", "sin", "cos", "pow", "rsqrt")
#: Value types of nodes, narrowest first (torch's promotion categories).
DTYPES = ("bool", "int", "float")
_INT32 = (-(2**31), 2**31 - 1)


class Unsupported(Exception):
    """A mod the graph cannot express; ``reason`` says what (shown by explain())."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Node:
    """One value of a mod's program.

    Attributes:
        op: one of :data:`OPS`.
        dtype: ``"float"``, ``"int"`` or ``"bool"``.
        args: the argument nodes (indices into :attr:`ModGraph.nodes`, all earlier).
        value: ``"input"``: the input's name (:data:`INPUTS`); ``"const"``: the Python
            value; ``"load"``: the slot of the tensor (:attr:`ModGraph.tensors`), its
            index expressions being ``args`` (one per dimension); else None.
    """

    op: str
    dtype: str
    args: tuple[int, ...] = ()
    value: Any = None


@dataclass(eq=False)
class ModGraph:
    """A traced mod (see the module docs).

    Attributes:
        kind: ``"score"`` or ``"mask"``.
        nodes: the program, arguments before their users.
        output: the node the mod returns (float for score mods, bool for mask mods).
        tensors: the captured tensors the loads read, by slot (the very objects the mod
            holds: a gradient for them reaches the mod's parameters through autograd).
        name: the mod's name, for messages.
    """

    kind: str
    nodes: tuple[Node, ...]
    output: int
    tensors: tuple[torch.Tensor, ...]
    name: str = "mod"
    _int_ranges: dict[int, tuple[float, float]] = field(default_factory=dict, repr=False)

    # -- structure -------------------------------------------------------------------
    def uses(self, name: str) -> bool:
        """Whether the output depends on input ``name`` (e.g. ``"score"``, ``"kv_idx"``)."""
        return any(self.nodes[n].op == "input" and self.nodes[n].value == name for n in self.live())

    def live(self) -> list[int]:
        """The nodes the output depends on, in order."""
        need = {self.output}
        for n in range(self.output, -1, -1):
            if n in need:
                need.update(self.nodes[n].args)
        return sorted(need)

    def grad_slots(self) -> list[int]:
        """Slots of floating captured tensors that require grad and that a live load reads."""
        slots = {self.nodes[n].value for n in self.live() if self.nodes[n].op == "load"}
        return [
            s
            for s in sorted(slots)
            if self.tensors[s].is_floating_point() and self.tensors[s].requires_grad
        ]

    def describe(self) -> str:
        """The program, one node a line (``%3 = float add(%1, %2)``)."""
        lines = []
        for n, node in enumerate(self.nodes):
            args = ", ".join(f"%{a}" for a in node.args)
            if node.op == "load":
                what = f"t{node.value}{tuple(self.tensors[node.value].shape)}[{args}]"
            elif node.op in ("input", "const"):
                what = repr(node.value)
            else:
                what = f"{node.op}({args})"
            lines.append(f"%{n} = {node.dtype} {node.op if node.op != 'load' else 'load'} {what}")
        lines.append(f"return %{self.output}")
        return "\n".join(lines)

    def inexact(self) -> str | None:
        """Why generated code may not round this graph's floats exactly as torch does
        (None when it will): a float op from :data:`INEXACT_FLOAT_OPS` (vector
        approximations, two roundings), or a float ``//`` / ``%`` (torch's rounding differs
        from ``floor(a / b)`` at the edges). A ``mask_mod`` must keep exactly the keys torch
        keeps, so such a mask is not generated (its block mask stores its tiles)."""
        for n in self.live():
            node = self.nodes[n]
            if node.dtype == "float" and node.op in (*INEXACT_FLOAT_OPS, "floordiv", "mod"):
                sym = {"floordiv": "//", "mod": "%"}.get(node.op, f"torch.{node.op}")
                return (
                    f"a float {sym} (%{n}), whose float32 rounding generated code may not "
                    "match bit for bit"
                )
        return None

    # -- ranges ------------------------------------------------------------------------
    def check(self, B: int, H: int, T: int, S: int, q_base: int = 0, k_base: int = 0) -> str | None:
        """Why code generated from this graph may not run a call of these sizes (None
        when it may): every int value must fit in int32, no int be divided by a value that
        may be 0, and every load index be within ``[-n, n)`` of its dimension, for ``b < B, h < H``, queries ``q_base + [0, T)``
        and keys ``k_base + [0, S)`` (interval arithmetic: conservative)."""
        ranges = self.int_ranges(B, H, T, S, q_base, k_base)
        for n in self.live():
            node = self.nodes[n]
            if node.dtype == "int":
                if node.op in ("floordiv", "mod"):
                    lo, hi = ranges[node.args[1]]
                    if lo <= 0 <= hi:
                        return (
                            f"an integer division (%{n}) by a value that may be 0 ({_span(lo, hi)})"
                        )
                lo, hi = ranges[n]
                if lo < _INT32[0] or hi > _INT32[1]:
                    return f"an integer value (%{n}) may not fit in int32 ({lo}..{hi})"
            if node.op == "load":
                shape = self.tensors[node.value].shape
                for d, a in enumerate(node.args):
                    lo, hi = ranges[a]
                    if lo < -shape[d] or hi >= shape[d]:
                        return (
                            f"index {d} of captured tensor {node.value} {tuple(shape)} may be "
                            f"out of range ({_span(lo, hi)} for size {shape[d]})"
                        )
        return None

    def int_ranges(
        self, B: int, H: int, T: int, S: int, q_base: int = 0, k_base: int = 0
    ) -> dict[int, tuple[float, float]]:
        """``{node: (lo, hi)}``: bounds of every int and bool node (floats: unbounded)."""
        inputs = {
            "b": (0, B - 1),
            "h": (0, H - 1),
            "q_idx": (q_base, q_base + T - 1),
            "kv_idx": (k_base, k_base + S - 1),
        }
        out: dict[int, tuple[float, float]] = {}
        for n, node in enumerate(self.nodes):
            out[n] = _range(node, [out[a] for a in node.args], inputs, self.tensors)
        return out

    # -- evaluation (a reference interpreter) --------------------------------------------
    def evaluate(
        self,
        score: torch.Tensor | None,
        b: torch.Tensor,
        h: torch.Tensor,
        q_idx: torch.Tensor,
        kv_idx: torch.Tensor,
        *,
        int_dtype: torch.dtype = torch.int64,
    ) -> torch.Tensor:
        """The graph on broadcastable tensors (e.g. index grids ``(b, 1, 1, 1)``, ...), with
        torch ops: the output, differentiable in ``score`` and in the captured tensors.
        Floats are computed in ``score``'s dtype (float32 for a mask graph); ints in
        ``int_dtype`` (``torch.int32`` only where :meth:`check` proved they fit: faster)."""
        fdt = score.dtype if score is not None else torch.float32
        env = {"score": score, "b": b, "h": h, "q_idx": q_idx, "kv_idx": kv_idx}
        vals: list[Any] = []
        for node in self.nodes:
            args = [vals[a] for a in node.args]
            vals.append(_eval(node, args, env, self.tensors, fdt, int_dtype))
        return vals[self.output]


def _span(lo: float, hi: float) -> str:
    return f"{lo:g}..{hi:g}"


# ---------------------------------------------------------------------------------------
# Tracing
# ---------------------------------------------------------------------------------------

_TORCH_DTYPE = {"float": torch.float32, "int": torch.int64, "bool": torch.bool}


def _category(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_floating_point:
        return "float"
    if dtype.is_complex:
        raise Unsupported(f"complex values ({dtype})")
    return "int"


class _Tracer:
    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.tensors: list[torch.Tensor] = []
        self.slots: dict[int, int] = {}
        self.consts: dict[tuple, int] = {}

    def add(self, op: str, dtype: str, args: tuple[int, ...] = (), value: Any = None) -> _Sym:
        if op == "const":
            key = (type(value).__name__, value, dtype)
            if key not in self.consts:
                self.nodes.append(Node(op, dtype, (), value))
                self.consts[key] = len(self.nodes) - 1
            return _Sym(self, self.consts[key])
        self.nodes.append(Node(op, dtype, args, value))
        return _Sym(self, len(self.nodes) - 1)

    def slot(self, t: torch.Tensor) -> int:
        if t.device.type not in ("cpu", "cuda") or t.is_sparse or t.is_quantized:
            raise Unsupported(f"a captured tensor of layout/device {t.layout}/{t.device}")
        _category(t.dtype)
        if id(t) not in self.slots:
            self.slots[id(t)] = len(self.tensors)
            self.tensors.append(t)
        return self.slots[id(t)]

    # values -> nodes
    def node(self, x: Any) -> int:
        if isinstance(x, _Sym):
            if x.tracer is not self:
                raise Unsupported("a value traced from another mod")
            return x.id
        if isinstance(x, _View):
            raise Unsupported(
                f"a captured tensor indexed with {len(x.index)} of its {x.tensor.dim()} "
                "dimensions used as a value (a mod's values are scalars)"
            )
        if isinstance(x, bool):
            return self.add("const", "bool", value=x).id
        if isinstance(x, int):
            return self.add("const", "int", value=x).id
        if isinstance(x, float):
            return self.add("const", "float", value=x).id
        if isinstance(x, torch.Tensor):
            if x.dim() != 0:
                raise Unsupported(
                    f"a captured tensor of shape {tuple(x.shape)} used without indexing "
                    "(index it down to one value)"
                )
            slot = self.slot(x)
            return self.add("load", _category(x.dtype), (), slot).id
        raise Unsupported(f"a value of type {type(x).__name__}")

    def dtype(self, n: int) -> str:
        return self.nodes[n].dtype

    def cast(self, n: int, dtype: str) -> int:
        if self.dtype(n) == dtype:
            return n
        node = self.nodes[n]
        if node.op == "const":
            py = {"float": float, "int": int, "bool": bool}[dtype]
            return self.add("const", dtype, value=py(node.value)).id
        return self.add("cast", dtype, (n,)).id

    # ops
    def unary(self, op: str, x: Any) -> _Sym:
        n = self.node(x)
        dt = self.dtype(n)
        if op in ("neg", "abs"):
            if dt == "bool":
                raise Unsupported(f"{op} of a bool")
            return self.add(op, dt, (n,))
        if op == "not":
            if dt != "bool":
                raise Unsupported("~ of an integer (bitwise not); only bools are supported")
            return self.add(op, "bool", (n,))
        if op in ("floor", "ceil", "trunc", "round") and dt != "float":
            return _Sym(self, n)  # integral already
        return self.add(op, "float", (self.cast(n, "float"),))

    def binary(self, op: str, x: Any, y: Any) -> _Sym:
        a, b = self.node(x), self.node(y)
        da, db = self.dtype(a), self.dtype(b)
        if op in ("and", "or", "xor"):
            if da != "bool" or db != "bool":
                raise Unsupported(f"bitwise {op} of integers; only bools are supported")
            return self.add(op, "bool", (a, b))
        if op in ("eq", "ne", "lt", "le", "gt", "ge"):
            dt = _promote(da, db)
            return self.add(op, "bool", (self.cast(a, dt), self.cast(b, dt)))
        if op in ("add", "sub", "mul", "min", "max", "floordiv", "mod", "pow"):
            if da == db == "bool" and op not in ("min", "max"):
                raise Unsupported(f"{op} of two bools")
            dt = _promote(da, db, "int")
            if op == "pow" and dt == "int":
                raise Unsupported("integer ** (use floats)")
        elif op == "div":
            dt = "float"
        else:  # pragma: no cover - every op is listed above
            raise Unsupported(op)
        return self.add(op, dt, (self.cast(a, dt), self.cast(b, dt)))

    def where(self, cond: Any, x: Any, y: Any) -> _Sym:
        c, a, b = self.node(cond), self.node(x), self.node(y)
        c = self.cast(c, "bool")
        dt = _promote(self.dtype(a), self.dtype(b))
        return self.add("where", dt, (c, self.cast(a, dt), self.cast(b, dt)))

    def load(self, t: torch.Tensor, index: tuple[Any, ...]) -> _Sym | _View:
        return _View(self, t, ()).getitem(index)


def _promote(a: str, b: str, least: str = "bool") -> str:
    return DTYPES[max(DTYPES.index(a), DTYPES.index(b), DTYPES.index(least))]


class _View:
    """A captured tensor indexed along its first dimensions (``t[h]`` of a 2-d ``t``)."""

    def __init__(self, tracer: _Tracer, tensor: torch.Tensor, index: tuple[int, ...]) -> None:
        self.tracer, self.tensor, self.index = tracer, tensor, index

    def getitem(self, index: Any) -> _Sym | _View:
        parts = index if isinstance(index, tuple) else (index,)
        nodes = list(self.index)
        for p in parts:
            if isinstance(p, (slice, type(Ellipsis))) or p is None:
                raise Unsupported(f"indexing a captured tensor with {p!r} (only scalar indices)")
            if isinstance(p, torch.Tensor) and p.dim() != 0:
                raise Unsupported("indexing a captured tensor with a tensor of indices")
            n = self.tracer.node(p)
            if self.tracer.dtype(n) == "float":
                raise Unsupported("a float index (cast it with .long())")
            nodes.append(self.tracer.cast(n, "int"))
        if len(nodes) > self.tensor.dim():
            raise Unsupported(
                f"{len(nodes)} indices for a captured tensor of shape {tuple(self.tensor.shape)}"
            )
        if len(nodes) < self.tensor.dim():
            return _View(self.tracer, self.tensor, tuple(nodes))
        slot = self.tracer.slot(self.tensor)
        return self.tracer.add("load", _category(self.tensor.dtype), tuple(nodes), slot)

    def __getitem__(self, index: Any) -> _Sym | _View:
        return self.getitem(index)

    def __getattr__(self, name: str) -> Any:
        raise Unsupported(f"{name} on a partly indexed captured tensor")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise Unsupported(
            f"{getattr(func, '__name__', func)} on a partly indexed captured tensor "
            "(reductions and tensor-valued ops are not supported)"
        )


def _const_like(x: Any, value: Any, dtype: Any = None) -> _Sym:
    tr = x.tracer
    cat = x.dtype_name if dtype is None else _category(dtype)
    py = {"float": float, "int": int, "bool": bool}[cat]
    return tr.add("const", cat, value=py(value))


def _dtype_arg(args: tuple, kwargs: dict) -> Any:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.dtype):
            return a
    return None


def _to(x: _Sym, *args: Any, **kwargs: Any) -> _Sym:
    dtype = _dtype_arg(args, kwargs)
    if dtype is None:
        return x  # .to(device): the same value
    return _Sym(x.tracer, x.tracer.cast(x.id, _category(dtype)))


def _clamp(x: Any, min: Any = None, max: Any = None) -> _Sym:
    tr = _tracer_of(x, min, max)
    out = x
    if min is not None:
        out = tr.binary("max", out, min)
    if max is not None:
        out = tr.binary("min", out, max)
    return out if isinstance(out, _Sym) else _Sym(tr, tr.node(out))


def _addcmul(x: Any, a: Any, b: Any, *, value: Any = 1) -> _Sym:
    tr = _tracer_of(x, a, b)
    return tr.binary("add", x, tr.binary("mul", value, tr.binary("mul", a, b)))


def _addcdiv(x: Any, a: Any, b: Any, *, value: Any = 1) -> _Sym:
    tr = _tracer_of(x, a, b)
    return tr.binary("add", x, tr.binary("mul", value, tr.binary("div", a, b)))


def _tracer_of(*xs: Any) -> _Tracer:
    for x in xs:
        if isinstance(x, (_Sym, _View)):
            return x.tracer
    raise Unsupported("no traced value")  # pragma: no cover - dispatch needs one


def _un(op: str) -> Callable[..., _Sym]:
    return lambda x, *a, **k: _tracer_of(x).unary(op, x)


def _bin(op: str, swap: bool = False) -> Callable[..., _Sym]:
    if swap:
        return lambda x, y, *a, **k: _tracer_of(x, y).binary(op, y, x)
    return lambda x, y, *a, **k: _tracer_of(x, y).binary(op, x, y)


def _cast(dtype: str) -> Callable[..., _Sym]:
    return lambda x, *a, **k: _Sym(x.tracer, x.tracer.cast(x.id, dtype))


def _like(value: Any) -> Callable[..., _Sym]:
    def make(x: Any, *args: Any, **kwargs: Any) -> _Sym:
        dtype = kwargs.get("dtype")
        v = value if value is not None else (args[0] if args else kwargs["fill_value"])
        return _const_like(x, v, dtype)

    return make


def _sigmoid_like(x: Any) -> _Sym:
    return _tracer_of(x).unary("sigmoid", x)


def _square(x: Any) -> _Sym:
    return _tracer_of(x).binary("mul", x, x)


def _where(cond: Any, x: Any, y: Any) -> _Sym:
    return _tracer_of(cond, x, y).where(cond, x, y)


def _tensor_where(x: Any, cond: Any, y: Any) -> _Sym:
    return _tracer_of(cond, x, y).where(cond, x, y)


def _getitem(t: Any, index: Any) -> _Sym | _View:
    if isinstance(t, torch.Tensor):
        return _tracer_of(*(index if isinstance(index, tuple) else (index,))).load(t, index)
    raise Unsupported("indexing a traced scalar")


def _table() -> dict[Any, Callable[..., Any]]:
    T = torch.Tensor
    table: dict[Any, Callable[..., Any]] = {}
    names = {
        "neg": ("neg", "negative", "__neg__"),
        "abs": ("abs", "abs_", "absolute", "__abs__"),
        "exp": ("exp", "exp_"),
        "log": ("log", "log_"),
        "tanh": ("tanh", "tanh_"),
        "sigmoid": ("sigmoid", "sigmoid_"),
        "sqrt": ("sqrt", "sqrt_"),
        "rsqrt": ("rsqrt",),
        "sin": ("sin",),
        "cos": ("cos",),
        "floor": ("floor",),
        "ceil": ("ceil",),
        "trunc": ("trunc", "fix"),
        "round": ("round",),
        "not": ("logical_not", "bitwise_not", "__invert__"),
    }
    for op, fns in names.items():
        for fn in fns:
            for owner in (torch, T):
                if hasattr(owner, fn):
                    table[getattr(owner, fn)] = _un(op)
    binaries = {
        "add": ("add", "__add__", "__iadd__"),
        "sub": ("sub", "subtract", "__sub__", "__isub__"),
        "mul": ("mul", "multiply", "__mul__", "__imul__"),
        "div": ("div", "divide", "true_divide", "__truediv__", "__itruediv__"),
        "floordiv": ("floor_divide", "__floordiv__"),
        "mod": ("remainder", "__mod__"),
        "pow": ("pow", "__pow__"),
        "min": ("minimum", "fmin"),
        "max": ("maximum", "fmax"),
        "eq": ("eq", "__eq__"),
        "ne": ("ne", "not_equal", "__ne__"),
        "lt": ("lt", "less", "__lt__"),
        "le": ("le", "less_equal", "__le__"),
        "gt": ("gt", "greater", "__gt__"),
        "ge": ("ge", "greater_equal", "__ge__"),
        "and": ("logical_and", "bitwise_and", "__and__", "__iand__"),
        "or": ("logical_or", "bitwise_or", "__or__", "__ior__"),
        "xor": ("logical_xor", "bitwise_xor", "__xor__"),
    }
    for op, fns in binaries.items():
        for fn in fns:
            for owner in (torch, T):
                if hasattr(owner, fn):
                    table[getattr(owner, fn)] = _bin(op)
    for op, fn in (
        ("add", "__radd__"), ("sub", "__rsub__"), ("mul", "__rmul__"), ("div", "__rtruediv__"),
        ("floordiv", "__rfloordiv__"), ("mod", "__rmod__"), ("pow", "__rpow__"),
        ("and", "__rand__"), ("or", "__ror__"), ("xor", "__rxor__"),
    ):  # fmt: skip
        table[getattr(T, fn)] = _bin(op, swap=True)
    table[torch.rsub] = _bin("sub", swap=True)
    table[torch.where] = _where
    table[T.where] = _tensor_where
    for clamp in (torch.clamp, torch.clip, T.clamp, T.clip):
        table[clamp] = _clamp
    table[torch.addcmul] = table[T.addcmul] = _addcmul
    table[torch.addcdiv] = table[T.addcdiv] = _addcdiv
    table[torch.square] = table[T.square] = _square
    table[torch.nn.functional.sigmoid] = _sigmoid_like
    table[torch.nn.functional.tanh] = _un("tanh")
    table[T.float] = table[T.double] = table[T.half] = table[T.bfloat16] = _cast("float")
    table[T.int] = table[T.long] = table[T.short] = _cast("int")
    table[T.bool] = _cast("bool")
    table[T.to] = table[T.type_as] = _to
    table[torch.zeros_like] = _like(0)
    table[torch.ones_like] = _like(1)
    table[torch.full_like] = _like(None)
    table[T.__getitem__] = _getitem
    table[T.clone] = table[T.detach] = table[T.contiguous] = lambda x, *a, **k: x
    return table


_FUNCTIONS: dict[Any, Callable[..., Any]] | None = None


class _Sym:
    """A traced scalar: a node of the tracer's graph, behaving like a 0-d tensor."""

    __slots__ = ("id", "tracer")

    def __init__(self, tracer: _Tracer, id: int) -> None:
        self.tracer, self.id = tracer, id

    @property
    def dtype_name(self) -> str:
        return self.tracer.dtype(self.id)

    @property
    def dtype(self) -> torch.dtype:
        return _TORCH_DTYPE[self.dtype_name]

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def shape(self) -> torch.Size:
        return torch.Size([])

    def dim(self) -> int:
        return 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        global _FUNCTIONS
        if _FUNCTIONS is None:
            _FUNCTIONS = _table()
        fn = _FUNCTIONS.get(func)
        if fn is None:
            raise Unsupported(f"{_func_name(func)} is not in the supported set")
        return fn(*args, **(kwargs or {}))

    def __bool__(self) -> bool:
        raise Unsupported(
            "Python control flow on a traced value (if/and/or/not, min()/max() of Python): "
            "use torch.where, &, |, ~, torch.minimum/maximum"
        )

    def __index__(self) -> int:
        raise Unsupported("a traced value used as a Python integer")

    def __int__(self) -> int:
        raise Unsupported("a traced value used as a Python integer")

    def __float__(self) -> float:
        raise Unsupported("a traced value used as a Python float (math.* functions)")

    def __getitem__(self, index: Any) -> Any:
        raise Unsupported("indexing a scalar value")

    def __getattr__(self, name: str) -> Any:
        fn = getattr(torch.Tensor, name, None)
        if fn is None:
            raise AttributeError(name)
        return lambda *args, **kwargs: _Sym.__torch_function__(fn, (), (self, *args), kwargs)

    def __repr__(self) -> str:
        return f"<traced %{self.id} {self.dtype_name}>"

    __hash__ = object.__hash__


def _func_name(func: Any) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    if getattr(torch, name, None) is func:
        return f"torch.{name}"
    if getattr(torch.Tensor, name, None) is func:
        return f"Tensor.{name}"
    if getattr(torch.nn.functional, name, None) is func:
        return f"torch.nn.functional.{name}"
    return getattr(func, "__qualname__", name)


def _install_operators() -> None:
    pairs = {
        "__add__": operator.add, "__sub__": operator.sub, "__mul__": operator.mul,
        "__truediv__": operator.truediv, "__floordiv__": operator.floordiv,
        "__mod__": operator.mod, "__pow__": operator.pow, "__and__": operator.and_,
        "__or__": operator.or_, "__xor__": operator.xor, "__eq__": operator.eq,
        "__ne__": operator.ne, "__lt__": operator.lt, "__le__": operator.le,
        "__gt__": operator.gt, "__ge__": operator.ge,
    }  # fmt: skip
    for name in pairs:

        def fwd(self: _Sym, other: Any, _name: str = name) -> Any:
            return _Sym.__torch_function__(getattr(torch.Tensor, _name), (), (self, other))

        setattr(_Sym, name, fwd)
        rname = "__r" + name[2:]
        if hasattr(torch.Tensor, rname):

            def rev(self: _Sym, other: Any, _name: str = rname) -> Any:
                return _Sym.__torch_function__(getattr(torch.Tensor, _name), (), (self, other))

            setattr(_Sym, rname, rev)
    for name in ("__neg__", "__abs__", "__invert__"):

        def un(self: _Sym, _name: str = name) -> Any:
            return _Sym.__torch_function__(getattr(torch.Tensor, _name), (), (self,))

        setattr(_Sym, name, un)


_install_operators()


def trace(mod: Callable[..., Any], kind: str = "score") -> ModGraph:
    """Trace ``mod`` (a ``score_mod`` for ``kind="score"``, a ``mask_mod`` for ``"mask"``)
    into a :class:`ModGraph`, calling it once on symbolic scalars.

    Raises:
        Unsupported: with the reason, when the mod does something outside :data:`OPS`.
        ValueError: for a ``kind`` other than ``"score"`` or ``"mask"``.
    """
    if kind not in ("score", "mask"):
        raise ValueError(f"kind must be 'score' or 'mask', got {kind!r}")
    tr = _Tracer()
    names = INPUTS if kind == "score" else INPUTS[1:]
    syms = [tr.add("input", "float" if n == "score" else "int", value=n) for n in names]
    try:
        out = mod(*syms)
    except Unsupported:
        raise
    except Exception as err:  # the mod did something the tracer cannot follow
        raise Unsupported(f"tracing failed: {type(err).__name__}: {err}") from err
    n = tr.node(out)
    if kind == "score":
        if tr.dtype(n) != "float":
            raise Unsupported(f"the score_mod returns a {tr.dtype(n)} value, not a float score")
    else:
        n = tr.cast(n, "bool")
    return ModGraph(kind, tuple(tr.nodes), n, tuple(tr.tensors), _name(mod))


def _name(mod: Any) -> str:
    name = getattr(mod, "__qualname__", None) or getattr(mod, "__name__", None)
    return name if isinstance(name, str) else type(mod).__name__


# ---------------------------------------------------------------------------------------
# The cache
# ---------------------------------------------------------------------------------------

_CACHE: weakref.WeakKeyDictionary[Any, dict[tuple, ModGraph | Unsupported]] = (
    weakref.WeakKeyDictionary()
)
_PER_MOD = 4


def traced(mod: Callable[..., Any], kind: str = "score") -> ModGraph | Unsupported:
    """:func:`trace` of ``mod``, or the :class:`Unsupported` it raised, cached per mod
    object (weakly) and the state it captures (closure values, globals, tensors at their
    versions: :mod:`attnkit.block_mask_cache`'s key). A mod whose state cannot be keyed
    (or that cannot be weakly referenced) is traced every call."""
    try:
        key = (kind, _state(mod))
        per_mod = _CACHE.setdefault(mod, {})
    except (_Uncacheable, TypeError):
        return _trace_or_reason(mod, kind)
    hit = per_mod.get(key)
    if hit is None:
        hit = _trace_or_reason(mod, kind)
        if len(per_mod) >= _PER_MOD:
            per_mod.pop(next(iter(per_mod)))
        per_mod[key] = hit
    return hit


def _trace_or_reason(mod: Callable[..., Any], kind: str) -> ModGraph | Unsupported:
    try:
        return trace(mod, kind)
    except Unsupported as why:
        return why


def clear_cache() -> None:
    """Forget every traced mod (tests)."""
    _CACHE.clear()


# ---------------------------------------------------------------------------------------
# Interval arithmetic and the reference interpreter
# ---------------------------------------------------------------------------------------

_INF = math.inf


def _range(
    node: Node,
    args: Sequence[tuple[float, float]],
    inputs: dict[str, tuple[int, int]],
    tensors: Sequence[torch.Tensor],
) -> tuple[float, float]:
    op = node.op
    if node.dtype == "bool":
        return (0, 1)
    if node.dtype == "float":
        return (-_INF, _INF)
    if op == "input":
        return inputs[node.value]
    if op == "const":
        return (node.value, node.value)
    if op == "load":
        t = tensors[node.value]
        if t.numel() == 0:
            return (0, 0)
        return (int(t.min()), int(t.max()))
    if op == "cast":
        return args[0]  # to int: from a bool (0..1) or a float (unbounded)
    if op == "neg":
        return (-args[0][1], -args[0][0])
    if op == "abs":
        lo, hi = args[0]
        return (0 if lo <= 0 <= hi else min(abs(lo), abs(hi)), max(abs(lo), abs(hi)))
    if op in ("add", "sub", "mul", "min", "max"):
        (a, b), (c, d) = args
        if op == "add":
            return (a + c, b + d)
        if op == "sub":
            return (a - d, b - c)
        if op == "min":
            return (min(a, c), min(b, d))
        if op == "max":
            return (max(a, c), max(b, d))
        prods = [x * y for x in (a, b) for y in (c, d) if not math.isnan(x * y)]
        return (min(prods), max(prods))
    if op == "floordiv":
        (a, b), (c, d) = args
        if c <= 0 <= d:
            return (-_INF, _INF)
        qs = [x // y for x in (a, b) for y in (c, d) if math.isfinite(x) and math.isfinite(y)]
        return (min(qs), max(qs)) if len(qs) == 4 else (-_INF, _INF)
    if op == "mod":
        (c, d) = args[1]
        if c > 0:
            return (0, d - 1)
        if d < 0:
            return (c + 1, 0)
        return (-_INF, _INF)
    if op == "where":
        (_, _), (a, b), (c, d) = args
        return (min(a, c), max(b, d))
    return (-_INF, _INF)


_TORCH_UNARY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "neg": torch.neg,
    "abs": torch.abs,
    "exp": torch.exp,
    "log": torch.log,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt,
    "sin": torch.sin,
    "cos": torch.cos,
    "floor": torch.floor,
    "ceil": torch.ceil,
    "trunc": torch.trunc,
    "round": torch.round,
    "not": torch.logical_not,
}
_TORCH_BINARY: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "div": torch.div,
    "floordiv": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "mod": torch.remainder,
    "pow": torch.pow,
    "min": torch.minimum,
    "max": torch.maximum,
    "eq": torch.eq,
    "ne": torch.ne,
    "lt": torch.lt,
    "le": torch.le,
    "gt": torch.gt,
    "ge": torch.ge,
    "and": torch.logical_and,
    "or": torch.logical_or,
    "xor": torch.logical_xor,
}


def _eval(
    node: Node,
    args: list[Any],
    env: dict[str, Any],
    tensors: Sequence[torch.Tensor],
    fdt: torch.dtype,
    idt: torch.dtype = torch.int64,
) -> torch.Tensor:
    want = {"float": fdt, "int": idt, "bool": torch.bool}[node.dtype]
    if node.op == "input":
        return env[node.value]
    if node.op == "const":
        return torch.tensor(node.value, dtype=want)
    if node.op == "load":
        t = tensors[node.value]
        out = t[tuple(args)] if args else t
        return out.to(want)
    if node.op == "cast":
        return args[0].to(want)
    if node.op in _TORCH_UNARY:
        return _TORCH_UNARY[node.op](args[0])
    if node.op in _TORCH_BINARY:
        return _TORCH_BINARY[node.op](args[0], args[1]).to(want)
    if node.op == "where":
        return torch.where(args[0], args[1], args[2])
    raise ValueError(f"unknown op {node.op!r}")  # pragma: no cover
