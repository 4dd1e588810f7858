"""The `--format deepseek_v3` export against the native MLA model it comes from: perplexity on held-out text and
KL(native || export) per token, for both latent-norm forms (linear: the scaled latent; fit: least squares), the eps
change alone (rms_norm_eps 1e-6 without the residual rescale), and the linear export in bf16 and fp16.

    python scripts/bench_deepseek_export.py smollm2 --kv-budget 0.5 --text wikitext2_test.txt --chars 200000 --ctx 512 --windows 4
    python scripts/bench_deepseek_export.py stories15m_dir --kv-budget 0.5 --text tinystories.txt --skip-chars 100000 --ctx 256 --windows 8

The conversion uses the CLI's defaults (teacher calibration windows from the package corpus, reconstruction "auto")
unless --calib-source / --reconstruct-steps say otherwise;
the evaluation text is never used to choose anything. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import tempfile

import torch

import hf_attn_patch  # noqa: F401 - builds the native MLA model
from hf_attn_patch.converters.options import ConvertOptions
from hf_attn_patch.converters.stages.layers import write_native
from hf_attn_patch.converters.stages.plan import plan_layers
from hf_attn_patch.converters.stages.source import open_source
from hf_attn_patch.converters.stages.target import resolve_target
from hf_attn_patch.converters.stages.windows import calibrate
from hf_attn_patch.models.pretrained import load_source
from hf_attn_patch.converters.export.deepseek_export import to_deepseek_v3
from hf_attn_patch.evaluation.perplexity import evaluate, windows_of


def native_conversion(source: str, options: dict):
    """(the native MLA model the export starts from, its calibration windows, the RoPE stride, the source's config,
    the engine, the export's RoPE dims): convert()'s stages with the layer loop's native form written to a temporary
    folder and loaded whole."""
    from transformers import AutoModelForCausalLM

    opts = ConvertOptions.from_flat(**options)
    src = open_source(source, opts.device)
    target = resolve_target(src, opts)
    opts = target.options  # with the choices resolved from the source
    src.layers.load_resident()  # embedding, final norm, LM head: convert() loads them once the target is checked
    cal = calibrate(src, opts, True)
    plan = plan_layers(src, opts, target, cal.windows)
    with tempfile.TemporaryDirectory() as tmp:
        write_native(src, opts, target, cal.windows, plan, f"{tmp}/native")
        native = AutoModelForCausalLM.from_pretrained(f"{tmp}/native").eval()
    return native, cal.windows, plan.stride, src.config, opts.engine, target.export_rope


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source")
    ap.add_argument("--kv-budget", type=float, required=True)
    ap.add_argument("--text", required=True, help="held-out evaluation text")
    ap.add_argument("--skip-chars", type=int, default=0, help="characters of the text skipped (calibration's part)")
    ap.add_argument("--chars", type=int, default=None, help="characters of the text kept after the skip")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--no-half", action="store_true", help="skip the bf16 / fp16 evaluations")
    ap.add_argument("--calib-source", default="teacher", help="as hf-attn convert (default teacher)")
    ap.add_argument("--reconstruct-steps", default="auto", help="as hf-attn convert (default auto)")
    args = ap.parse_args()

    options = dict(to="mla", kv_budget=args.kv_budget, format="deepseek_v3", calib_source=args.calib_source,
                   reconstruct_steps=args.reconstruct_steps if args.reconstruct_steps == "auto"
                   else int(args.reconstruct_steps))  # fmt: skip
    native, calib, stride, config, engine, rope_dim = native_conversion(args.source, options)
    linear, lin_report = to_deepseek_v3(native, calib, stride, config, engine, rope_dim, "linear")
    fit, fit_report = to_deepseek_v3(native, calib, stride, config, engine, rope_dim, "fit")

    source, tokenizer = load_source(args.source)
    text = open(args.text, encoding="utf-8").read()[args.skip_chars :]
    text = text[: args.chars] if args.chars else text
    windows = windows_of(text, tokenizer, args.ctx, args.ctx * args.windows)

    def ev(model, reference=native):
        r = evaluate(model, windows, reference=reference, progress=False)
        return {"ppl": r.perplexity, "kl_to_native": r.kl_to_reference}

    # the eps change alone: the linear export with the residual rescale undone (all norms at eps 1e-6)
    eps_only = copy.deepcopy(linear)
    k = lin_report["eps"]["residual_scale"]
    with torch.no_grad():
        eps_only.model.embed_tokens.weight /= k
        for layer in eps_only.model.layers:
            layer.self_attn.o_proj.weight /= k
            layer.mlp.down_proj.weight /= k
    out = {
        "source": args.source, "kv_budget": args.kv_budget, "shape": lin_report["shape"],
        "eval": {"text": args.text, "skip_chars": args.skip_chars, "chars": args.chars, "windows": len(windows),
                 "ctx": args.ctx},
        "source_ppl": evaluate(source, windows, progress=False).perplexity,
        "native": ev(native),
        "export_linear": {**ev(linear), "calib_kl": lin_report["kl_to_native_per_token"],
                          "max_relative_deviation": lin_report["latent_norm"]["max_relative_deviation_calibration"]},
        "export_fit": {**ev(fit), "calib_kl": fit_report["kl_to_native_per_token"]},
        "eps_change_only": ev(eps_only),
    }  # fmt: skip
    for name in ("export_linear", "export_fit"):
        out[name]["ppl_vs_native"] = out[name]["ppl"] / out["native"]["ppl"]
    if args.no_half:
        print(json.dumps(out, indent=1))
        return
    native_bf16 = copy.deepcopy(native).to(torch.bfloat16)
    out["bf16"] = {"native_bf16": ev(native_bf16), "export_linear_bf16": ev(copy.deepcopy(linear).to(torch.bfloat16)),
                   "export_linear_bf16_vs_native_bf16": ev(copy.deepcopy(linear).to(torch.bfloat16), native_bf16)}  # fmt: skip
    fp16 = ev(copy.deepcopy(linear).to(torch.float16))
    out["fp16_export_linear"] = {k: (v if math.isfinite(v) else str(v)) for k, v in fp16.items()}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
