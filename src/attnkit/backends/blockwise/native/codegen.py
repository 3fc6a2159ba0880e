"""A traced ``score_mod`` (:class:`attnkit.mod_graph.ModGraph`) as C++ row functions the
native kernel calls in-tile, forward and backward.

The graph becomes a small library of its own (``simd.h`` vectors, built with the kernel's
flags for its ISA, cached and loaded under :func:`.build.build_generated`'s rules), not a
rebuild of the kernel: a new mod costs one compile of a few dozen lines (about 0.35 s,
against 2.8 s of CPU time for the kernel, on a Zen 5 VM), and one indirect call per chunk
row of 64 scores is noise. It
exports two functions the kernel reaches through ``Args.mod_forward`` / ``mod_backward``:

* ``forward(ctx, b, h, i, c0, x, y)``: ``y[0..64) = score_mod(x, b, h, q_base + i,
  k_base + kv)``, ``x`` row ``i``'s scaled scores of keys ``c0 ..``;
* ``backward(ctx, b, h, i, c0, x, g, dgrad)``: ``g`` (the gradient of the modded scores)
  replaced by ``g * d mod / d score`` and ``g * d mod / d t`` added into ``dgrad`` for every
  captured tensor ``t`` that wants a gradient (reverse mode over the graph; lanes with
  ``g == 0``, which the softmax gave no weight, add nothing).

Values that depend only on ``b, h, q_idx`` are computed once per row as scalars; the rest
on ``W``-wide vectors. Keys past the last are computed at the last key (never an index out
of range); :meth:`ModGraph.check` proves every int fits in int32 and every load index is
in range for the call's sizes, else the call is not compiled. A load whose last index is
``kv_idx`` plus a row value reads a vector at once; others gather lane by lane.
Captured tensors are passed as contiguous float32 / int32 / uint8 copies; their sizes,
strides and gradient offsets come with the call (``ModCtx.layout``), so a mod over a
tensor of another length (a document-id vector of a longer batch) reuses the library.
Floats are computed in float32; a division by a constant is a product with its float32
reciprocal (within an ulp of the quotient).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from attnkit.backends.blockwise.native.build import build_generated, selected_isa
from attnkit.mod_graph import ModGraph, Node

if TYPE_CHECKING:  # (mask_codegen builds on this module)
    from attnkit.backends.blockwise.native.mask_codegen import CompiledMask

__all__ = ["CompiledMod", "ModCall", "compile_mod", "generate", "source"]

#: ``attnkit_mod_abi()`` of a generated library: bumped when the row functions change.
MOD_ABI = 3
#: The most doubles of captured-tensor gradient partials a backward may hold (one per
#: backward task; above it the tile engine takes the backward).
MAX_GRAD_PARTIALS = 1 << 25


class _Ctx(ctypes.Structure):
    """``struct ModCtx`` of the generated source."""

    _fields_ = [
        ("tensors", ctypes.POINTER(ctypes.c_void_p)),
        ("last_key", ctypes.c_int64),
        ("q_base", ctypes.c_int64),
        ("k_base", ctypes.c_int64),
        ("layout", ctypes.POINTER(ctypes.c_int64)),
    ]


_PRELUDE = r"""
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include "simd.h"

