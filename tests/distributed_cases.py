"""The cases run on spawned gloo ranks by tests/test_distributed.py (see distributed_harness).

Every case draws float64 inputs on rank 0, broadcasts them, runs the distributed call
on this rank's shards, unshards, and compares with single-process ``attnkit.attention``
on the whole sequence. It returns the largest absolute differences; the tests assert.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import attnkit
from attnkit import masks
from attnkit.distributed import (
    context_parallel_attention,
    record_traffic,
    shard,
    unshard,
)

MASKS = ("full", "causal", "causal_gqa", "mqa", "window", "window_sym", "documents", "alibi")
HAS_LSE = "return_lse" in inspect.signature(attnkit.attention).parameters


def _bcast(*tensors: torch.Tensor) -> None:
    for t in tensors:
        dist.broadcast(t, 0)


def _doc_ids(t: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(t)
    cuts = torch.rand(t, generator=g) < 0.25
    cuts[0] = False
    return torch.cumsum(cuts.long(), 0)  # (t,) increasing document ids


def _options(kind: str, t: int, h_q: int) -> dict[str, Any]:
    if kind in ("causal", "causal_gqa", "mqa"):
        return {"causal": True}
    if kind == "window":
        return {"causal": True, "window": 3}
    if kind == "window_sym":
        return {"window": 4}
    if kind == "documents":
        return {"causal": True, "mask_mod": masks.document(_doc_ids(t))}
    if kind == "alibi":
        return {"causal": True, "score_mod": masks.alibi(h_q)}
    return {}


def _ref_lse(q, k, opts: dict[str, Any]) -> torch.Tensor:
    """Log-sum-exp of the masked scores, written out densely (independent of attnkit)."""
    _b, h, t, d = q.shape
    k = k.repeat_interleave(h // k.shape[1], 1)
    s = torch.einsum("bhtd,bhsd->bhts", q, k) / math.sqrt(d)
    i = torch.arange(t).view(-1, 1)
    j = torch.arange(t).view(1, -1)
    keep = torch.ones(t, t, dtype=torch.bool)
    if opts.get("causal"):
        keep &= j <= i
    if opts.get("window") is not None:
        w = opts["window"]
        keep &= (j > i - w) & ((j <= i) if opts.get("causal") else (j < i + w))
    if "mask_mod" in opts:
        ids = _doc_ids(t)
        keep &= ids.view(-1, 1) == ids.view(1, -1)
    if "score_mod" in opts:
        slopes = masks.alibi_slopes(h).double().view(1, h, 1, 1)
        s = s - slopes * (i - j).abs()
    return torch.logsumexp(s.masked_fill(~keep, float("-inf")), -1)


def attention_case(strategy: str, layout: str, kind: str, t: int):
    def run(rank: int, world: int) -> dict[str, Any]:
        b, h_q, d = 2, 6, 8
        h_kv = {"causal_gqa": 2, "mqa": 1}.get(kind, h_q)
        g = torch.Generator().manual_seed(t * 7 + len(kind))
        q, k, v, gout = (
            torch.randn(b, hh, t, d, generator=g, dtype=torch.float64)
            for hh in (h_q, h_kv, h_kv, h_q)
        )
        glse = torch.randn(b, h_q, t, generator=g, dtype=torch.float64)
        _bcast(q, k, v, gout, glse)
        opts = _options(kind, t, h_q)
        want_lse = strategy == "ring" or HAS_LSE
        # single process, whole sequence
        qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
        ref = attnkit.attention(qr, kr, vr, **opts)
        (ref * gout).sum().backward()
        # distributed
        ql, kl, vl = (shard(x, 2, layout=layout).requires_grad_(True) for x in (q, k, v))
        res = context_parallel_attention(
            ql, kl, vl, layout=layout, strategy=strategy, return_lse=want_lse, **opts
        )
        out_l, lse_l = res if want_lse else (res, None)
        (out_l * shard(gout, 2, layout=layout)).sum().backward()
        errs = {
            "out": (unshard(out_l.detach(), 2, layout=layout) - ref.detach()).abs().max().item(),
            "dq": (unshard(ql.grad, 2, layout=layout) - qr.grad).abs().max().item(),
            "dk": (unshard(kl.grad, 2, layout=layout) - kr.grad).abs().max().item(),
            "dv": (unshard(vl.grad, 2, layout=layout) - vr.grad).abs().max().item(),
            "local_len": ql.shape[2],
        }
        if lse_l is not None:
            full = unshard(lse_l.detach(), 2, layout=layout)
            errs["lse"] = (full - _ref_lse(q, k, opts)).abs().max().item()
        return errs

    return run


def lse_grad_case(strategy: str, layout: str):
    """A loss on the log-sum-exp too: its gradient reaches q and k."""

    def run(rank: int, world: int) -> dict[str, Any]:
        b, h, t, d = 1, 6, 4 * world + 1, 8
        g = torch.Generator().manual_seed(5)
        q, k, v, gout = (
            torch.randn(b, h, t, d, generator=g, dtype=torch.float64) for _ in range(4)
        )
        glse = torch.randn(b, h, t, generator=g, dtype=torch.float64)
        _bcast(q, k, v, gout, glse)
        qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
        ref = attnkit.attention(qr, kr, vr, causal=True)
        lse_ref = _ref_lse(qr, kr, {"causal": True})
        ((ref * gout).sum() + (lse_ref * glse).sum()).backward()
        ql, kl, vl = (shard(x, 2, layout=layout).requires_grad_(True) for x in (q, k, v))
        out_l, lse_l = context_parallel_attention(
            ql, kl, vl, layout=layout, strategy=strategy, causal=True, return_lse=True
        )
        loss = (out_l * shard(gout, 2, layout=layout)).sum()
        (loss + (lse_l * shard(glse, 2, layout=layout)).sum()).backward()
        return {
            name: (unshard(a.grad, 2, layout=layout) - r.grad).abs().max().item()
            for name, a, r in (("dq", ql, qr), ("dk", kl, kr), ("dv", vl, vr))
        }

    return run


def sinks_case(strategy: str):
    def run(rank: int, world: int) -> dict[str, Any]:
        b, h, t, d = 1, 6, 6 * world, 8
        g = torch.Generator().manual_seed(11)
        q, k, v, gout = (
            torch.randn(b, h, t, d, generator=g, dtype=torch.float64) for _ in range(4)
        )
        sinks = torch.randn(h, generator=g, dtype=torch.float64)
        _bcast(q, k, v, gout, sinks)
        qr, kr, vr, sr = (x.clone().requires_grad_(True) for x in (q, k, v, sinks))
        # the sink as one extra key of score `sink` and value 0, written out here
        s = torch.einsum("bhtd,bhsd->bhts", qr, kr) / math.sqrt(d)
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        s = torch.cat([s, sr.view(1, h, 1, 1).expand(b, h, t, 1)], -1)
        ref = torch.softmax(s, -1)[..., :t] @ vr
        (ref * gout).sum().backward()
        ql, kl, vl = (shard(x, 2).requires_grad_(True) for x in (q, k, v))
        sl = sinks.clone().requires_grad_(True)
        out_l = context_parallel_attention(ql, kl, vl, strategy=strategy, causal=True, sinks=sl)
        (out_l * shard(gout, 2)).sum().backward()
        d_sinks = sl.grad.clone()
        dist.all_reduce(d_sinks)
        return {
            "out": (unshard(out_l.detach(), 2) - ref.detach()).abs().max().item(),
            "dq": (unshard(ql.grad, 2) - qr.grad).abs().max().item(),
            "dk": (unshard(kl.grad, 2) - kr.grad).abs().max().item(),
            "dv": (unshard(vl.grad, 2) - vr.grad).abs().max().item(),
            "dsinks": (d_sinks - sr.grad).abs().max().item(),
        }

    return run


#: Piece size of the traffic and memory cases: pieces end inside chunks and at their edges.
TRAFFIC_TILE = 3


def with_tile(tile: int, inner):
    """``inner`` run with the ring's tiles (query tiles and K/V pieces) of ``tile`` positions."""

    def run(rank: int, world: int) -> dict[str, Any]:
        from attnkit.distributed import ring_plan

        saved, ring_plan.TILE = ring_plan.TILE, tile
        try:
            return inner(rank, world)
        finally:
            ring_plan.TILE = saved

    return run


