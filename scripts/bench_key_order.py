"""The cost of keys in any order (property_order "any") against declaration order ("schema") on real-world JSON
Schemas (JSONSchemaBench / MaskBench, the sample of bench_schemas.py), for a real vocabulary (SmolLM2's, 49k tokens).

    python scripts/bench_key_order.py /path/to/jsonschemabench/git-dir --n 1000 --seed 4638 --schemas 60

Per order, over the first --schemas schemas of the sample that compile in both orders:
- grammar size: bytes of the Lark grammar llguidance builds from the widened schema (llguidance.JsonCompiler);
- compile time (widening included), schemas that need exact checks;
- mask time per token: every valid instance replayed token by token in both orders, interleaved in one process
  (instances whose raw text one order refuses are left out of the timing, and counted), after one untimed replay
  (llguidance builds its lexer lazily); the plain grammar (no checks) of each order is timed on the same text, so
  that the checks' share is visible.
Times are this process's CPU time (time.process_time, one thread): on a shared machine they do not count the
time other processes hold the core; the ratios are within one process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bench_schemas import encode, load_sample, plain_state, replay

from hf_attn_patch.grammar import GrammarError, GrammarSpec, compile_grammar
from hf_attn_patch.grammar.backends import LLGuidanceBackend
from hf_attn_patch.grammar.formats import known_formats
from hf_attn_patch.grammar.schema_relax import relax_and_compile
from hf_attn_patch.grammar.vocab import get_adapter

ORDERS = ("schema", "any")


def lark_bytes(schema: dict, adapter, order: str) -> int:
    """Size of the Lark grammar llguidance compiles for `schema` widened as compile_grammar widens it."""
    import llguidance

    be = LLGuidanceBackend()

    def compile_fn(relaxed, options):
        return be.compile(GrammarSpec("json_schema", relaxed), adapter, separators=(", ", ": "),
                          json_options=options)

    _, relaxed = relax_and_compile(schema, compile_fn, known_formats(), "llguidance", order)
    options = relaxed.options or {}
    compiler = llguidance.JsonCompiler(separators=(", ", ": "), coerce_one_of=bool(options.get("coerce_one_of")))
    return len(compiler.compile(json.dumps(relaxed.schema), check=False))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mirror", help="git directory of guidance-ai/jsonschemabench")
    ap.add_argument("--n", type=int, default=1000, help="sample size, as in bench_schemas.py")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--schemas", type=int, default=60, help="schemas of the sample measured")
    ap.add_argument("--instances", type=int, default=3, help="valid instances replayed per schema")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: SmolLM2-135M's)")
    args = ap.parse_args()
    import logging

    from tqdm import tqdm
    from transformers import AutoTokenizer

    from hf_attn_patch.models.pretrained import smollm2_dir

    logging.getLogger("hf_attn_patch").setLevel(logging.ERROR)
    tok = AutoTokenizer.from_pretrained(args.tokenizer or smollm2_dir())
    adapter = get_adapter(tok)
    sample, _ = load_sample(args.mirror, args.n, args.seed)
    size = {o: [] for o in ORDERS}
    compile_s = {o: [] for o in ORDERS}
    checked = {o: 0 for o in ORDERS}
    mask = {o: {"ours": 0.0, "plain": 0.0} for o in ORDERS}
    tokens, refused_raw, measured = 0, {o: 0 for o in ORDERS}, 0
    for name, entry in tqdm(sample, desc="schemas"):
        if measured >= args.schemas:
            break
        schema = entry["schema"]
        grammars = {}
        try:
            for order in ORDERS:
                t0 = time.process_time()
                grammars[order] = compile_grammar(GrammarSpec.json_schema(schema, order), tok, cache=False)
                compile_s[order].append(time.process_time() - t0)
        except GrammarError:
            for order in grammars:
                compile_s[order].pop()
            continue
        measured += 1
        for order in ORDERS:
            size[order].append(lark_bytes(schema, adapter, order))
            checked[order] += grammars[order].checks is not None
        for test in [t for t in entry.get("tests") or [] if t["valid"]][: args.instances]:
            ids = encode(adapter, json.dumps(test["data"], ensure_ascii=False))
            runs = {}
            for order in ORDERS:
                replay(plain_state(grammars[order], adapter), ids)  # warm-up: llguidance builds its lexer lazily
                ok, sec, steps = replay(grammars[order].new_state(), ids, clock=time.process_time)
                _, sec_plain, _ = replay(plain_state(grammars[order], adapter), ids, clock=time.process_time)
                runs[order] = (ok, sec, sec_plain)
                refused_raw[order] += not ok
            if all(r[0] for r in runs.values()):
                tokens += len(ids) + 1
                for order, (_, sec, sec_plain) in runs.items():
                    mask[order]["ours"] += sec
                    mask[order]["plain"] += sec_plain
    us = lambda s: round(1e6 * s / max(tokens, 1), 1)  # noqa: E731
    out = {"schemas": measured, "tokens_timed": tokens, "vocab": adapter.vocab_size, "refused_raw": refused_raw}
    for order in ORDERS:
        out[order] = {"lark_bytes_median": statistics.median(size[order]), "lark_bytes_total": sum(size[order]),
                      "compile_ms_median": round(1e3 * statistics.median(compile_s[order]), 1),
                      "schemas_with_checks": checked[order],
                      "mask_us_per_token": us(mask[order]["ours"]), "plain_mask_us_per_token": us(mask[order]["plain"])}
    out["any_vs_schema"] = {"lark_bytes_total": round(out["any"]["lark_bytes_total"]
                                                      / max(out["schema"]["lark_bytes_total"], 1), 3),
                            "mask_time": round(mask["any"]["ours"] / max(mask["schema"]["ours"], 1e-9), 3)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