namespace {
using simd::vf;
using simd::vi;
using simd::W;
constexpr int KC = 64, NV = KC / W;
constexpr float INF = std::numeric_limits<float>::infinity();
constexpr float NAN_ = std::numeric_limits<float>::quiet_NaN();

struct ModCtx {
  const void *const *tensors;  // captured tensors by slot: contiguous copies
  int64_t last_key, q_base, k_base;
  // per captured tensor (by slot): its sizes, then its strides; then each one's offset
  // into dgrad (codegen.layout)
  const int64_t *layout;
};

inline vi isplat(int32_t x) { return vi{} + x; }
inline vi bsplat(bool x) { return vi{} + int32_t(x ? -1 : 0); }
inline vf fsplat(float x) { return simd::splat(x); }
template <class V> inline V vmin(V a, V b) { return a < b ? a : b; }
template <class V> inline V vmax(V a, V b) { return a > b ? a : b; }
template <class V> inline V vabs(V a) { return a < 0 ? -a : a; }
inline float smin(float a, float b) { return a < b ? a : b; }
inline float smax(float a, float b) { return a > b ? a : b; }
inline int32_t smin(int32_t a, int32_t b) { return a < b ? a : b; }
inline int32_t smax(int32_t a, int32_t b) { return a > b ? a : b; }
// Python's floor division and modulo (torch's for ints): rounded toward -inf
inline vi vfloordiv(vi a, vi b) { vi q = a / b; vi r = a - q * b; return q + ((r != 0) & ((r ^ b) < 0)); }
inline vi vmod(vi a, vi b) { vi r = a % b; return r + (((r != 0) & ((r ^ b) < 0)) & b); }
inline int32_t sfloordiv(int32_t a, int32_t b) { int32_t q = a / b, r = a % b; return q - ((r != 0) && ((r ^ b) < 0)); }
inline int32_t smod(int32_t a, int32_t b) { int32_t r = a % b; return r + (((r != 0) && ((r ^ b) < 0)) ? b : 0); }
inline float sfmod(float a, float b) { return a - std::floor(a / b) * b; }
template <class F> inline vf lanewise(vf x, F f) { vf r; for (int l = 0; l < W; ++l) r[l] = f(x[l]); return r; }
template <class F> inline vf lanewise2(vf x, vf y, F f) { vf r; for (int l = 0; l < W; ++l) r[l] = f(x[l], y[l]); return r; }
inline vf vexp(vf x) { return simd::select(x > 88.72f, fsplat(INF), simd::exp(x)); }
inline float sexp(float x) { return std::exp(x); }
// tanh: x + x^3 P(x^2) for |x| < 0.625 (Cephes' tanhf), else sign(x) (1 - t) / (1 + t) with
// t = e^-2|x| (vectors all inside |x| < 0.625, a softcap's usual case, skip the exp)
inline vf vtanh(vf x) {
  const vf ax = vabs(x), z = x * x;
  vf p = fsplat(-5.70498872745e-3f);
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const vf small = p * z * x + x;
  if (simd::hmax(ax) < 0.625f) return small;  // (a NaN lane gives NaN either way)
  const vi inside = ax < 0.625f;
  const vf t = simd::exp(-2.0f * ax);
  vf big = (1.0f - t) / (1.0f + t);
  big = simd::select(x < 0, -big, big);
  return simd::select(inside, small, big);
}
inline vf vsigmoid(vf x) { return 1.0f / (1.0f + vexp(-x)); }
inline float ssigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline vf vfloor(vf x) { return lanewise(x, [](float v) { return std::floor(v); }); }
}  // namespace

#define MOD_EXPORT extern "C" __attribute__((visibility("default")))
"""


def _flt(x: float) -> str:
    if math.isnan(x):
        return "NAN_"
    if math.isinf(x):
        return "INF" if x > 0 else "(-INF)"
    return f"float({float(x).hex()})"


def layout(copies: list[torch.Tensor], grad_slots: dict[int, int]) -> list[int]:
    """``ModCtx.layout`` of a call: each captured tensor's kernel copy's sizes then its
    strides, in slot order, then each slot's offset into the gradient buffer (0: none)."""
    out: list[int] = []
    for t in copies:
        out += [*t.shape, *t.stride()]
    return out + [grad_slots.get(slot, 0) for slot in range(len(copies))]