def traffic_case(layout: str, kind: str):
    """Messages ``(piece, step, peer, bytes)`` each rank sends, forward and backward,
    with pieces of :data:`TRAFFIC_TILE` positions."""

    def run(rank: int, world: int) -> dict[str, Any]:
        b, h, t, d = 1, 2, 8 * world, 4
        q, k, v = (torch.randn(b, h, t, d, dtype=torch.float64) for _ in range(3))
        _bcast(q, k, v)
        opts = {"causal": {"causal": True}, "full": {}, "window": {"causal": True, "window": 2}}[
            kind
        ]
        ql, kl, vl = (shard(x, 2, layout=layout).requires_grad_(True) for x in (q, k, v))
        with record_traffic() as log:
            out = context_parallel_attention(ql, kl, vl, layout=layout, **opts)
            out.sum().backward()

        def msgs(kind: str, phase: str | None = None) -> list[tuple[int, int, int, int]]:
            return [(m.piece, m.step, m.peer, m.nbytes) for m in log.select(kind, phase)]

        return {
            "kv_forward": msgs("kv", "forward"),
            "kv_backward": msgs("kv", "backward"),
            "dkv": msgs("dkv"),
            "shard_bytes": (kl.numel() + vl.numel()) * kl.element_size(),
            "rank": rank,
        }

    def gather(rank: int, world: int) -> dict[str, Any]:
        mine = with_tile(TRAFFIC_TILE, run)(rank, world)
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, mine)
        return {"ranks": everyone}

    return gather


