"""A linear layer's product on the CPU with its weight in oneDNN's blocked layout (what vLLM-CPU's onednn_mm does).

    reason = onednn_linear_unsupported(torch.float32)   # None where this CPU and torch can run it, else why not
    packed = pack_linear_weight(weight)                 # weight [N, K] fp32 or bf16 -> oneDNN's layout, once
    out = packed_linear(x, packed, bias)                # x [..., K] -> [..., N] = x W^T + b (same dtype as x)
    out = reference_linear(x, weight, bias)             # the pure-torch twin: F.linear

Why: torch's F.linear runs an fp32 product with a few rows (2-32: speculative verification, chunked prefill, a
batch of decodes) through MKL's sgemm far below the memory bandwidth that its 1-row gemv reaches; the same product
by a weight reordered once for oneDNN reads the weight once at about the speed of one row
(scripts/bench_kernels.py fast-linear --part linear has the curves). In bf16 the packed product uses the CPU's bf16 dot
products (AVX512-BF16 / AMX) and takes about half the fp32 time.

Numerics: the same products, summed in another order. fp32: each output differs from F.linear's by fp32 rounding,
|error| <= ~K * eps * sum|x_k w_k| (eps = 6e-8), in practice ~sqrt(K) * eps * that. bf16: both accumulate in fp32 and
round the result to bf16 once, so they differ by at most one bf16 ulp (2^-8 relative) where the fp32 sums fall on
either side of a rounding boundary.

Kernels are leaves: tensors in, tensors out; the module swap that uses them lives in
hf_attn_patch/models/fast_linear.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROWS_HINT = 32  # the batch oneDNN tunes the layout for (vLLM-CPU's choice); measured as good as 1 at one row

__all__ = ["ROWS_HINT", "onednn_linear_unsupported", "pack_linear_weight", "packed_linear", "reference_linear"]


def bf16_supported() -> bool:
    """Whether oneDNN has bf16 kernels on this CPU (AVX512-BF16, AMX or AVX512 with its emulation paths)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def onednn_linear_unsupported(dtype: torch.dtype) -> str | None:
    """None where packed_linear runs `dtype` on this machine; otherwise the reason (for the log)."""
    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN (mkldnn)"
    if dtype == torch.float32:
        return None
    if dtype == torch.bfloat16:
        return None if bf16_supported() else "this CPU has no bf16 oneDNN kernels (AVX512-BF16 / AMX / AVX512)"
    return f"no packed oneDNN product for {dtype} on the CPU (float32 and bfloat16 only)"


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (CPU, fp32 or bf16) -> the same weight in oneDNN's blocked layout for packed_linear."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] -> [..., N] = x W^T + b, W given as pack_linear_weight(W); x, W and b of one dtype."""
    flat = x.reshape(-1, x.shape[-1])
    if not flat.is_contiguous():
        flat = flat.contiguous()
    out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


def reference_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The pure-torch twin: x [..., K] -> [..., N] = x W^T + b."""
    return F.linear(x, weight, bias)