@dataclass
class _Gen:
    graph: ModGraph
    wraps: set[int]  # (node, dim) packed as node * 64 + dim: indices that may be negative
    grad_slots: dict[int, int]  # slot -> offset into dgrad
    exact: bool = False  # a mask: every float op as torch rounds it (no reciprocal products)
    lane: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.at: list[int] = [0]  # where each slot's sizes start in ModCtx.layout
        for t in self.graph.tensors:
            self.at.append(self.at[-1] + 2 * t.dim())
        for node in self.graph.nodes:
            varying = node.op == "input" and node.value in ("score", "kv_idx")
            self.lane.append(varying or any(self.lane[a] for a in node.args))

    # -- names and types ---------------------------------------------------------------
    def name(self, n: int) -> str:
        return f"{'v' if self.lane[n] else 'r'}{n}"

    def ctype(self, n: int) -> str:
        dt = self.graph.nodes[n].dtype
        if self.lane[n]:
            return "vf" if dt == "float" else "vi"
        return {"float": "float", "int": "int32_t", "bool": "bool"}[dt]

    def vec(self, n: int) -> str:
        """Node n's value as a vector (row values splat)."""
        if self.lane[n]:
            return self.name(n)
        dt = self.graph.nodes[n].dtype
        return {"float": "fsplat", "int": "isplat", "bool": "bsplat"}[dt] + f"({self.name(n)})"

    def tensor_type(self, slot: int) -> str:
        t = self.graph.tensors[slot]
        if t.dtype == torch.bool:
            return "uint8_t"
        return "float" if t.is_floating_point() else "int32_t"

    # -- expressions -------------------------------------------------------------------
    def expr(self, n: int) -> str:
        node = self.graph.nodes[n]
        lane = self.lane[n]
        a = [self.vec(x) if lane else self.name(x) for x in node.args]
        op, dt = node.op, node.dtype
        if op == "input":
            return {"b": "int32_t(b_)", "h": "int32_t(h_)", "q_idx": "q_"}[node.value]
        if op == "const":
            if dt == "float":
                return _flt(node.value)
            return (
                f"int32_t({int(node.value)})"
                if dt == "int"
                else ("true" if node.value else "false")
            )
        inv = self.const_divisor(n) if op == "div" and lane and not self.exact else None
        if inv is not None:  # by a constant: times its float32 reciprocal (within an ulp)
            return f"({a[0]} * {_flt(inv)})"
        if op in ("add", "sub", "mul", "div"):
            sym = {"add": "+", "sub": "-", "mul": "*", "div": "/"}[op]
            return f"({a[0]} {sym} {a[1]})"
        if op in ("eq", "ne", "lt", "le", "gt", "ge"):
            sym = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}[op]
            return f"({a[0]} {sym} {a[1]})"
        if op in ("and", "or", "xor"):
            sym = {"and": "&", "or": "|", "xor": "^"}[op]
            return f"({a[0]} {sym} {a[1]})"
        if op == "not":
            return f"(~{a[0]})" if lane else f"(!{a[0]})"
        if op == "neg":
            return f"(-{a[0]})"
        if op in ("min", "max"):
            return f"{'v' if lane else 's'}{op}({a[0]}, {a[1]})"
        if op == "abs":
            return f"vabs({a[0]})" if lane else f"({a[0]} < 0 ? -{a[0]} : {a[0]})"
        if op == "floordiv":
            if dt == "int":
                return f"{'v' if lane else 's'}floordiv({a[0]}, {a[1]})"
            return f"vfloor({a[0]} / {a[1]})" if lane else f"std::floor({a[0]} / {a[1]})"
        if op == "mod":
            if dt == "int":
                return f"{'v' if lane else 's'}mod({a[0]}, {a[1]})"
            return (
                f"({a[0]} - vfloor({a[0]} / {a[1]}) * {a[1]})" if lane else f"sfmod({a[0]}, {a[1]})"
            )
        if op == "pow":
            if lane:
                return (
                    f"lanewise2({a[0]}, {a[1]}, [](float x, float y) {{ return std::pow(x, y); }})"
                )
            return f"std::pow({a[0]}, {a[1]})"
        if op == "where":
            if lane:
                return f"({a[0]} ? {a[1]} : {a[2]})"
            return f"({a[0]} ? {a[1]} : {a[2]})"
        if op == "cast":
            return self.cast(node, a[0], lane)
        if op == "load":
            raise AssertionError("loads are emitted as statements")
        return self.unary(op, a[0], lane)

    def const_divisor(self, n: int) -> float | None:
        """``1 / c`` (float32) for a division by a finite nonzero float constant ``c``."""
        node = self.graph.nodes[self.graph.nodes[n].args[1]]
        if node.op != "const" or not math.isfinite(node.value) or node.value == 0:
            return None
        one = torch.tensor(1.0, dtype=torch.float32)
        inv = float(one / torch.tensor(node.value, dtype=torch.float32))
        return inv if math.isfinite(inv) and inv != 0 else None

    def cast(self, node: Node, x: str, lane: bool) -> str:
        src = self.graph.nodes[node.args[0]].dtype
        dst = node.dtype
        if not lane:
            if dst == "bool":
                return f"({x} != 0)"
            return f"{'float' if dst == 'float' else 'int32_t'}({x})"
        if dst == "bool":
            return f"({x} != 0)"
        if src == "bool":
            x = f"(-{x})"  # masks are -1: 1
            return x if dst == "int" else f"__builtin_convertvector({x}, vf)"
        return f"__builtin_convertvector({x}, {'vf' if dst == 'float' else 'vi'})"

    def unary(self, op: str, x: str, lane: bool) -> str:
        scalar = {
            "exp": "std::exp", "log": "std::log", "tanh": "std::tanh", "sigmoid": "ssigmoid",
            "sqrt": "std::sqrt", "sin": "std::sin", "cos": "std::cos", "floor": "std::floor",
            "ceil": "std::ceil", "trunc": "std::trunc", "round": "std::nearbyint",
        }  # fmt: skip
        if op == "rsqrt":
            return f"(1.0f / {self.unary('sqrt', x, lane)})"
        if not lane:
            return f"{scalar[op]}({x})"
        if op == "exp":
            return f"vexp({x})"
        if op == "tanh":
            return f"vtanh({x})"
        if op == "sigmoid":
            return f"vsigmoid({x})"
        return f"lanewise({x}, [](float v) {{ return {scalar[op]}(v); }})"

    # -- loads -------------------------------------------------------------------------
    def strides(self, slot: int) -> list[str]:
        return [f"s{slot}_{d}" for d in range(self.graph.tensors[slot].dim())]

    def layout_values(self) -> list[str]:
        """Statements naming the call's sizes ``n{slot}_{dim}``, strides ``s{slot}_{dim}``
        and gradient offsets ``gb{slot}`` (``ModCtx.layout``; locals, so no store in the
        loops can alias them)."""
        tensors = self.graph.tensors
        total = self.at[-1]
        lines = ["const int64_t *const L_ = ctx.layout; (void)L_;"]
        for slot, t in enumerate(tensors):
            nd, at = t.dim(), self.at[slot]
            for d in range(nd):
                lines.append(
                    f"const int64_t n{slot}_{d} = L_[{at + d}], s{slot}_{d} = L_[{at + nd + d}];"
                    f" (void)n{slot}_{d}; (void)s{slot}_{d};"
                )
            if slot in self.grad_slots:
                lines.append(f"const int64_t gb{slot} = L_[{total + slot}];")
        return lines

    def index(self, n: int, d: int, at: str) -> str:
        """Load n's index d as int64 (lane ``at`` of a vector index, or the row value)."""
        node = self.graph.nodes[n]
        x = node.args[d]
        v = f"{self.name(x)}[{at}]" if self.lane[x] else self.name(x)
        if n * 64 + d in self.wraps:
            size = f"n{node.value}_{d}"
            return f"(int64_t({v}) + ({v} < 0 ? {size} : 0))"
        return f"int64_t({v})"

    def offset(self, n: int, at: str) -> str:
        node = self.graph.nodes[n]
        st = self.strides(node.value)
        parts = [f"{self.index(n, d, at)} * {st[d]}" for d in range(len(node.args))]
        return " + ".join(parts) or "0"

    def affine_kv(self, n: int) -> str | None:
        """``kv_idx + row`` as the row part's C++ expression, or None."""
        node = self.graph.nodes[n]
        if node.op == "input" and node.value == "kv_idx":
            return "0"
        if node.op in ("add", "sub") and node.dtype == "int":
            x, y = node.args
            if self.lane[x] and not self.lane[y]:
                inner = self.affine_kv(x)
                sym = "+" if node.op == "add" else "-"
                return None if inner is None else f"({inner} {sym} int64_t({self.name(y)}))"
            if node.op == "add" and self.lane[y] and not self.lane[x]:
                inner = self.affine_kv(y)
                return None if inner is None else f"({inner} + int64_t({self.name(x)}))"
        return None

    def contiguous(self, n: int) -> str | None:
        """For a lane load whose last index is ``kv_idx`` plus a row value (no wrap) and
        whose other indices are row values, that row value's C++ (a whole vector of keys
        then reads W consecutive elements); else None."""
        node = self.graph.nodes[n]
        last = len(node.args) - 1
        if last < 0 or self.graph.tensors[node.value].dtype == torch.bool:
            return None
        if any(self.lane[a] for a in node.args[:last]) or n * 64 + last in self.wraps:
            return None
        return self.affine_kv(node.args[last])

    def load(self, n: int, lines: list[str], offsets: bool) -> None:
        node = self.graph.nodes[n]
        slot = node.value
        ptr = f"static_cast<const {self.tensor_type(slot)} *>(ctx.tensors[{slot}])"
        conv = "!= 0 ? -1 : 0" if self.graph.tensors[slot].dtype == torch.bool else ""
        if not self.lane[n]:
            val = f"{ptr}[{self.offset(n, '')}]"
            val = f"({val} != 0)" if conv else val
            lines.append(f"const {self.ctype(n)} {self.name(n)} = {val};")
            return
        name = self.name(n)
        lines.append(f"{self.ctype(n)} {name};")
        if offsets:
            lines.append(f"int64_t o{n}[W];")
        gather = [
            "for (int l = 0; l < W; ++l) {",
            f"  const int64_t o = {self.offset(n, 'l')};",
            *([f"  o{n}[l] = o;"] if offsets else []),
            f"  {name}[l] = {ptr}[o]{' ' + conv if conv else ''};",
            "}",
        ]
        row_part = self.contiguous(n)
        if row_part is None or offsets:
            lines.extend(gather)
            return
        st = self.strides(slot)
        last = len(node.args) - 1
        head = " + ".join([f"{self.index(n, d, '')} * {st[d]}" for d in range(last)] or ["0"])
        lines.append("if (whole) {")
        lines.append(f"  std::memcpy(&{name}, {ptr} + {head} + kv0 + {row_part}, sizeof {name});")
        lines.append("} else {")
        lines.extend("  " + x for x in gather)
        lines.append("}")

    # -- functions ---------------------------------------------------------------------
    def values(self, rows: bool, offsets: bool) -> list[str]:
        """Statements computing the live nodes: the row ones (rows) or the lane ones."""
        lines: list[str] = []
        for n in self.graph.live():
            if self.lane[n] == rows:
                continue
            node = self.graph.nodes[n]
            if node.op == "input" and node.value == "score":
                lines.append(f"const vf {self.name(n)} = simd::load(x + W * vv);")
            elif node.op == "input" and node.value == "kv_idx":
                lines.append(f"const vi {self.name(n)} = kv;")
            elif node.op == "load":
                self.load(n, lines, offsets and node.value in self.grad_slots)
            else:
                lines.append(f"const {self.ctype(n)} {self.name(n)} = {self.expr(n)};")
        return lines

    def header(self, name: str, args: str) -> list[str]:
        return [
            f"MOD_EXPORT void {name}(const void *ctx_, int64_t b_, int64_t h_, int64_t i_, "
            f"int64_t c0, {args}) {{",
            "  const ModCtx &ctx = *static_cast<const ModCtx *>(ctx_);",
            "  const int32_t q_ = int32_t(ctx.q_base + i_);",
            "  (void)b_; (void)h_; (void)q_;",
            *("  " + x for x in self.layout_values()),
        ]

    def loop_head(self) -> list[str]:
        return [
            "  for (int vv = 0; vv < NV; ++vv) {",
            "    const int64_t j0 = c0 + W * vv;  // the vector's first key",
            "    const bool whole = j0 + W - 1 <= ctx.last_key; (void)whole;",
            "    const int64_t kv0 = ctx.k_base + j0; (void)kv0;",
            "    const vi kv = isplat(int32_t(ctx.k_base)) + "
            "vmin(isplat(int32_t(j0)) + simd::lanes(), isplat(int32_t(ctx.last_key)));",
            "    (void)kv;",
        ]

    def forward(self) -> str:
        out = self.header("attnkit_mod_forward", "const float *x, float *y")
        out += ["  " + s for s in self.values(rows=True, offsets=False)]
        out += self.loop_head()
        out += ["    " + s for s in self.values(rows=False, offsets=False)]
        out += [f"    simd::store(y + W * vv, {self.vec(self.graph.output)});", "  }", "}"]
        return "\n".join(out)

    def mask_row(self, b_used: bool, h_used: bool) -> str:
        """``attnkit_mask_row(ctx, b, h, i, c0, keep)``: ``keep[0..KC)`` = the mask_mod's
        bool for query ``q_base + i`` and keys ``k_base + c0 ..`` (as 1 / 0 bytes). ``b`` /
        ``h`` read as 0 where the block mask does not depend on them (FlexAttention's
        ``B=None`` / ``H=None``: the mod sees index 0)."""
        out = self.header("attnkit_mask_row", "uint8_t *keep")
        out[3:3] = [f"  {x}_ = 0;" for x, used in (("b", b_used), ("h", h_used)) if not used]
        out += ["  " + s for s in self.values(rows=True, offsets=False)]
        out += self.loop_head()
        out += ["    " + s for s in self.values(rows=False, offsets=False)]
        out += [
            f"    const vi keep_v = {self.vec(self.graph.output)};",
            "    for (int l = 0; l < W; ++l) keep[W * vv + l] = uint8_t(keep_v[l] != 0);",
            "  }",
            "}",
        ]
        return "\n".join(out)

    def differentiable(self) -> list[bool]:
        diff: list[bool] = []
        for node in self.graph.nodes:
            if node.op == "input":
                d = node.value == "score"
            elif node.op == "load":
                d = node.value in self.grad_slots
            elif node.dtype != "float" or node.op in ("floor", "ceil", "trunc", "round", "cast"):
                d = False
            else:
                d = any(diff[a] for a in node.args)
            diff.append(d)
        return diff

    def backward(self) -> str:
        g = self.graph
        diff = self.differentiable()
        live = g.live()
        need = [n for n in live if diff[n]]
        out = self.header("attnkit_mod_backward", "const float *x, float *grad, double *dgrad")
        out += ["  (void)dgrad;"]
        out += ["  " + s for s in self.values(rows=True, offsets=False)]
        row_loads = [n for n in need if g.nodes[n].op == "load" and not self.lane[n]]
        out += [f"  double acc{n} = 0.0;" for n in row_loads]
        out += self.loop_head()
        out += ["    " + s for s in self.values(rows=False, offsets=True)]
        out += ["    const vf dy = simd::load(grad + W * vv);", "    const vi live = dy != 0;"]
        out += [f"    vf a{n} = fsplat(0.0f);" for n in need if n != g.output]
        if diff[g.output]:
            out += [f"    vf a{g.output} = dy;"]
        for n in reversed(need):
            out += ["    " + s for s in self.adjoint(n, diff)]
        score = next((n for n in need if g.nodes[n].op == "input"), None)
        d_score = "fsplat(0.0f)" if score is None else f"simd::select(live, a{score}, fsplat(0.0f))"
        out += [f"    simd::store(grad + W * vv, {d_score});"]
        for n in need:
            node = g.nodes[n]
            if node.op != "load":
                continue
            base = f"gb{node.value}"
            if self.lane[n]:  # lanes the softmax gave no weight add 0; o{n} in order if whole
                out += [
                    f"    const vf g{n} = simd::select(live, a{n}, fsplat(0.0f));",
                    f"    if ({'whole' if self.contiguous(n) is not None else 'false'}) {{",
                    f"      double *d = dgrad + {base} + o{n}[0];",
                    f"      for (int l = 0; l < W; ++l) d[l] += double(g{n}[l]);",
                    "    } else {",
                    f"      for (int l = 0; l < W; ++l) dgrad[{base} + o{n}[l]] += double(g{n}[l]);",
                    "    }",
                ]
            else:
                out += [f"    acc{n} += simd::hsum(simd::select(live, a{n}, fsplat(0.0f)));"]
        out += ["  }"]
        for n in row_loads:
            base = f"gb{g.nodes[n].value}"
            out += [f"  dgrad[{base} + {self.offset(n, '')}] += acc{n};"]
        out += ["}"]
        return "\n".join(out)

    def adjoint(self, n: int, diff: list[bool]) -> list[str]:
        """Statements adding node n's adjoint ``a{n}`` into its arguments'."""
        node = self.graph.nodes[n]
        args = node.args
        if node.op in ("input", "load", "const") or not args:
            return []
        an = f"a{n}"
        v = [self.vec(x) for x in args]
        r = self.vec(n)
        terms: list[tuple[int, str]] = []
        op = node.op
        if op == "add":
            terms = [(args[0], an), (args[1], an)]
        elif op == "sub":
            terms = [(args[0], an), (args[1], f"-{an}")]
        elif op == "mul":
            terms = [(args[0], f"{an} * {v[1]}"), (args[1], f"{an} * {v[0]}")]
        elif op == "div":
            terms = [(args[0], f"{an} / {v[1]}"), (args[1], f"-{an} * {r} / {v[1]}")]
        elif op == "neg":
            terms = [(args[0], f"-{an}")]
        elif op == "abs":
            x = v[0]
            terms = [(args[0], f"({x} > 0 ? {an} : ({x} < 0 ? -{an} : fsplat(0.0f)))")]
        elif op == "exp":
            terms = [(args[0], f"{an} * {r}")]
        elif op == "log":
            terms = [(args[0], f"{an} / {v[0]}")]
        elif op == "tanh":
            terms = [(args[0], f"{an} * (1.0f - {r} * {r})")]
        elif op == "sigmoid":
            terms = [(args[0], f"{an} * {r} * (1.0f - {r})")]
        elif op == "sqrt":
            terms = [(args[0], f"{an} * 0.5f / {r}")]
        elif op == "rsqrt":
            terms = [(args[0], f"{an} * -0.5f * {r} / {v[0]}")]
        elif op == "sin":
            terms = [(args[0], f"{an} * {self.unary('cos', v[0], True)}")]
        elif op == "cos":
            terms = [(args[0], f"-{an} * {self.unary('sin', v[0], True)}")]
        elif op == "pow":
            x, y = v
            powm1 = f"lanewise2({x}, {y} - 1.0f, [](float p, float q) {{ return std::pow(p, q); }})"
            logx = self.unary("log", x, True)
            terms = [(args[0], f"{an} * {y} * {powm1}"), (args[1], f"{an} * {r} * {logx}")]
        elif op in ("min", "max"):
            x, y = v
            first = f"({x} < {y})" if op == "min" else f"({x} > {y})"
            second = f"({y} < {x})" if op == "min" else f"({y} > {x})"
            half = f"({x} == {y} ? {an} * 0.5f : fsplat(0.0f))"
            terms = [
                (args[0], f"({first} ? {an} : {half})"),
                (args[1], f"({second} ? {an} : {half})"),
            ]
        elif op == "where":
            c = v[0]
            terms = [
                (args[1], f"({c} ? {an} : fsplat(0.0f))"),
                (args[2], f"({c} ? fsplat(0.0f) : {an})"),
            ]
        return [f"a{x} += {t};" for x, t in terms if diff[x]]


