"""Model cards for converted checkpoints, and pushing them to the Hugging Face Hub with huggingface_hub."""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

KNOWN_BASES = {"default": "stories260K (karpathy/llama2.c)", "smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def model_card(report: dict) -> str:
    """README.md with Hub metadata (base_model, tags, library) and how to load the conversion."""
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
    if fmt == "deepseek_v3":
        kl = report["deepseek_v3"]["kl_to_native_per_token"]
        lines += [
            "A stock `DeepseekV3ForCausalLM` (dense layers, no MoE): transformers loads it without custom code, and",
            "engines that serve DeepSeek-V3 (vLLM, SGLang) are meant to. The export is approximate: stock DeepSeek",
            f"normalizes the latent (kv_a_layernorm); KL to the exact conversion before healing: {kl:.4f} per token.",
            "",
        ]
    lines += ["```python", load + 'model = AutoModelForCausalLM.from_pretrained("PATH_OR_REPO")', "```", "",
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