def a2a_traffic_case(rank: int, world: int) -> dict[str, Any]:
    """Bytes the all-to-all strategy sends per rank and pass (even lengths, heads split
    evenly): every re-shard sends (W-1)/W of a shard-sized tensor."""
    b, h, t, d = 1, 2 * world, 4 * world, 4
    q, k, v = (torch.randn(b, h, t, d, dtype=torch.float64) for _ in range(3))
    _bcast(q, k, v)
    ql, kl, vl = (shard(x, 2).requires_grad_(True) for x in (q, k, v))
    with record_traffic() as log:
        out = context_parallel_attention(ql, kl, vl, strategy="all_to_all", causal=True)
        out.sum().backward()
    return {
        "forward": log.nbytes("a2a", "forward"),
        "backward": log.nbytes("a2a", "backward"),
        "messages": log.count("a2a"),
        "shard_bytes": ql.numel() * ql.element_size(),
    }


def memory_case(rank: int, world: int) -> dict[str, Any]:
    """The K/V and dK/dV buffers a rank holds at once, seen at every exchange (a spy on
    ``ring.exchange`` keeps weak references to every tensor sent or received): with
    tiles of 8 positions (pieces of 16: one tile of each zigzag chunk) in shards of 128,
    a few pieces, never a shard-sized block."""
    import weakref

    from attnkit.distributed import ring

    live: list[weakref.ref] = []
    seen = {"peak_bytes": 0, "longest": 0, "exchanges": 0}
    real = ring.exchange

    def spy(sends, recvs, **kw):
        for tensors, _, _ in (*sends, *recvs):
            for x in tensors:
                live.append(weakref.ref(x))
                seen["longest"] = max(seen["longest"], x.shape[2])
        # by identity: a received piece sent on is the same tensor (contiguous() is itself)
        alive = {id(x): x for x in (ref() for ref in live) if x is not None}
        seen["peak_bytes"] = max(seen["peak_bytes"], sum(x.nbytes for x in alive.values()))
        seen["exchanges"] += 1
        return real(sends, recvs, **kw)

    b, h, t, d = 1, 2, 128 * world, 8
    g = torch.Generator().manual_seed(2)
    q, k, v, gout = (torch.randn(b, h, t, d, generator=g, dtype=torch.float64) for _ in range(4))
    _bcast(q, k, v, gout)
    ql, kl, vl = (shard(x, 2).requires_grad_(True) for x in (q, k, v))

    def step(rank: int, world: int) -> dict[str, Any]:
        out = context_parallel_attention(ql, kl, vl, causal=True)
        (out * shard(gout, 2)).sum().backward()
        return {}

    ring.exchange = spy
    try:
        with_tile(8, step)(rank, world)
    finally:
        ring.exchange = real
    piece_bytes = 2 * b * h * 16 * d * 8  # one K/V piece of 16 positions: its k and its v
    return {**seen, "piece_bytes": piece_bytes, "shard_bytes": 2 * kl.nbytes}


def refusal_case(rank: int, world: int) -> dict[str, Any]:
    """Clear errors, raised identically on every rank."""
    out: dict[str, Any] = {}
    q = torch.zeros(1, world + 1, 2 * world, 4)
    try:
        context_parallel_attention(q, q, q, strategy="all_to_all")
    except ValueError as err:
        out["heads"] = str(err)
    try:
        shard(torch.zeros(2 * world - 1), 0)
    except ValueError as err:
        out["short"] = str(err)
    # lengths where contiguous and zigzag shards differ: W=2, T=7 gives 4+3 vs 3+4
    x = shard(torch.zeros({2: 7, 3: 16}[world], 3), 0, layout="contiguous")
    try:
        unshard(x, 0, layout="zigzag")
    except ValueError as err:
        out["layout_mismatch"] = str(err)
    try:
        context_parallel_attention(q, q, q, strategy="rings")
    except ValueError as err:
        out["strategy"] = str(err)
    try:
        context_parallel_attention(q, q, q, window=True)
    except TypeError as err:
        out["window_bool"] = str(err)
    slopes = torch.ones(world + 1, requires_grad=True)
    try:
        context_parallel_attention(q, q, q, score_mod=masks.alibi(world + 1, slopes))
    except ValueError as err:
        out["ring_mod_grad"] = str(err)
    return out