def source(graph: ModGraph, wraps: set[int], grad_slots: dict[int, int]) -> str:
    """The C++ of ``graph``'s row functions (see the module docs)."""
    gen = _Gen(graph, wraps, grad_slots)
    lines = [
        f"// generated by attnkit.backends.blockwise.native.codegen from {graph.name!r}",
        _PRELUDE,
        f"MOD_EXPORT int64_t attnkit_mod_abi() {{ return {MOD_ABI}; }}",
        gen.forward(),
        gen.backward(),
        "",
    ]
    return "\n".join(lines)


def library_check(what: str, abi: str, *entries: str) -> Callable[[ctypes.CDLL], str | None]:
    """The load check of a generated library (``build_generated``'s ``check``): its
    ``abi`` function returns :data:`MOD_ABI` and it exports ``entries``; else why not."""

    def check(lib: ctypes.CDLL) -> str | None:
        try:
            getattr(lib, abi).restype = ctypes.c_int64
            version = getattr(lib, abi)()
            for name in entries:
                getattr(lib, name)
        except AttributeError as err:
            return f"a generated {what} library lacks an entry point ({err})"
        if version != MOD_ABI:
            return f"a generated {what} library of ABI {version}, not {MOD_ABI}"
        return None

    return check


_check_library = library_check(
    "score_mod", "attnkit_mod_abi", "attnkit_mod_forward", "attnkit_mod_backward"
)


