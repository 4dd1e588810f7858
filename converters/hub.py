"""Model cards for converted checkpoints, and pushing them to the Hugging Face Hub with huggingface_hub."""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

KNOWN_BASES = {"default": "stories260K (karpathy/llama2.c)", "smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}


LLAMA_CPP_TESTED = "tested: logits within fp32 noise of transformers, greedy tokens identical (tests/test_llamacpp.py)"


def engines(report: dict) -> dict[str, str]:
    """Where this export has been run (tested) and where it should run but was never tried (in theory)."""
    fmt, model_type = report["format"], report["model_type"]
    if fmt == "native":
        never = "no: the config's attention fields are hf-attn-patch's, not a stock architecture (--format stock / deepseek_v3)"
        return {"transformers": "tested, with `import hf_attn_patch` (it registers the attention variant)",
                "llama.cpp": never, "vLLM / SGLang": never}  # fmt: skip
    out = {"transformers": "tested: loads without hf_attn_patch (a stock architecture)"}
    theory = "in theory only: not installable here, never run"
    if fmt == "stock":
        out["llama.cpp"] = (LLAMA_CPP_TESTED if model_type == "llama" else
                            f"in theory: llama.cpp's converter takes {model_type}; only llama sources are tested here")  # fmt: skip
        out["vLLM / SGLang"] = f"{theory} (a stock {model_type} config)"
        return out
    ds = report["deepseek_v3"]
    for name, e in ds["engines"].items():  # deepseek_export.engine_support: MLA kernels or fallback, and the evidence
        out[name] = f"{e['status']}; {e['evidence']}"
    if "q_lora" in ds:
        gguf = ("GGUF --outtype f32 or bf16 (f16 and fp16-scaled quantizations cannot hold the scaled latent)"
                if ds["latent_norm"]["mode"] == "linear" else "any GGUF type")  # fmt: skip
        out["llama.cpp"] += (f": {LLAMA_CPP_TESTED[len('tested: '):]}, through llama.cpp's own convert_hf_to_gguf.py; "
                             f"{gguf}. Its DeepSeek converter takes only byte-level BPE tokenizers (SmolLM2's); a "
                             "SentencePiece one (Llama-2 style) needs the vocab step of its Llama converter")  # fmt: skip
    return out


def model_card(report: dict) -> str:
    """README.md with Hub metadata (base_model, tags, library), where it runs, and how to load the conversion."""
    source = str(report["source"])
    base = KNOWN_BASES.get(source, source)
    target = report["options"]["to"]
    fmt = report.get("format")
    kv = report["kv_bytes_per_token_fp16"]
    heal = report.get("heal")
    load = (
        "from transformers import AutoModelForCausalLM\n"
        if fmt in ("stock", "deepseek_v3")
        else "import hf_attn_patch  # registers the attention variant\nfrom transformers import AutoModelForCausalLM\n"
    )
    tags = ["hf-attn-patch", target] + (["deepseek_v3"] if fmt == "deepseek_v3" else [])
    lines = ["---", f"base_model: {base}", "library_name: transformers", "tags:", *(f"- {t}" for t in tags), "---", ""]
    lines += [
        f"# {base}, converted to {target.upper()}",
        "",
        f"Converted with `hf-attn convert` (method `{report['options']['method']}`, format `{fmt}`).",
        f"KV cache per token (fp16, all layers): {kv['before']} B -> {kv['after']} B ({report['kv_ratio']:.1%}).",
        f"Healing: {heal['steps']} distillation steps ({heal['tokens']} tokens)." if heal else "Healing: none.",
        "",
    ]
    if "budgets" in report:  # rank allocation by measured sensitivity (budgets.py): each layer's choice
        b = report["budgets"]
        lines += [f"KV budget by measured sensitivity: {b['values_per_token']} of {b['budget_values_per_token']} "
                  f"values per token (KL of each layer's choice alone, on {b['windows']} calibration windows).", "",
                  "| layer | choice | RoPE dims | latent rank | KL |", "|---:|---|---:|---:|---:|"]  # fmt: skip
        lines += [f"| {c['layer']} | {c['choice']} | {c['rope_dim']} | {c['kv_lora_rank']} | {c['kl']:.2e} |"
                  for c in b["layers"]] + [""]  # fmt: skip
    if fmt == "deepseek_v3":
        ds = report["deepseek_v3"]
        shape = ds["shape"]
        exact = ("exactly, up to rounding: the latent is scaled so that kv_a_layernorm is linear (fp32 / bf16 "
                 "weights; not fp16, nor GGUF f16 or quantizations with fp16 block scales: use --outtype f32 or bf16)"
                 if ds["latent_norm"]["mode"] == "linear" else
                 "approximately: what follows kv_a_layernorm is fitted by least squares (fp16)")  # fmt: skip
        lines += [
            f"A stock `DeepseekV3ForCausalLM` (dense layers, no MoE) shaped for {ds['engine']}: kv_lora_rank "
            f"{shape['kv_lora_rank']} + qk_rope_head_dim {shape['qk_rope_head_dim']}; transformers loads it without "
            f"custom code. It computes the MLA conversion {exact}; KL from that conversion: "
            f"{ds['kl_to_native_per_token']:.2g} per token (calibration windows).",
            "",
        ]
        if not ds["rope"]["exact"]:
            lines += [f"RoPE ({ds['rope']['rope_type']}): nearest stock frequencies, largest relative error "
                      f"{ds['rope']['max_relative_frequency_error']:.2g}.", ""]  # fmt: skip
        if "q_lora" in ds:
            q = ds["q_lora"]
            lines += [f"Its query LoRA of rank {q['rank']} (llama.cpp needs one) adds {q['extra_parameters']:,} "
                      f"parameters ({q['extra_fraction_of_model']:.1%}) at KL {q['kl_to_q_proj_per_token']:.1e} per "
                      f"token.", ""]  # fmt: skip
    lines += ["## Engines", "", "| engine | status |", "|---|---|"]
    lines += [f"| {name} | {status} |" for name, status in report.get("engines", engines(report)).items()]
    lines += ["", "```python", load + 'model = AutoModelForCausalLM.from_pretrained("PATH_OR_REPO")', "```", "",
              "The full conversion report is in `conversion_report.json`.", ""]  # fmt: skip
    return "\n".join(lines)


def check_repo_id(repo_id) -> None:
    if not isinstance(repo_id, str) or repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise ValueError(f"repo_id={repo_id!r} must look like 'owner/name'")


def push(folder: str | Path, repo_id: str, *, private: bool = False, dry_run: bool = False, token: str | None = None,
         client=None) -> dict:  # fmt: skip
    """Upload a converted folder: create_repo (exist_ok) + upload_folder. `client` defaults to huggingface_hub.HfApi
    (token from the argument, the HF_TOKEN environment variable or the user's login). dry_run lists, uploads nothing."""
    folder = Path(folder)
    if not (folder / "config.json").is_file() or not (folder / "conversion_report.json").is_file():
        raise ValueError(f"{str(folder)!r} is not a converted model folder (config.json and conversion_report.json)")
    check_repo_id(repo_id)
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    plan = {"repo_id": repo_id, "private": private, "files": files, "dry_run": dry_run}
    if dry_run:
        return plan
    if client is None:
        from huggingface_hub import HfApi

        client = HfApi(token=token)
    url = client.create_repo(repo_id, private=private, exist_ok=True)
    client.upload_folder(folder_path=str(folder), repo_id=repo_id, commit_message="Upload hf-attn-patch conversion")
    logger.info("pushed %s to %s", folder, url)
    return {**plan, "url": str(url)}
