"""Latent K/V levers on the held-in criteria: the closed form (converters/methods/latent_kv.py) at several key
shares, key-metric contexts, metrics and retrieval allocations, each converted in memory from one set of calibration
statistics and scored against the source on held-in text only.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_latent_kv.py [--source smollm2] [--kv-budget 0.5] \
        [--settings 0.333/4096/weighted 0.5/4096/weighted ...] [--keep DIR] [--out FILE.json]

A setting is KEY_SHARE/ROPE_CONTEXT/METRIC[/retrieval]: METRIC `weighted` (query second moments through RoPE for
keys, o_proj for values) or `plain` (unweighted PCA of the K / V outputs); `retrieval`: the copy KV heads keep exact
keys at the same total KV values.
Calibration: the converter's default, 32 teacher samples of 256 tokens (seed 0) prompted from the package's corpus.
Criteria (held-in: never evaluation text):
    held-in KL   KL(source || model) per token on N windows of L tokens of the corpus after its first 8,192 tokens
                 (--held-in-data text), or teacher samples prompted from them (teacher, seed 1), short (< 256)
                 and by position bin (evaluation/held_in.py);
    repeat KL    KL on the second copy of S + F + S, S 64 tokens of the corpus after its first 8,192 tokens, the copy
                 D tokens after the first (evaluation/held_in.py repeat_kl), D = 256 ... 4,096.
--keep DIR saves each setting's model (DIR/<setting>) for scripts/bench_long_context.py's probes.
Samples, statistics and the source's log-probabilities are cached in --cache.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

import hf_attn_patch  # noqa: F401
from bench_long_context import CALIBRATED_TOKENS, cached
from hf_attn_patch.converters.io.calibration import (LayerStats, calibration_windows, read_calibration_text,
                                                     stats_of_inputs, teacher_windows)  # fmt: skip
from hf_attn_patch.converters.methods.exact import rebuild, stock_attention_layers
from hf_attn_patch.converters.methods.latent_kv import latent_kv_layer
from hf_attn_patch.converters.stages.closed_form import LatentChoice
from hf_attn_patch.converters.stages.retrieval import (SAMPLES, SEGMENT, copy_kv_heads, copy_scores, kv_copy_scores,
                                                       latent_retrieval_choices)  # fmt: skip
from hf_attn_patch.converters.stages.target import latent_kv_sizes
from hf_attn_patch.evaluation.held_in import long_context_kl, repeat_items, repeat_kl, repeat_source_log_probs, source_log_probs
from hf_attn_patch.models.architectures import AttentionShape
from hf_attn_patch.models.pretrained import load_source

DISTANCES = (256, 512, 1024, 2048, 4096)


@torch.no_grad()
def layer_covariances(model, windows: torch.Tensor) -> list[torch.Tensor]:
    """Per attention layer: the input second moment [D + 1, D + 1] (a constant 1 appended) over the windows."""
    shape = AttentionShape.of(model.config)
    layers = list(stock_attention_layers(model).values())
    inputs: list[list[torch.Tensor]] = [[] for _ in layers]

    def keep(i):
        return lambda mod, args, kw: inputs[i].append((args[0] if args else kw["hidden_states"]).detach())

    hooks = [m.register_forward_pre_hook(keep(i), with_kwargs=True) for i, m in enumerate(layers)]
    try:
        for batch in windows.split(8):
            model(batch)
    finally:
        for h in hooks:
            h.remove()
    out = []
    for i, attn in enumerate(layers):
        w = shape.arch.split_heads(attn).cpu()
        stats: LayerStats = stats_of_inputs(torch.cat(inputs[i]), w, shape)
        out.append(stats.input_cov)
        inputs[i] = []
    return out


def convert(source, covs, shape, setting: str, budget: float, windows):
    """The latent_kv model of one setting, built in memory (the source is not touched) -> (model, choices)."""
    share, context, metric, *rest = setting.split("/")
    key_rank, value_rank = latent_kv_sizes(budget, float(share), shape)
    choices = [LatentChoice(key_rank, value_rank)] * shape.layers
    if rest == ["retrieval"]:
        per_kv = kv_copy_scores(copy_scores(source, windows[:SAMPLES, :SEGMENT]), shape.kv_heads)
        choices = latent_retrieval_choices(copy_kv_heads(per_kv), choices[0], shape.layers, shape.head_dim,
                                           shape.kv_heads)
    lifted = {}
    for (name, attn), cov, c in zip(stock_attention_layers(source).items(), covs, choices):
        w = shape.arch.split_heads(attn).cpu()
        lifted[name] = latent_kv_layer(w, shape, cov, c.key_rank, c.value_rank, int(context), c.exact_key_heads,
                                       metric=metric)  # fmt: skip
    fields = {"latent_key_rank": [c.key_rank for c in choices], "latent_value_rank": [c.value_rank for c in choices]}
    return rebuild(source, "latent_kv", fields, lifted), choices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="smollm2")
    parser.add_argument("--kv-budget", type=float, default=0.5)
    parser.add_argument("--settings", nargs="+", default=["0.333/4096/weighted"],
                        help="KEY_SHARE/ROPE_CONTEXT/METRIC[/retrieval] (module docstring)")
    parser.add_argument("--held-in", default="4x1024", help="NxL windows of the held-in KL")
    parser.add_argument("--held-in-data", default="text", choices=("text", "teacher"),
                        help="held-in KL windows: the corpus after the calibration prompts (default), or teacher "
                             "samples prompted from it (seed 1)")
    parser.add_argument("--repeat", default=",".join(map(str, DISTANCES)), help="repeat KL distances D")
    parser.add_argument("--repeat-items", type=int, default=2, help="items per distance")
    parser.add_argument("--keep", default=None, help="save each setting's model under this folder")
    parser.add_argument("--out", default=None, help="append each setting's row (JSON lines) to this file")
    parser.add_argument("--cache", default="/tmp/hfap-latent-kv")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    bad = [s for s in args.settings if len(s.split("/")) not in (3, 4) or s.split("/")[2] not in ("weighted", "plain")
           or s.split("/")[3:] not in ([], ["retrieval"])]  # fmt: skip
    if bad:
        parser.error(f"--settings {bad}: expected KEY_SHARE/ROPE_CONTEXT/weighted|plain[/retrieval]")
    torch.set_num_threads(args.threads)
    source, tokenizer = load_source(args.source)
    shape = AttentionShape.of(source.config)
    cache = Path(args.cache) / Path(args.source).name
    text = read_calibration_text(None)
    started = time.perf_counter()
    calib = cached(cache / "calibration_32x256.safetensors",
                   lambda: teacher_windows(source, calibration_windows(text, tokenizer, 32, 256), seed=0))  # fmt: skip
    covs_path = cache / "covariances.pt"
    if covs_path.exists():
        covs = torch.load(covs_path, weights_only=True)
    else:
        covs = layer_covariances(source, calib)
        torch.save(covs, covs_path)
    n, length = (int(x) for x in args.held_in.split("x"))
    first = math.ceil(CALIBRATED_TOKENS / length)
    prompts = calibration_windows(text, tokenizer, first + n, length)[first:]
    if args.held_in_data == "text":  # the corpus itself after the calibration prompts (no sampling: fast)
        held = prompts
    else:
        held = cached(cache / f"held_in_{n}x{length}.safetensors", lambda: teacher_windows(source, prompts, seed=1))
    held_logp = cached(cache / f"held_in_{args.held_in_data}_{n}x{length}_source_logp.safetensors",
                       lambda: source_log_probs(source, held))  # fmt: skip
    stream = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0][CALIBRATED_TOKENS:]
    distances = tuple(int(d) for d in args.repeat.split(","))
    items = repeat_items(stream, distances, args.repeat_items, 64, seed=0)
    repeat_logp = cached(cache / f"repeat_{args.repeat}_{args.repeat_items}.safetensors",
                         lambda: repeat_source_log_probs(source, items))  # fmt: skip
    print(f"calibration, statistics and the source's log-probabilities: {time.perf_counter() - started:.0f} s",
          flush=True)  # fmt: skip
    for setting in args.settings:
        started = time.perf_counter()
        model, choices = convert(source, covs, shape, setting, args.kv_budget, calib)
        row = {"setting": setting, "kv_budget": args.kv_budget,
               "key_ranks": sorted({c.key_rank for c in choices}), "value_ranks": sorted({c.value_rank for c in choices}),
               "exact_key_heads": [(l, g) for l, c in enumerate(choices) for g in c.exact_key_heads],
               "held_in_kl": long_context_kl(model, held_logp, held), "repeat_kl": repeat_kl(model, repeat_logp, items),
               "seconds": round(time.perf_counter() - started)}  # fmt: skip
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        if args.keep:
            model.save_pretrained(Path(args.keep) / setting.replace("/", "_"))
            tokenizer.save_pretrained(Path(args.keep) / setting.replace("/", "_"))
        del model


if __name__ == "__main__":
    main()