@dataclass(frozen=True)
class CompiledMod:
    """A graph's row functions, loaded: their addresses, and where each gradient goes."""

    graph: ModGraph
    lib: ctypes.CDLL
    forward: int  # address of attnkit_mod_forward
    backward: int  # address of attnkit_mod_backward
    grad_slots: dict[int, int]  # slot -> offset in the gradient buffer
    ngrad: int  # doubles of gradient


_LIBS: dict[tuple[str, str], tuple[ctypes.CDLL | None, str]] = {}


def cached_library(
    text: str, kind: str, check: Callable[[ctypes.CDLL], str | None], isa: str | None
) -> tuple[ctypes.CDLL | None, str]:
    """The library of generated source ``text`` for ``isa`` (None: the selected build) and
    its build status, built once per source and ISA (:func:`.build.build_generated`; one
    cache for the score_mod and mask_mod libraries)."""
    key = (text, isa or selected_isa() or "")
    if key not in _LIBS:
        _LIBS[key] = build_generated(text, kind, check, isa)
    return _LIBS[key]


def _wraps(graph: ModGraph, ranges: dict[int, tuple[float, float]]) -> set[int]:
    out = set()
    for n in graph.live():
        node = graph.nodes[n]
        if node.op == "load":
            for d, a in enumerate(node.args):
                if ranges[a][0] < 0:
                    out.add(n * 64 + d)
    return out


