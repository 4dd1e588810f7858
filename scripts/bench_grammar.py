"""Grammar-constrained decoding benchmark: one run prints every table (markdown).

1. Per-token overhead of constrained vs unconstrained generate() on SmolLM2-135M, batch 1 and 8 (same number of
   generated tokens), and the processor's own time per call measured inside generate().
2. Compile time p50 / p99 and first-mask time over 20 function-calling / API-response schemas, llguidance and xgrammar.
3. Fast-forward (forced tokens appended without a model step) vs plain constrained decoding, batch 1, greedy.
4. transformers-cfg and outlines side by side when they import and run offline (else the reason is printed).

Usage: .venv/bin/python scripts/bench_grammar.py [--json scripts/bench_grammar.json] [--tokens 48] [--repeats 3]
Optional competitors: installed in the venv, or in --extras (default /tmp/grammar_extras, e.g.
`pip install --no-deps --target /tmp/grammar_extras transformers-cfg outlines outlines_core genson cloudpickle`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback

import torch
from transformers import DynamicCache, LogitsProcessorList

from hf_attn_patch.compat import cache_kwarg
from hf_attn_patch.grammar import GrammarSpec, JSONSchemaLogitsProcessor, compile_grammar
from hf_attn_patch.grammar import bitmask as bm
from hf_attn_patch.models.pretrained import load_smollm2

# ------------------------------------------------------------------------------------------------------ schemas
def _fn(name, props, required=None):
    return {"type": "object", "properties": {
        "name": {"const": name},
        "arguments": {"type": "object", "properties": props, "required": required or list(props),
                      "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False}


S = {"type": "string", "maxLength": 40}
SCHEMAS = {
    "get_weather": _fn("get_weather", {"city": S, "unit": {"enum": ["celsius", "fahrenheit"]}}),
    "search_web": _fn("search_web", {"query": S, "max_results": {"type": "integer", "minimum": 1, "maximum": 20}}),
    "send_email": _fn("send_email", {"to": {"type": "string", "format": "email"}, "subject": S, "body": S,
                                     "cc": {"type": "array", "items": {"type": "string", "format": "email"}, "maxItems": 3}},
                      ["to", "subject", "body"]),
    "create_event": _fn("create_event", {"title": S, "date": {"type": "string", "format": "date"},
                                         "start": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                                         "attendees": {"type": "array", "items": S, "maxItems": 5}}),
    "book_flight": _fn("book_flight", {"from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                       "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                       "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
                                       "class": {"enum": ["economy", "business", "first"]}}),
    "sql_query": _fn("run_sql", {"sql": {"type": "string", "maxLength": 200}, "timeout_s": {"type": "number", "minimum": 0}}),
    "translate": _fn("translate", {"text": S, "target": {"enum": ["en", "fr", "de", "es", "ja"]}}),
    "set_timer": _fn("set_timer", {"seconds": {"type": "integer", "minimum": 1, "maximum": 86400}, "label": S}),
    "tool_choice": {"anyOf": [_fn("get_time", {"tz": S}), _fn("get_date", {"tz": S})]},
    "user_profile": {"type": "object", "properties": {
        "id": {"type": "string", "format": "uuid"}, "name": S, "email": {"type": "string", "format": "email"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150}, "tags": {"type": "array", "items": S, "maxItems": 8},
        "address": {"type": "object", "properties": {"street": S, "city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city"]}}, "required": ["id", "name", "email"]},
    "paginated_list": {"type": "object", "properties": {
        "items": {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"}, "title": S},
                                             "required": ["id", "title"]}, "maxItems": 10},
        "next_cursor": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "total": {"type": "integer"}},
        "required": ["items", "total"]},
    "error_response": {"type": "object", "properties": {
        "error": {"type": "object", "properties": {"code": {"type": "integer", "minimum": 400, "maximum": 599},
                                                   "message": S, "details": {"type": "array", "items": S}},
                  "required": ["code", "message"]}}, "required": ["error"]},
    "sentiment": {"type": "object", "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                                                   "score": {"type": "number", "minimum": 0, "maximum": 1}},
                  "required": ["label", "score"], "additionalProperties": False},
    "ner": {"type": "object", "properties": {"entities": {"type": "array", "items": {"type": "object", "properties": {
        "text": S, "type": {"enum": ["PERSON", "ORG", "LOC", "DATE"]}, "start": {"type": "integer", "minimum": 0}},
        "required": ["text", "type"]}}}, "required": ["entities"]},
    "order": {"$defs": {"item": {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z0-9-]{4,12}$"},
                                                                  "qty": {"type": "integer", "minimum": 1}},
                                 "required": ["sku", "qty"]}},
              "type": "object", "properties": {"order_id": {"type": "string"}, "lines": {"type": "array",
                                               "items": {"$ref": "#/$defs/item"}, "minItems": 1},
                                               "status": {"enum": ["new", "paid", "shipped"]}},
              "required": ["order_id", "lines", "status"]},
    "geo": {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                             "lon": {"type": "number", "minimum": -180, "maximum": 180}},
            "required": ["lat", "lon"], "additionalProperties": False},
    "recipe": {"type": "object", "properties": {"title": S, "servings": {"type": "integer"},
                                                "ingredients": {"type": "array", "items": {"type": "object", "properties": {
                                                    "name": S, "amount": {"type": "number"}, "unit": S}}},
                                                "steps": {"type": "array", "items": {"type": "string"}}},
               "required": ["title", "ingredients", "steps"]},
    "classification": {"type": "object", "properties": {"categories": {"type": "array", "items": {
        "enum": ["billing", "bug", "feature", "question", "other"]}, "minItems": 1, "maxItems": 3},
        "urgent": {"type": "boolean"}}, "required": ["categories", "urgent"]},
    "nested_config": {"type": "object", "properties": {"server": {"type": "object", "properties": {
        "host": S, "port": {"type": "integer", "minimum": 1, "maximum": 65535},
        "tls": {"type": "object", "properties": {"enabled": {"type": "boolean"}, "cert": S}}}},
        "replicas": {"type": "integer", "minimum": 1}}, "required": ["server"]},
    "summary": {"type": "object", "properties": {"title": S, "bullets": {"type": "array", "items": S, "minItems": 1,
                                                                         "maxItems": 5}},
                "required": ["title", "bullets"], "additionalProperties": False},
}
assert len(SCHEMAS) == 20


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


# ---------------------------------------------------------------------------------------------------- 1. overhead
class TimedProcessor:
    """Wraps a processor and records the seconds each call takes (the overhead generate() sees)."""

    def __init__(self, proc):
        self.proc, self.times = proc, []

    def __call__(self, input_ids, scores):
        t0 = time.perf_counter()
        out = self.proc(input_ids, scores)
        self.times.append(time.perf_counter() - t0)
        return out


LONG_SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 2000, "maxLength": 4000}},
               "required": ["story"]}  # does not finish within the measured tokens: every row generates exactly n


def bench_overhead(model, tok, n_tokens, repeats, backend):
    rows = []
    for batch in (1, 8):
        prompt = tok.apply_chat_template([{"role": "user", "content": "Write a short story about a robot as JSON."}],
                                         tokenize=False, add_generation_prompt=True)
        enc = tok([prompt] * batch, return_tensors="pt")
        gen = dict(max_new_tokens=n_tokens, do_sample=True, top_k=50, pad_token_id=tok.pad_token_id)
        model.generate(**enc, max_new_tokens=2, pad_token_id=tok.pad_token_id)  # warm-up
        plain, constrained, proc_times = [], [], []
        for r in range(repeats):
            torch.manual_seed(r)
            t0 = time.perf_counter()
            out = model.generate(**enc, min_new_tokens=n_tokens, **gen)
            plain.append((time.perf_counter() - t0) / (out.shape[1] - enc.input_ids.shape[1]))
            timed = TimedProcessor(JSONSchemaLogitsProcessor(LONG_SCHEMA, tok, backend=backend))
            torch.manual_seed(r)
            t0 = time.perf_counter()
            out = model.generate(**enc, logits_processor=LogitsProcessorList([timed]), **gen)
            constrained.append((time.perf_counter() - t0) / (out.shape[1] - enc.input_ids.shape[1]))
            proc_times += timed.times
            assert timed.proc.finish_reasons == [None] * batch, timed.proc.finish_reasons
        p, c, m = statistics.median(plain), statistics.median(constrained), statistics.mean(proc_times)
        rows.append(dict(backend=backend, batch=batch, tokens=n_tokens, plain_ms=1e3 * p, constrained_ms=1e3 * c,
                         overhead_pct=100 * (c - p) / p, processor_ms=1e3 * m, processor_pct=100 * m / p,
                         processor_p99_ms=1e3 * pct(proc_times, 99)))
    return rows


# ----------------------------------------------------------------------------------------------------- 2. compile
def bench_compile(tok, backend):
    from hf_attn_patch.grammar.vocab import get_adapter

    adapter = get_adapter(tok)
    t0 = time.perf_counter()  # tokenizer adaptation: once per tokenizer, not part of a schema's compile time
    adapter.llguidance_tokenizer() if backend == "llguidance" else adapter.xgrammar_compiler()
    adapt_ms = 1e3 * (time.perf_counter() - t0)
    compile_ms, first_mask_ms = [], []
    for name, schema in SCHEMAS.items():
        if backend == "xgrammar":
            adapter.xgrammar_compiler().clear_cache()
        t0 = time.perf_counter()
        g = compile_grammar(GrammarSpec.json_schema(schema), tok, backend=backend, cache=False)
        t1 = time.perf_counter()
        state = g.new_state()
        mask = bm.allocate_bitmask(1, state.vocab_size)
        state.fill_bitmask(mask, 0)
        t2 = time.perf_counter()
        compile_ms.append(1e3 * (t1 - t0))
        first_mask_ms.append(1e3 * (t2 - t1))
    return dict(backend=backend, n=len(SCHEMAS), adapt_ms=adapt_ms, compile_p50=pct(compile_ms, 50), compile_p99=pct(compile_ms, 99),
                compile_max=max(compile_ms), first_mask_p50=pct(first_mask_ms, 50), first_mask_p99=pct(first_mask_ms, 99))


# ------------------------------------------------------------------------------------------------ 3. fast-forward
@torch.no_grad()
def constrained_greedy(model, ids, state, max_new, fast_forward):
    """Greedy decode of one row under `state`; with fast_forward, forced tokens join the next forward pass."""
    cache, new, out, forwards = DynamicCache(config=model.config), ids, [], 0
    mask = bm.allocate_bitmask(1, state.vocab_size)
    while len(out) < max_new and not state.is_terminated():
        logits = model(new, **cache_kwarg(cache), use_cache=True).logits[:, -1].float()
        forwards += 1
        state.fill_bitmask(mask, 0)
        tok_id = int(bm.apply_bitmask_(logits, mask).argmax(-1))
        if tok_id in state.eos_token_ids or not state.accept_token(tok_id):
            break
        step = [tok_id]
        if fast_forward:
            forced = state.forced_tokens()[: max_new - len(out) - 1]
            step += forced[: state.accept_tokens(forced)]
        out += step
        new = torch.tensor([step])
    return out, forwards


def bench_fast_forward(model, tok, backend, max_new=96):
    rows = []
    for name in ("get_weather", "book_flight", "create_event", "user_profile"):
        prompt = tok.apply_chat_template([{"role": "user", "content": f"Produce a {name} JSON for a demo."}],
                                         tokenize=False, add_generation_prompt=True)
        ids = tok(prompt, return_tensors="pt").input_ids
        g = compile_grammar(GrammarSpec.json_schema(SCHEMAS[name]), tok, backend=backend)
        res = {}
        for ff in (False, True):
            constrained_greedy(model, ids, g.new_state(), 2, ff)  # warm-up
            t0 = time.perf_counter()
            out, forwards = constrained_greedy(model, ids, g.new_state(), max_new, ff)
            res[ff] = (time.perf_counter() - t0, len(out), forwards, tok.decode(out))
        valid = []
        for ff in (False, True):
            try:
                json.loads(res[ff][3])
                valid.append("yes")
            except json.JSONDecodeError:
                valid.append("no (cut)" if res[ff][1] >= max_new else "no")
        rows.append(dict(backend=backend, schema=name, tokens_plain=res[False][1], forwards_plain=res[False][2],
                         s_plain=res[False][0], tokens_ff=res[True][1], forwards_ff=res[True][2], s_ff=res[True][0],
                         speedup=res[False][0] / res[True][0], valid_plain=valid[0], valid_ff=valid[1],
                         same_text=res[False][3] == res[True][3]))
    return rows


# ------------------------------------------------------------------------------------------------ 4. competitors
def bench_competitors(model, tok, n_tokens):
    schema = SCHEMAS["get_weather"]
    prompt = tok.apply_chat_template([{"role": "user", "content": "Get the weather in Paris as a function call."}],
                                     tokenize=False, add_generation_prompt=True)
    enc = tok([prompt], return_tensors="pt")
    rows = []

    def run(name, make_processor):
        valid, per_token = 0, []
        try:
            for seed in range(3):
                proc = make_processor()
                torch.manual_seed(seed)
                t0 = time.perf_counter()
                out = model.generate(**enc, max_new_tokens=n_tokens, do_sample=True, top_k=50,
                                     logits_processor=LogitsProcessorList([proc]), pad_token_id=tok.pad_token_id)
                n = out.shape[1] - enc.input_ids.shape[1]
                per_token.append((time.perf_counter() - t0) / max(n, 1))
                text = tok.decode(out[0, enc.input_ids.shape[1]:], skip_special_tokens=True)
                try:
                    import jsonschema

                    jsonschema.validate(json.loads(text), schema)
                    valid += 1
                except Exception:  # noqa: BLE001  (invalid JSON or schema violation: counted as invalid)
                    pass
            rows.append(dict(engine=name, status="ok", valid=f"{valid}/3", ms_per_token=1e3 * statistics.median(per_token)))
        except Exception as err:  # noqa: BLE001  (a competitor failing offline is a result, not a crash)
            rows.append(dict(engine=name, status=f"failed: {type(err).__name__}: {str(err).splitlines()[0][:120]}",
                             valid="-", ms_per_token=float("nan")))

    run("hf_attn_patch (llguidance)", lambda: JSONSchemaLogitsProcessor(schema, tok, backend="llguidance"))
    run("hf_attn_patch (xgrammar)", lambda: JSONSchemaLogitsProcessor(schema, tok, backend="xgrammar"))
    try:
        from transformers_cfg.generation.logits_process import GrammarConstrainedLogitsProcessor
        from transformers_cfg.grammar_utils import IncrementalGrammarConstraint

        gbnf = ('root ::= "{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"" [a-zA-Z ]{1,40} '
                '"\\", \\"unit\\": \\"" ("celsius" | "fahrenheit") "\\"}}"')
        run("transformers-cfg 0.2.7 (GBNF equivalent)",
            lambda: GrammarConstrainedLogitsProcessor(IncrementalGrammarConstraint(gbnf, "root", tok)))
    except Exception as err:  # noqa: BLE001
        rows.append(dict(engine="transformers-cfg", status=f"not run: {type(err).__name__}: {str(err).splitlines()[0][:120]}",
                         valid="-", ms_per_token=float("nan")))
    try:
        import outlines
        from outlines.backends import get_json_schema_logits_processor

        o_model = outlines.from_transformers(model, tok)
        t0 = time.perf_counter()
        o_proc = get_json_schema_logits_processor("outlines_core", o_model, json.dumps(schema))
        compile_s = time.perf_counter() - t0

        def fresh():
            o_proc.reset()
            return o_proc

        run(f"outlines {outlines.__version__ if hasattr(outlines, '__version__') else ''} (outlines_core; compile "
            f"{compile_s:.1f} s)", fresh)
    except Exception as err:  # noqa: BLE001
        rows.append(dict(engine="outlines", status=f"not run: {type(err).__name__}: {str(err).splitlines()[0][:120]}",
                         valid="-", ms_per_token=float("nan")))
    return rows


# ------------------------------------------------------------------------------------------------------- report
def table(rows, cols):
    lines = ["| " + " | ".join(h for h, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r) if callable(fmt) else str(r[fmt]) for _, fmt in cols) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=48, help="generated tokens per overhead run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: stable on a shared 2-core box)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--extras", default="/tmp/grammar_extras", help="extra sys.path entry for the competitors")
    ap.add_argument("--skip", nargs="*", default=[], choices=["overhead", "compile", "ff", "competitors"])
    args = ap.parse_args()
    sys.path.append(args.extras)
    torch.set_num_threads(args.threads)
    model, tok = load_smollm2()
    tok.padding_side = "left"
    results = {"torch_threads": torch.get_num_threads(), "command": " ".join(["python"] + sys.argv)}
    print(f"SmolLM2-135M-Instruct fp32, CPU, torch threads={torch.get_num_threads()}\n")

    if "compile" not in args.skip:
        rows = [bench_compile(tok, b) for b in ("llguidance", "xgrammar")]
        results["compile"] = rows
        print("## Compile and first mask (20 schemas, SmolLM2 vocabulary 49,152, no cache)\n")
        print(table(rows, [("backend", "backend"), ("schemas", "n"),
                           ("tokenizer adaptation ms (once)", lambda r: f"{r['adapt_ms']:.0f}"),
                           ("compile p50 ms", lambda r: f"{r['compile_p50']:.1f}"),
                           ("compile p99 ms", lambda r: f"{r['compile_p99']:.1f}"),
                           ("first mask p50 ms", lambda r: f"{r['first_mask_p50']:.2f}"),
                           ("first mask p99 ms", lambda r: f"{r['first_mask_p99']:.2f}")]) + "\n")
    if "overhead" not in args.skip:
        rows = []
        for b in ("llguidance", "xgrammar"):
            rows += bench_overhead(model, tok, args.tokens, args.repeats, b)
        results["overhead"] = rows
        print(f"## Per-token overhead in generate() ({args.tokens} tokens, sampling, median of {args.repeats})\n")
        print(table(rows, [("backend", "backend"), ("batch", "batch"),
                           ("unconstrained ms/token", lambda r: f"{r['plain_ms']:.1f}"),
                           ("constrained ms/token", lambda r: f"{r['constrained_ms']:.1f}"),
                           ("end-to-end overhead", lambda r: f"{r['overhead_pct']:+.1f}%"),
                           ("processor ms/call (mean)", lambda r: f"{r['processor_ms']:.2f}"),
                           ("processor p99 ms", lambda r: f"{r['processor_p99_ms']:.2f}"),
                           ("processor / step", lambda r: f"{r['processor_pct']:.1f}%")]) + "\n")
    if "ff" not in args.skip:
        rows = []
        for b in ("llguidance", "xgrammar"):
            rows += bench_fast_forward(model, tok, b)
        results["fast_forward"] = rows
        print("## Fast-forward: forced tokens appended without a model step (batch 1, greedy, max 96 tokens)\n")
        print(table(rows, [("backend", "backend"), ("schema", "schema"),
                           ("tokens / forwards (plain)", lambda r: f"{r['tokens_plain']} / {r['forwards_plain']}"),
                           ("tokens / forwards (ff)", lambda r: f"{r['tokens_ff']} / {r['forwards_ff']}"),
                           ("time plain s", lambda r: f"{r['s_plain']:.2f}"), ("time ff s", lambda r: f"{r['s_ff']:.2f}"),
                           ("speed-up", lambda r: f"{r['speedup']:.2f}x"),
                           ("valid plain / ff", lambda r: f"{r['valid_plain']} / {r['valid_ff']}"),
                           ("same text", "same_text")]) + "\n")
    if "competitors" not in args.skip:
        rows = bench_competitors(model, tok, 40)
        results["competitors"] = rows
        print("## Side by side: get_weather function call, sampling, 3 seeds, max 40 tokens\n")
        print(table(rows, [("engine", "engine"), ("status", "status"), ("valid", "valid"),
                           ("ms/token", lambda r: f"{r['ms_per_token']:.1f}")]) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        traceback.print_exc()
        sys.exit(1)