def unshard_grad_case(rank: int, world: int) -> dict[str, Any]:
    """unshard is a gather: the gradient is the sum over ranks of theirs."""
    x = torch.arange(5.0 * world, dtype=torch.float64)
    xl = shard(x, 0).requires_grad_(True)
    full = unshard(xl, 0)
    weights = torch.arange(5.0 * world, dtype=torch.float64) * (rank + 1)
    (full * weights).sum().backward()
    expected = shard(torch.arange(5.0 * world, dtype=torch.float64), 0) * sum(range(1, world + 1))
    return {
        "roundtrip": (full.detach() - x).abs().max().item(),
        "grad": (xl.grad - expected).abs().max().item(),
        "positions": shard(torch.arange(5 * world), 0).tolist(),
    }


def low_precision_case(strategy: str, dtype: torch.dtype):
    """flash-attn's rule: error against float64 at most 2x plain math's in the same dtype."""

    def run(rank: int, world: int) -> dict[str, Any]:
        b, h_q, h_kv, t, d = 2, 6, 2, 24 * world + 5, 16
        g = torch.Generator().manual_seed(21)
        q, k, v, gout = (
            torch.randn(b, hh, t, d, generator=g, dtype=torch.float64)
            for hh in (h_q, h_kv, h_kv, h_q)
        )
        _bcast(q, k, v, gout)

        def plain(q, k, v):  # the same math, written out, in the inputs' dtype
            kk, vv = (x.repeat_interleave(h_q // h_kv, 1) for x in (k, v))
            s = (q @ kk.transpose(-2, -1)) / math.sqrt(d)
            s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
            return torch.softmax(s.float(), -1).to(q.dtype) @ vv

        def grads(fn, dt, ranks=1):
            xs = [x.detach().to(dt).clone().requires_grad_(True) for x in (q, k, v)]
            out = fn(*xs)
            # every rank computes the same loss on the unsharded output: unshard's
            # gradient sums the ranks' (a gather), so each counts 1/W
            ((out.double() * gout).sum() / ranks).backward()
            if ranks > 1:  # each rank's full-size grads hold its own positions only
                for x in xs:
                    dist.all_reduce(x.grad)
            return [out.detach().double()] + [x.grad.double() for x in xs]

        exact = grads(plain, torch.float64)
        base = grads(plain, dtype)

        def ours(qf, kf, vf):
            ql, kl, vl = (shard(x, 2) for x in (qf, kf, vf))
            out_l = context_parallel_attention(ql, kl, vl, strategy=strategy, causal=True)
            return unshard(out_l, 2)

        mine = grads(ours, dtype, world)
        names = ("out", "dq", "dk", "dv")
        return {
            n: ((m - e).abs().max().item(), (p - e).abs().max().item())
            for n, m, p, e in zip(names, mine, base, exact, strict=True)
        }

    return run


def small_tiles_case(kind: str):
    """The ring with tiles of 2 positions: every chunk pair is cut into many calls."""
    return with_tile(2, attention_case("ring", "zigzag", kind, 31))


#: Kinds of the pieces cases: every mask path, GQA/MQA, a mod.
PIECE_KINDS = ("full", "causal_gqa", "mqa", "window", "window_sym", "documents", "alibi")


def piece_length(world: int) -> int:
    """A length whose shards hold different numbers of pieces of 3-position tiles
    (contiguous: 7 positions, pieces 3+3+1, and 6, pieces 3+3; zigzag: chunks of 4,
    two tiles, and of 3, one)."""
    return 7 * world - 1


def pieces_suite(world: int) -> dict[str, Any]:
    """The ring with pieces of 3 positions (crossing chunk edges, ranks holding different
    numbers of pieces): exactness, sinks, the lse gradient, traffic and memory."""
    cases: dict[str, Any] = {}
    for layout in ("zigzag", "contiguous"):
        for kind in PIECE_KINDS:
            inner = attention_case("ring", layout, kind, piece_length(world))
            cases[f"pieces-{layout}-{kind}"] = with_tile(3, inner)
        cases[f"pieces-lse_grad-{layout}"] = with_tile(3, lse_grad_case("ring", layout))
    cases["pieces-sinks"] = with_tile(3, sinks_case("ring"))
    for layout in ("zigzag", "contiguous"):
        for kind in ("full", "causal", "window"):
            cases[f"traffic-{layout}-{kind}"] = traffic_case(layout, kind)
    cases["memory"] = memory_case
    return cases


def lengths_for(world: int) -> dict[str, int]:
    """Lengths per world size: W = 3 runs the uneven one only (start-up dominates the
    suite's time, but three ranks on two cores make every case slower)."""
    if world == 3:
        return {"uneven": 4 * world + 3}
    return {"even": 6 * world, "uneven": 4 * world + 3}


def attention_suite(world: int) -> dict[str, Any]:
    cases: dict[str, Any] = {}
    for strategy in ("ring", "all_to_all"):
        for layout in ("zigzag", "contiguous"):
            for kind in MASKS:
                for lname, t in lengths_for(world).items():
                    cases[f"{strategy}-{layout}-{kind}-{lname}"] = attention_case(
                        strategy, layout, kind, t
                    )
            cases[f"lse_grad-{strategy}-{layout}"] = lse_grad_case(strategy, layout)
        cases[f"sinks-{strategy}"] = sinks_case(strategy)
        for dtype in (torch.float32, torch.bfloat16):
            if world == 2:
                cases[f"dtype-{strategy}-{dtype}"] = low_precision_case(strategy, dtype)
    for kind in ("causal_gqa", "window", "documents"):
        cases[f"tiles-{kind}"] = small_tiles_case(kind)
    cases.update(pieces_suite(world))
    cases["traffic-a2a"] = a2a_traffic_case
    cases["refusals"] = refusal_case
    cases["unshard_grad"] = unshard_grad_case
    if world == 2:  # the GPT steps ride on the same spawn: start-up dominates
        cases.update(gpt_suite(world))
    return cases


def gpt_case(strategy: str, layout: str, **cfg_overrides: Any):
    """A GPT's loss and gradients with the sequence split equal one process's; so do
    the parameters after two steps of the training loops."""

    def run(rank: int, world: int) -> dict[str, Any]:
        from attnkit.models import GPT, GPTConfig
        from attnkit.train import train
        from attnkit.train.context_parallel import (
            all_reduce_grads,
            sharded_loss,
            train_context_parallel,
        )
        from attnkit.train.data import IGNORE

        torch.manual_seed(3)
        cfg = GPTConfig(
            vocab_size=19, context_length=32, emb_dim=24, n_layers=2, n_heads=6, **cfg_overrides
        )
        model = GPT(cfg).double()
        ref = GPT(cfg).double()
        ref.load_state_dict(model.state_dict())
        t = 4 * world + 3  # not a multiple of 2W
        g = torch.Generator().manual_seed(4)
        inputs = torch.randint(0, 19, (2, t), generator=g)
        targets = torch.randint(0, 19, (2, t), generator=g)
        targets[:, : t // 3] = IGNORE  # only part of each sequence is scored
        _bcast(inputs, targets)
        logits = ref(inputs)
        loss_ref = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
        loss_ref.backward()
        loss, value = sharded_loss(model, inputs, targets, strategy=strategy, layout=layout)
        loss.backward()
        all_reduce_grads(model)
        grad_err = max(
            (p.grad - r.grad).abs().max().item()
            for p, r in zip(model.parameters(), ref.parameters(), strict=True)
        )
        # two steps of each training loop from the same weights
        model.load_state_dict(ref.state_dict())

        def batches():
            return inputs, targets

        cp_losses = train_context_parallel(
            model, batches, 2, strategy=strategy, layout=layout, progress=False
        )
        ref_losses = train(ref, batches, 2, progress=False)
        param_err = max(
            (p - r).abs().max().item()
            for p, r in zip(model.parameters(), ref.parameters(), strict=True)
        )
        return {
            "loss": abs(value - loss_ref.item()),
            "grad": grad_err,
            "losses": max(abs(a - b) for a, b in zip(cp_losses, ref_losses, strict=True)),
            "params": param_err,
        }

    return run


GPT_VARIANTS = {
    "plain": {},
    "rope_gqa_window": {"rope": True, "n_kv_heads": 2, "window": 5},
    # local/global layers with learned sinks: the per-layer window and the layer's sinks
    # reach the attention function the model hands down (AttentionInputs.attend)
    "local_global_sinks": {"rope": True, "window": 3, "global_every": 2, "attn_sinks": True},
}


def gpt_suite(world: int) -> dict[str, Any]:
    return {
        f"gpt-{strategy}-{layout}-{name}": gpt_case(strategy, layout, **opts)
        for strategy in ("ring", "all_to_all")
        for layout in ("zigzag", "contiguous")
        for name, opts in GPT_VARIANTS.items()
    }