def generate(
    graph: ModGraph, sizes: tuple[int, int, int, int, int, int]
) -> tuple[str, dict[int, int], int] | str:
    """``(C++ source, {slot: gradient offset}, gradient doubles)`` of ``graph`` for a call
    of ``sizes = (B, H, T, S, q_base, k_base)``, or why it cannot be generated."""
    why = graph.check(*sizes)
    if why is not None:
        return why
    if any(t.dim() > 6 for t in graph.tensors):
        return "a captured tensor of more than 6 dimensions"
    wraps = _wraps(graph, graph.int_ranges(*sizes))
    grad_slots: dict[int, int] = {}
    total = 0
    for slot in graph.grad_slots():
        grad_slots[slot] = total
        total += graph.tensors[slot].numel()
    return source(graph, wraps, grad_slots), grad_slots, total


def compile_mod(
    graph: ModGraph,
    sizes: tuple[int, int, int, int, int, int],
    isa: str | None = None,
) -> CompiledMod | str:
    """``graph`` compiled for a call of ``sizes = (B, H, T, S, q_base, k_base)`` (cached
    by its source), or why it cannot be (one line)."""
    generated = generate(graph, sizes)
    if isinstance(generated, str):
        return generated
    text, grad_slots, total = generated
    lib, status = cached_library(text, "score-mod", _check_library, isa)
    if lib is None:
        return f"the score_mod's generated code did not build: {status}"
    fwd = ctypes.cast(lib.attnkit_mod_forward, ctypes.c_void_p).value
    bwd = ctypes.cast(lib.attnkit_mod_backward, ctypes.c_void_p).value
    if fwd is None or bwd is None:
        return "the score_mod's generated library has no row functions"
    return CompiledMod(graph, lib, fwd, bwd, grad_slots, total)


