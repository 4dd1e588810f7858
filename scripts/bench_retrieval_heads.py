"""Which heads copy: each source head's attention mass on the earlier copy of a repeated segment, beside the ranks a
conversion gave each layer (the first step of retrieval-aware allocation, as DuoAttention / RazorAttention find
retrieval heads).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_retrieval_heads.py [--source smollm2] [--segment 256]
        [--samples 2] [--report /tmp/convs/mla50/conversion_report.json] [--out scripts/bench_retrieval_heads.json]

Items: teacher samples (the source's own continuations, seed 2, of 4-token prompts from the calibration corpus) of
--segment tokens, S, fed as bos? + S + S. Copy score of a head: the mean over the second copy's queries at
position i of the attention weight on i - segment + 1, the token that followed the query's earlier copy (what an
induction / copy head attends to). A head that copies puts most of its mass there; chance is 1 / position.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import hf_attn_patch  # noqa: F401
from hf_attn_patch.converters.io.calibration import calibration_windows, read_calibration_text, teacher_windows
from hf_attn_patch.models.pretrained import load_source


@torch.no_grad()
def copy_scores(model, segments: torch.Tensor) -> torch.Tensor:
    """[layers, heads]: mean attention weight from each second-copy query to the token after its earlier copy."""
    n, seg = segments.shape
    ids = torch.cat([segments, segments], dim=1)  # [n, 2 seg]
    out = model(ids, output_attentions=True)
    queries = torch.arange(seg, 2 * seg - 1)  # the last query's target would be outside the first copy
    keys = queries - seg + 1
    return torch.stack([a[:, :, queries, keys].mean(dim=(0, 2)) for a in out.attentions])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="smollm2")
    parser.add_argument("--segment", type=int, default=256)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--report", help="a conversion_report.json: print its per-layer (rope_dim, kv_lora_rank)")
    parser.add_argument("--out", default=str(Path(__file__).with_name("bench_retrieval_heads.json")))
    args = parser.parse_args()
    source, tokenizer = load_source(args.source)
    source.set_attn_implementation("eager")  # SDPA returns no weights
    prompts = calibration_windows(read_calibration_text(None), tokenizer, args.samples, args.segment)
    segments = teacher_windows(source, prompts, seed=2, progress=False)
    scores = copy_scores(source, segments)
    budgets = None
    if args.report:
        layers = json.loads(Path(args.report).read_text())["budgets"]["layers"]
        budgets = [(b["rope_dim"], b["kv_lora_rank"]) for b in layers]
    print("layer | copy score of the best 3 heads | heads > 0.3 | layer mean" + (" | (d_r, d_c)" if budgets else ""))
    for i, row in enumerate(scores):
        top = row.sort(descending=True).values[:3]
        cells = [f"{i:2d}", " ".join(f"{v:.2f}" for v in top), str(int((row > 0.3).sum())), f"{row.mean():.3f}"]
        print(" | ".join(cells + ([str(budgets[i])] if budgets else [])))
    Path(args.out).write_text(json.dumps({"segment": args.segment, "samples": args.samples,
                                          "scores": [[round(float(v), 4) for v in r] for r in scores],
                                          "budgets": budgets}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
