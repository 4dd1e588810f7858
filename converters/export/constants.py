"""The deepseek_v3 export's constants (deepseek_export.py says what each one does and why)."""

SOURCE_TYPES = ("llama", "mistral", "qwen2")  # llama-family layers: RMSNorm, gated MLP (qwen2: without biases only)
QK_NORM_TYPES = ("qwen3", "gemma3", "gemma3_text", "olmo2")  # refused with the reason (check_source)
ROPE_TYPES = ("default", "llama3")
EXPORT_EPS = 1e-6  # transformers' hard-coded kv_a_layernorm / q_a_layernorm eps: the export's rms_norm_eps
LINEAR_MARGIN = 2.0**-30  # linear latent norm: ms(s c) <= LINEAR_MARGIN * eps on every calibration token; tokens
# unlike them (ms(c) 10^4 x larger) still see a relative deviation < 1e-5
LATENT_NORMS = ("linear", "fit")
LATENT_RMS = 32.0  # "fit": target rms of the scaled latent; fp16-safe, eps / 32^2 ~ 1e-9
Q_SCALE = 32.0  # q_a_proj = Q_SCALE * I: rms(u) ~ 1, so the query latent's rms is ~32 too
ENGINES = ("llama.cpp", "transformers", "vllm", "sglang", "flashmla")
# (kv_lora_rank, qk_rope_head_dim) each engine's MLA kernels take, largest first; None: any shape. vLLM: the shapes
# its backends name (vllm_backends.py; the CPU build's is 512 + 64, tested); SGLang, FlashMLA: read from their sources.
ENGINE_SHAPES = {
    "vllm": ((512, 64), (256, 64)),
    "sglang": ((512, 64), (256, 64)),
    "flashmla": ((512, 64),),
    "llama.cpp": None,
    "transformers": None,
}
RUN_HERE = ("llama.cpp", "transformers")  # engines the test suite runs every export in (vLLM: 512 + 64 only)
