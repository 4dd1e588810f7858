"""The Triton kernels compile for a Hopper GPU (sm_90, the H200) with no GPU present: Triton's frontend, its MLIR
passes and the ptxas it ships check what the interpreter cannot (types, layouts, tl.dot shapes, PTX). Nothing runs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
from packaging.version import Version  # noqa: E402

if Version(triton.__version__).release < (3, 3):
    pytest.skip("ASTSource's constexpr keys changed in triton 3.3; checked with 3.9", allow_module_level=True)
if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
    pytest.skip("this triton ships no ptxas", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from hf_attn_patch.kernels import triton_ops  # noqa: E402

SCALARS = {"scale": "fp32", "softcap": "fp32"}  # every other non-pointer argument is an int32 (strides, counts)


def compile_for_sm90(kernel, pointers: dict, constexprs: dict, num_warps: int):
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constexprs else pointers.get(n) or SCALARS.get(n, "i32") for n in names}
    source = ASTSource(kernel, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def decode_case(dtype, split, options):
    pointers = dict(
        Q=f"*{dtype}",
        K=f"*{dtype}",
        V=f"*{dtype}",
        BT="*i32",
        CTX="*i32",
        KMASK="*u8",
        O=f"*{dtype}",
        PO="*fp32",
        PL="*fp32",
    )
    constexprs = dict(
        PAGE=16,
        GROUP=4,
        BLOCK_G=16,
        BLOCK_N=32,
        D_K=128,
        D_V=128,
        BLOCK_DK=128,
        BLOCK_DV=128,
        HAS_MASK=options,
        HAS_SOFTCAP=options,
        HAS_WINDOW=options,
        SPLIT=split,
        PREC="ieee" if dtype == "fp32" else None,
        UPCAST=False,
    )
    return triton_ops._paged_decode_kernel, pointers, constexprs, 8


def mla_case(dtype):
    pointers = dict(
        QL=f"*{dtype}",
        QR=f"*{dtype}",
        C=f"*{dtype}",
        BT="*i32",
        CTX="*i32",
        KMASK="*u8",
        O=f"*{dtype}",
        PO="*fp32",
        PL="*fp32",
    )
    constexprs = dict(
        PAGE=16,
        BLOCK_H=16,
        BLOCK_N=16,
        D_C=512,
        D_R=64,
        BLOCK_DC=512,
        BLOCK_DR=64,
        HAS_MASK=True,
        SPLIT=True,
        PREC=None,
        UPCAST=False,
    )
    return triton_ops._mla_decode_kernel, pointers, constexprs, 8


CASES = {
    "decode-fp16": decode_case("fp16", False, False),
    "decode-bf16-split-options": decode_case("bf16", True, True),
    "decode-fp32-split": decode_case("fp32", True, False),
    "mla-bf16-512+64": mla_case("bf16"),
    "reduce": (triton_ops._split_reduce_kernel, dict(PO="*fp32", PL="*fp32", O="*bf16"),
               dict(D_V=512, BLOCK_S=64, BLOCK_DV=512), 4),
    "bitmask": (triton_ops._bitmask_kernel, dict(L="*fp32", M="*i32"), dict(BLOCK=1024), 4),
}  # fmt: skip


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles, nothing to interpret")
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_compiles_for_sm90(case):
    kernel, pointers, constexprs, num_warps = CASES[case]
    compiled = compile_for_sm90(kernel, pointers, constexprs, num_warps)
    assert compiled.asm["cubin"]  # ptxas produced machine code