class ModCall:
    """A compiled mod's context for one kernel call: the captured tensors' contiguous
    copies (float32 / int32 / uint8) and the ``ModCtx`` pointing at them, kept alive
    while the object lives."""

    def __init__(
        self, compiled: CompiledMod | CompiledMask, last_key: int, q_base: int, k_base: int
    ) -> None:
        self.compiled = compiled
        self.copies = [_kernel_copy(t) for t in compiled.graph.tensors]
        self.ptrs = (ctypes.c_void_p * max(1, len(self.copies)))(
            *(c.data_ptr() for c in self.copies)
        )
        grad_slots = compiled.grad_slots if isinstance(compiled, CompiledMod) else {}
        shape = layout(self.copies, grad_slots)
        self.layout = (ctypes.c_int64 * max(1, len(shape)))(*shape)
        self.ctx = _Ctx(
            ctypes.cast(self.ptrs, ctypes.POINTER(ctypes.c_void_p)),
            last_key,
            q_base,
            k_base,
            ctypes.cast(self.layout, ctypes.POINTER(ctypes.c_int64)),
        )

    @property
    def address(self) -> int:
        return ctypes.addressof(self.ctx)

    def gradients(self, dgrad: torch.Tensor) -> dict[int, torch.Tensor]:
        """``{slot: gradient}`` (each shaped and typed as its tensor) from the kernel's
        ``(ngrad,)`` float64 buffer."""
        out: dict[int, torch.Tensor] = {}
        if not isinstance(self.compiled, CompiledMod):  # a mask has no gradients
            return out
        for slot, at in self.compiled.grad_slots.items():
            t = self.compiled.graph.tensors[slot]
            out[slot] = dgrad[at : at + t.numel()].view(t.shape).to(t.dtype)
        return out


def _kernel_copy(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.dtype == torch.bool:
        return t.to(device="cpu", dtype=torch.uint8).contiguous()
    if t.is_floating_point():
        return t.to(device="cpu", dtype=torch.float32).contiguous()
    return t.to(device="cpu", dtype=torch.int32).contiguous()
