"""Compile the triton backend's kernels for a CUDA GPU on a machine without one.

Run as a script (``python tests/triton_compile_only.py [--arch 90] [--full]``, used by
``tests/test_triton_compile.py``): it drives real ``attention(..., backend="triton")``
calls, forward and backward, through Triton's own launch path with a stand-in driver
whose target is ``sm_<arch>``, in warm-up mode (compile, never launch), with the plans'
GPU settings (GPU tiles, libdevice, bf16 ``tl.dot``). Every kernel variant those calls
reach is compiled to PTX and cubin by the ptxas Triton ships, so whatever the
interpreter accepts and the compiler does not (a non-constexpr global, a type the
front end refuses, a shape or layout the back end cannot lower) fails here, in CI.

The tensors are CPU tensors whose contents are never computed: this proves that the
kernels compile, not what they compute (the interpreter tests and a GPU run do that).
Prints one line per call and ``compiled N kernels``; exits 1 naming the first failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: real JITFunctions

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime import driver
from triton.runtime.jit import JITFunction

COMPILED: list[str] = []


class CompileOnly(DriverBase):
    """A driver that names a CUDA target and launches nothing."""

    def __init__(self, arch: int) -> None:
        self.target = GPUTarget("cuda", arch, 32)

    @classmethod
    def is_active(cls) -> bool:
        return False

    def map_python_to_cpp_type(self, ty: str) -> str:  # pragma: no cover - launchers only
        raise NotImplementedError

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_benchmarker(self):  # pragma: no cover - autotuning only
        raise NotImplementedError

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


def install(arch: int) -> None:
    """Route every ``kernel[grid](...)`` to a compile of ``sm_<arch>`` code, and plans to
    the settings they take on a GPU."""
    driver.set_active(CompileOnly(arch))

    def compile_only(self, grid):
        def go(*args, **kwargs):
            kernel = self.run(*args, grid=grid, warmup=True, **kwargs)
            assert "cubin" in kernel.asm, f"{self.__name__}: no cubin"
            COMPILED.append(self.__name__)

        return go

    JITFunction.__getitem__ = compile_only  # type: ignore[method-assign]

    from attnkit.backends.triton import backend as TB

    assert not TB.interpreting(), "the kernels were defined for the interpreter"
    TB.interpreting = lambda: True  # CPU tensors accepted, standing in for CUDA ones
    build_plan = TB.build_plan

    def gpu_plan(call, q4):
        plan = build_plan(call, q4)
        d = max(q4.shape[-1], call.value.shape[-1])
        fwd, bwd = TB._blocks(d, interpret=False)
        return dataclasses.replace(plan, interpret=False, fwd_blocks=fwd, bwd_blocks=bwd)

    TB.build_plan = gpu_plan


def cases(full: bool) -> list[tuple[str, dict]]:
    """``(name, kwargs)`` calls between them reaching every kernel variant of the backend."""
    from attnkit import create_block_mask
    from attnkit import masks as M

    lq = lk = 80
    ids = torch.arange(lq) * 3 // lq

    def sliding(b, h, q, kv):
        return (kv <= q) & (q - kv < 24)

    def bias(score, b, h, q, kv):  # a generated score_mod with a captured table
        return score + table[h, (q - kv).clamp(0, 7)]

    table = torch.randn(4, 8, requires_grad=True)
    bm = create_block_mask(lambda b, h, q, kv: kv <= q, None, None, lq, lk, block_size=32)
    base = [
        ("dense", {}),
        ("window+sinks+lse", {"causal": True, "window": 9, "sinks": True, "lse": True}),
        ("bool mask", {"mask": torch.rand(1, 1, lq, lk) > 0.3}),
        ("float mask", {"mask": torch.randn(1, 4, lq, lk)}),
        ("alibi", {"score_mod": M.alibi(4, M.alibi_slopes(4).requires_grad_()), "causal": True}),
        ("softcap", {"score_mod": M.softcap(20.0)}),
        ("documents (generated mask)", {"mask_mod": M.and_masks(M.document(ids), M.causal("top_left"))}),
        ("block mask", {"block_mask": bm}),
        ("generated score_mod", {"score_mod": bias, "mask_mod": sliding}),
    ]  # fmt: skip
    if not full:  # one call per code path of the kernels, and float16 on the d=256 tiles
        # (a compile is about 4 s; float32's FMA-lowered ieee dot 25 s: --full only)
        return [
            (f"{name}, bfloat16, d=64", dict(kw, dtype=torch.bfloat16, d=64))
            for name, kw in base
            if name not in ("dense", "bool mask")
        ] + [
            ("causal, float16, d=256", {"causal": True, "dtype": torch.float16, "d": 256}),
        ]  # fmt: skip
    out = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        name = str(dtype)[6:]
        out += [(f"{call}, {name}, d=64", dict(kw, dtype=dtype, d=64)) for call, kw in base]
        out += [
            (f"causal, {name}, d={d}", {"causal": True, "dtype": dtype, "d": d})
            for d in (40, 128, 256)
        ]
    return out


def run_case(kw: dict) -> None:
    from attnkit import attention

    kw = dict(kw)
    dtype, d = kw.pop("dtype"), kw.pop("d")
    lse = kw.pop("lse", False)
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(4, requires_grad=True)
    q = torch.randn(2, 4, 80, d, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, 2, 80, d, dtype=dtype, requires_grad=True) for _ in range(2))
    out, lse_t = attention(q, k, v, backend="triton", return_lse=True, **kw)
    loss = out.float().sum() + (lse_t.sum() if lse else 0)
    loss.backward()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, 90 = sm_90")
    parser.add_argument("--full", action="store_true", help="every dtype and head dim")
    args = parser.parse_args(argv)
    install(args.arch)
    print(f"triton {triton.__version__}, target sm_{args.arch}", flush=True)
    for name, kw in cases(args.full):
        before, start = len(COMPILED), time.perf_counter()
        try:
            run_case(kw)
        except Exception:  # the first failure, whole, is the report
            traceback.print_exc()
            print(f"FAILED to compile for sm_{args.arch}: {name}", flush=True)
            return 1
        took = time.perf_counter() - start
        print(f"ok  {name}: {len(COMPILED) - before} kernels, {took:.1f} s", flush=True)
    print(f"compiled {len(COMPILED)} kernels for sm_{args.arch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
