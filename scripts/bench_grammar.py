"""Structured output: the cost of JSON-Schema masks per decode step, and completeness / soundness on real schemas.

    .venv/bin/python scripts/bench_grammar.py PART [options]     # PART --help: its options

Parts:
    masks      compile time, mask cost per step, forced-token fast-forward; outlines / xgrammar when importable
               (install them where PYTHONPATH finds them, e.g. PYTHONPATH=/tmp/grammar_extras)
    schemas    JSONSchemaBench: schemas refused, valid instances accepted, invalid ones caught, generation
    key-order  the cost of accepting object keys in any order against the schema's order
"""

from __future__ import annotations

import json
import logging
import random
import re
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from transformers import DynamicCache, LogitsProcessorList

from hf_attn_patch.compat import cache_kwarg
from hf_attn_patch.grammar import GrammarError, GrammarSpec, GrammarState, JSONSchemaLogitsProcessor, compile_grammar
from hf_attn_patch.grammar import bitmask as bm
from hf_attn_patch.grammar.backends import LLGuidanceBackend
from hf_attn_patch.grammar.formats import format_checker, known_formats
from hf_attn_patch.grammar.schema_checks import SchemaChecks
from hf_attn_patch.grammar.schema_relax import relax_and_compile
from hf_attn_patch.grammar.vocab import get_adapter
from hf_attn_patch.models.pretrained import load_smollm2

import benchlib


# --------------------------------------------------------------------------------------------------------------- masks
# ------------------------------------------------------------------------------------------------------ schemas
def _fn(name, props, required=None):
    return {
        "type": "object",
        "properties": {
            "name": {"const": name},
            "arguments": {
                "type": "object",
                "properties": props,
                "required": required or list(props),
                "additionalProperties": False,
            },
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


S = {"type": "string", "maxLength": 40}
SCHEMAS = {
    "get_weather": _fn("get_weather", {"city": S, "unit": {"enum": ["celsius", "fahrenheit"]}}),
    "search_web": _fn("search_web", {"query": S, "max_results": {"type": "integer", "minimum": 1, "maximum": 20}}),
    "send_email": _fn(
        "send_email",
        {
            "to": {"type": "string", "format": "email"},
            "subject": S,
            "body": S,
            "cc": {"type": "array", "items": {"type": "string", "format": "email"}, "maxItems": 3},
        },
        ["to", "subject", "body"],
    ),
    "create_event": _fn(
        "create_event",
        {
            "title": S,
            "date": {"type": "string", "format": "date"},
            "start": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
            "attendees": {"type": "array", "items": S, "maxItems": 5},
        },
    ),
    "book_flight": _fn(
        "book_flight",
        {
            "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
            "class": {"enum": ["economy", "business", "first"]},
        },
    ),
    "sql_query": _fn(
        "run_sql", {"sql": {"type": "string", "maxLength": 200}, "timeout_s": {"type": "number", "minimum": 0}}
    ),
    "translate": _fn("translate", {"text": S, "target": {"enum": ["en", "fr", "de", "es", "ja"]}}),
    "set_timer": _fn("set_timer", {"seconds": {"type": "integer", "minimum": 1, "maximum": 86400}, "label": S}),
    "tool_choice": {"anyOf": [_fn("get_time", {"tz": S}), _fn("get_date", {"tz": S})]},
    "user_profile": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "format": "uuid"},
            "name": S,
            "email": {"type": "string", "format": "email"},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": S, "maxItems": 8},
            "address": {
                "type": "object",
                "properties": {"street": S, "city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city"],
            },
        },
        "required": ["id", "name", "email"],
    },
    "paginated_list": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"id": {"type": "integer"}, "title": S},
                    "required": ["id", "title"],
                },
                "maxItems": 10,
            },
            "next_cursor": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "total": {"type": "integer"},
        },
        "required": ["items", "total"],
    },
    "error_response": {
        "type": "object",
        "properties": {
            "error": {
                "type": "object",
                "properties": {
                    "code": {"type": "integer", "minimum": 400, "maximum": 599},
                    "message": S,
                    "details": {"type": "array", "items": S},
                },
                "required": ["code", "message"],
            }
        },
        "required": ["error"],
    },
    "sentiment": {
        "type": "object",
        "properties": {
            "label": {"enum": ["positive", "negative", "neutral"]},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["label", "score"],
        "additionalProperties": False,
    },
    "ner": {
        "type": "object",
        "properties": {
            "entities": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "text": S,
                        "type": {"enum": ["PERSON", "ORG", "LOC", "DATE"]},
                        "start": {"type": "integer", "minimum": 0},
                    },
                    "required": ["text", "type"],
                },
            }
        },
        "required": ["entities"],
    },
    "order": {
        "$defs": {
            "item": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z0-9-]{4,12}$"},
                    "qty": {"type": "integer", "minimum": 1},
                },
                "required": ["sku", "qty"],
            }
        },
        "type": "object",
        "properties": {
            "order_id": {"type": "string"},
            "lines": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1},
            "status": {"enum": ["new", "paid", "shipped"]},
        },
        "required": ["order_id", "lines", "status"],
    },
    "geo": {
        "type": "object",
        "properties": {
            "lat": {"type": "number", "minimum": -90, "maximum": 90},
            "lon": {"type": "number", "minimum": -180, "maximum": 180},
        },
        "required": ["lat", "lon"],
        "additionalProperties": False,
    },
    "recipe": {
        "type": "object",
        "properties": {
            "title": S,
            "servings": {"type": "integer"},
            "ingredients": {
                "type": "array",
                "items": {"type": "object", "properties": {"name": S, "amount": {"type": "number"}, "unit": S}},
            },
            "steps": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["title", "ingredients", "steps"],
    },
    "classification": {
        "type": "object",
        "properties": {
            "categories": {
                "type": "array",
                "items": {"enum": ["billing", "bug", "feature", "question", "other"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "urgent": {"type": "boolean"},
        },
        "required": ["categories", "urgent"],
    },
    "nested_config": {
        "type": "object",
        "properties": {
            "server": {
                "type": "object",
                "properties": {
                    "host": S,
                    "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                    "tls": {"type": "object", "properties": {"enabled": {"type": "boolean"}, "cert": S}},
                },
            },
            "replicas": {"type": "integer", "minimum": 1},
        },
        "required": ["server"],
    },
    "summary": {
        "type": "object",
        "properties": {"title": S, "bullets": {"type": "array", "items": S, "minItems": 1, "maxItems": 5}},
        "required": ["title", "bullets"],
        "additionalProperties": False,
    },
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


LONG_SCHEMA = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 2000, "maxLength": 4000}},
    "required": ["story"],
}  # does not finish within the measured tokens: every row generates exactly n


def bench_overhead(model, tok, n_tokens, repeats, backend):
    rows = []
    for batch in (1, 8):
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": "Write a short story about a robot as JSON."}],
            tokenize=False,
            add_generation_prompt=True,
        )
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
        rows.append(
            dict(
                backend=backend,
                batch=batch,
                tokens=n_tokens,
                plain_ms=1e3 * p,
                constrained_ms=1e3 * c,
                overhead_pct=100 * (c - p) / p,
                processor_ms=1e3 * m,
                processor_pct=100 * m / p,
                processor_p99_ms=1e3 * pct(proc_times, 99),
            )
        )
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
    return dict(
        backend=backend,
        n=len(SCHEMAS),
        adapt_ms=adapt_ms,
        compile_p50=pct(compile_ms, 50),
        compile_p99=pct(compile_ms, 99),
        compile_max=max(compile_ms),
        first_mask_p50=pct(first_mask_ms, 50),
        first_mask_p99=pct(first_mask_ms, 99),
    )


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
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": f"Produce a {name} JSON for a demo."}],
            tokenize=False,
            add_generation_prompt=True,
        )
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
        rows.append(
            dict(
                backend=backend,
                schema=name,
                tokens_plain=res[False][1],
                forwards_plain=res[False][2],
                s_plain=res[False][0],
                tokens_ff=res[True][1],
                forwards_ff=res[True][2],
                s_ff=res[True][0],
                speedup=res[False][0] / res[True][0],
                valid_plain=valid[0],
                valid_ff=valid[1],
                same_text=res[False][3] == res[True][3],
            )
        )
    return rows


# ------------------------------------------------------------------------------------------------ 4. competitors
def bench_competitors(model, tok, n_tokens):
    schema = SCHEMAS["get_weather"]
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Get the weather in Paris as a function call."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    enc = tok([prompt], return_tensors="pt")
    rows = []

    def run(name, make_processor):
        valid, per_token = 0, []
        try:
            for seed in range(3):
                proc = make_processor()
                torch.manual_seed(seed)
                t0 = time.perf_counter()
                out = model.generate(
                    **enc,
                    max_new_tokens=n_tokens,
                    do_sample=True,
                    top_k=50,
                    logits_processor=LogitsProcessorList([proc]),
                    pad_token_id=tok.pad_token_id,
                )
                n = out.shape[1] - enc.input_ids.shape[1]
                per_token.append((time.perf_counter() - t0) / max(n, 1))
                text = tok.decode(out[0, enc.input_ids.shape[1] :], skip_special_tokens=True)
                try:
                    import jsonschema

                    jsonschema.validate(json.loads(text), schema)
                    valid += 1
                except Exception:  # noqa: BLE001  (invalid JSON or schema violation: counted as invalid)
                    pass
            rows.append(
                dict(engine=name, status="ok", valid=f"{valid}/3", ms_per_token=1e3 * statistics.median(per_token))
            )
        except Exception as err:  # noqa: BLE001  (a competitor failing offline is a result, not a crash)
            rows.append(
                dict(
                    engine=name,
                    status=f"failed: {type(err).__name__}: {str(err).splitlines()[0][:120]}",
                    valid="-",
                    ms_per_token=float("nan"),
                )
            )

    run("hf_attn_patch (llguidance)", lambda: JSONSchemaLogitsProcessor(schema, tok, backend="llguidance"))
    run("hf_attn_patch (xgrammar)", lambda: JSONSchemaLogitsProcessor(schema, tok, backend="xgrammar"))
    try:
        from transformers_cfg.generation.logits_process import GrammarConstrainedLogitsProcessor
        from transformers_cfg.grammar_utils import IncrementalGrammarConstraint

        gbnf = (
            'root ::= "{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"" [a-zA-Z ]{1,40} '
            '"\\", \\"unit\\": \\"" ("celsius" | "fahrenheit") "\\"}}"'
        )
        run(
            "transformers-cfg 0.2.7 (GBNF equivalent)",
            lambda: GrammarConstrainedLogitsProcessor(IncrementalGrammarConstraint(gbnf, "root", tok)),
        )
    except Exception as err:  # noqa: BLE001
        rows.append(
            dict(
                engine="transformers-cfg",
                status=f"not run: {type(err).__name__}: {str(err).splitlines()[0][:120]}",
                valid="-",
                ms_per_token=float("nan"),
            )
        )
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

        run(
            f"outlines {outlines.__version__ if hasattr(outlines, '__version__') else ''} (outlines_core; compile "
            f"{compile_s:.1f} s)",
            fresh,
        )
    except Exception as err:  # noqa: BLE001
        rows.append(
            dict(
                engine="outlines",
                status=f"not run: {type(err).__name__}: {str(err).splitlines()[0][:120]}",
                valid="-",
                ms_per_token=float("nan"),
            )
        )
    return rows


# ------------------------------------------------------------------------------------------------------- report
def table(rows, cols):
    lines = ["| " + " | ".join(h for h, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r) if callable(fmt) else str(r[fmt]) for _, fmt in cols) + " |")
    return "\n".join(lines)


def masks_options(parser) -> None:
    parser.add_argument("--tokens", type=int, default=48, help="generated tokens per overhead run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1: stable on a shared 2-core box)"
    )
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--skip", nargs="*", default=[], choices=["overhead", "compile", "ff", "competitors"])


def masks(args):
    """Grammar-constrained decoding benchmark: one run prints every table (markdown).

    1. Per-token overhead of constrained vs unconstrained generate() on SmolLM2-135M, batch 1 and 8 (same number of
       generated tokens), and the processor's own time per call measured inside generate().
    2. Compile time p50 / p99 and first-mask time over 20 function-calling / API-response schemas, llguidance and xgrammar.
    3. Fast-forward (forced tokens appended without a model step) vs plain constrained decoding, batch 1, greedy.
    4. transformers-cfg and outlines side by side when they import and run offline (else the reason is printed).

    Usage: .venv/bin/python scripts/bench_grammar.py masks [--json scripts/results/grammar/masks.json] [--tokens 48]
        [--repeats 3]
    Optional competitors: installed in the venv, or where PYTHONPATH finds them, e.g.
    `pip install --no-deps --target /tmp/grammar_extras transformers-cfg outlines outlines_core genson cloudpickle`
    and `PYTHONPATH=/tmp/grammar_extras`.
    """
    torch.set_num_threads(args.threads)
    model, tok = load_smollm2()
    tok.padding_side = "left"
    results = {"torch_threads": torch.get_num_threads(), "command": " ".join(["python"] + sys.argv)}
    print(f"SmolLM2-135M-Instruct fp32, CPU, torch threads={torch.get_num_threads()}\n")

    if "compile" not in args.skip:
        rows = [bench_compile(tok, b) for b in ("llguidance", "xgrammar")]
        results["compile"] = rows
        print("## Compile and first mask (20 schemas, SmolLM2 vocabulary 49,152, no cache)\n")
        print(
            table(
                rows,
                [
                    ("backend", "backend"),
                    ("schemas", "n"),
                    ("tokenizer adaptation ms (once)", lambda r: f"{r['adapt_ms']:.0f}"),
                    ("compile p50 ms", lambda r: f"{r['compile_p50']:.1f}"),
                    ("compile p99 ms", lambda r: f"{r['compile_p99']:.1f}"),
                    ("first mask p50 ms", lambda r: f"{r['first_mask_p50']:.2f}"),
                    ("first mask p99 ms", lambda r: f"{r['first_mask_p99']:.2f}"),
                ],
            )
            + "\n"
        )
    if "overhead" not in args.skip:
        rows = []
        for b in ("llguidance", "xgrammar"):
            rows += bench_overhead(model, tok, args.tokens, args.repeats, b)
        results["overhead"] = rows
        print(f"## Per-token overhead in generate() ({args.tokens} tokens, sampling, median of {args.repeats})\n")
        print(
            table(
                rows,
                [
                    ("backend", "backend"),
                    ("batch", "batch"),
                    ("unconstrained ms/token", lambda r: f"{r['plain_ms']:.1f}"),
                    ("constrained ms/token", lambda r: f"{r['constrained_ms']:.1f}"),
                    ("end-to-end overhead", lambda r: f"{r['overhead_pct']:+.1f}%"),
                    ("processor ms/call (mean)", lambda r: f"{r['processor_ms']:.2f}"),
                    ("processor p99 ms", lambda r: f"{r['processor_p99_ms']:.2f}"),
                    ("processor / step", lambda r: f"{r['processor_pct']:.1f}%"),
                ],
            )
            + "\n"
        )
    if "ff" not in args.skip:
        rows = []
        for b in ("llguidance", "xgrammar"):
            rows += bench_fast_forward(model, tok, b)
        results["fast_forward"] = rows
        print("## Fast-forward: forced tokens appended without a model step (batch 1, greedy, max 96 tokens)\n")
        print(
            table(
                rows,
                [
                    ("backend", "backend"),
                    ("schema", "schema"),
                    ("tokens / forwards (plain)", lambda r: f"{r['tokens_plain']} / {r['forwards_plain']}"),
                    ("tokens / forwards (ff)", lambda r: f"{r['tokens_ff']} / {r['forwards_ff']}"),
                    ("time plain s", lambda r: f"{r['s_plain']:.2f}"),
                    ("time ff s", lambda r: f"{r['s_ff']:.2f}"),
                    ("speed-up", lambda r: f"{r['speedup']:.2f}x"),
                    ("valid plain / ff", lambda r: f"{r['valid_plain']} / {r['valid_ff']}"),
                    ("same text", "same_text"),
                ],
            )
            + "\n"
        )
    if "competitors" not in args.skip:
        rows = bench_competitors(model, tok, 40)
        results["competitors"] = rows
        print("## Side by side: get_weather function call, sampling, 3 seeds, max 40 tokens\n")
        print(
            table(
                rows,
                [
                    ("engine", "engine"),
                    ("status", "status"),
                    ("valid", "valid"),
                    ("ms/token", lambda r: f"{r['ms_per_token']:.1f}"),
                ],
            )
            + "\n"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


# ------------------------------------------------------------------------------------------------------------- schemas
def load_sample(git_dir: str, n: int, seed: int) -> tuple[list[tuple[str, dict]], int]:
    """((name, MaskBench entry) for a seeded random sample of n files of maskbench/data (sorted names first), files
    stored out of the mirror (large files) that were skipped)."""
    names = subprocess.run(
        ["git", "--git-dir", git_dir, "ls-tree", "-r", "--name-only", "HEAD", "maskbench/data/"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    names = sorted(x for x in names if x.endswith(".json"))
    picked = random.Random(seed).sample(names, min(n, len(names)))
    request = "".join(f"HEAD:{x}\n" for x in picked).encode()
    batch = subprocess.run(
        ["git", "--git-dir", git_dir, "cat-file", "--batch"], input=request, capture_output=True, check=False
    ).stdout
    out, pos, missing = [], 0, 0
    for name in picked:
        header_end = batch.index(b"\n", pos)
        header = batch[pos:header_end].split()
        if header[-1] == b"missing":
            missing, pos = missing + 1, header_end + 1
            continue
        size = int(header[2])
        out.append((name, json.loads(batch[header_end + 1 : header_end + 1 + size])))
        pos = header_end + 1 + size + 1
    return out, missing


def split_of(name: str) -> str:
    """The source split of a MaskBench file: "Github_hard---o123.json" -> Github_hard, "BFCL_sql_2.json" -> BFCL_sql."""
    base = name.rsplit("/", 1)[-1]
    return base.split("---")[0] if "---" in base else re.sub(r"_\d+\.json$", "", base)


def encode(adapter, text: str) -> list[int]:
    """Token ids of `text` as the grammar sees the vocabulary (no SentencePiece prefix space)."""
    return adapter.llguidance_tokenizer().tokenize_str(text)


def schema_order(data, locator, path=()):
    """`data` with the keys of every object in the order the schema lists its properties (the order llguidance
    generates them in: its documented "stable property order"); keys the schema does not list keep their order, last.
    The JSON value is unchanged."""
    if isinstance(data, list):
        return [schema_order(v, locator, path + (i,)) for i, v in enumerate(data)]
    if not isinstance(data, dict):
        return data
    order: list = []

    def collect(s, depth=0):
        if not isinstance(s, dict) or depth > 4:
            return
        props = s.get("properties")
        if isinstance(props, dict):
            order.extend(k for k in props if k not in order)
        for key in ("anyOf", "oneOf", "allOf"):
            for sub in s.get(key) or [] if isinstance(s.get(key), list) else []:
                for node in locator._expand([sub]):
                    collect(node, depth + 1)

    for node in locator.nodes_at(path):
        collect(node)
    rank = {k: i for i, k in enumerate(order)}
    keys = sorted(data, key=lambda k: (rank.get(k, len(rank)), list(data).index(k)))
    return {k: schema_order(data[k], locator, path + (k,)) for k in keys}


def replay(state: GrammarState, ids: list[int], clock=time.perf_counter) -> tuple[bool, float, int]:
    """(every token allowed by the mask and EOS allowed at the end, seconds in fill_bitmask by `clock`, masks
    computed)."""
    mask = bm.allocate_bitmask(1, state.vocab_size)
    seconds, steps = 0.0, 0
    for t in ids:
        t0 = clock()
        state.fill_bitmask(mask, 0)
        seconds += clock() - t0
        steps += 1
        if not bm.unpack(mask, state.vocab_size)[0, t] or not state.accept_token(t):
            return False, seconds, steps
    t0 = clock()
    state.fill_bitmask(mask, 0)
    seconds += clock() - t0
    return bool(bm.unpack(mask, state.vocab_size)[0, state.eos_token_ids[0]]), seconds, steps + 1


def plain_state(compiled, adapter) -> GrammarState:
    """The compiled grammar's backend matcher alone (no exact checks): the plain path."""
    return GrammarState(
        compiled.backend.matcher(compiled._compiled),
        adapter.eos_token_ids,
        adapter.vocab_size,
        backend="plain",
        banned_token_ids=adapter.special_token_ids,
    )


def validator(schema):
    import jsonschema
    from jsonschema.validators import validator_for

    cls = validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=format_checker())


ORDERS = ("schema", "any")
STYLES = {"compact": {"separators": (",", ":")}, "indented": {"indent": 2}}


def replay_valid(grammars: dict, adapter, data, locator, timing: dict) -> dict:
    """Completeness of one valid instance: {style: ok} for the raw text in every whitespace style ("raw": the
    default grammar's ", " and ": "; "compact" and "indented": the whitespace-flexible grammar), and "normalised"
    (keys in schema order when the raw text is refused). timing: the raw replay's (seconds, masks)."""
    out = {}
    for style in ("compact", "indented"):
        out[style] = replay(
            grammars["flexible"].new_state(), encode(adapter, json.dumps(data, ensure_ascii=False, **STYLES[style]))
        )[0]
    out["raw"], timing["seconds"], timing["steps"] = replay(
        grammars["strict"].new_state(), encode(adapter, json.dumps(data, ensure_ascii=False))
    )
    out["normalised"] = out["raw"]
    if not out["raw"] and isinstance(data, (dict, list)):
        try:
            ordered = schema_order(data, locator)
        except Exception:  # noqa: BLE001  (a schema jsonschema cannot load: the given order only)
            ordered = data
        out["normalised"] = replay(
            grammars["strict"].new_state(), encode(adapter, json.dumps(ordered, ensure_ascii=False))
        )[0]
    return out


def schemas_options(parser) -> None:
    parser.add_argument("mirror", help="git directory of guidance-ai/jsonschemabench")
    parser.add_argument("--n", type=int, default=1000, help="schemas in the sample (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="sample seed (default 0)")
    parser.add_argument(
        "--tokenizer",
        default=str(benchlib.SHARED / "models" / "stories260k"),
        help="tokenizer folder (default: stories260k)",
    )
    parser.add_argument("--generate", type=int, default=200, help="schemas of the sample to generate for (default 200)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument(
        "--smollm2",
        type=int,
        default=0,
        help="also generate with SmolLM2-135M-Instruct (greedy, chat prompt) on this many schemas",
    )
    parser.add_argument(
        "--engine",
        type=int,
        default=0,
        help="also generate with the random model in the engine (retries) on this many schemas",
    )
    parser.add_argument("--order", default="any", choices=ORDERS, help="key order of the generation runs")
    parser.add_argument(
        "--replay", type=int, default=1, help="0: compile only, no replays (for the generation figures)"
    )
    parser.add_argument(
        "--part",
        default="0/1",
        help="i/k: replay every k-th schema of the sample from the i-th (run the "
        "k parts at once, then --merge their --out files)",
    )
    parser.add_argument(
        "--merge", nargs="+", default=None, help="--out files of the parts: print their figures together"
    )
    parser.add_argument(
        "--out",
        default=None,
        help="write the figures (and the counts, for --merge) as JSON here; rewritten every 2 schemas",
    )


def schemas(args):
    """Structured output on real-world JSON Schemas (JSONSchemaBench / MaskBench): ours (widened grammar + exact checks)
    against llguidance alone, on a fixed seeded random sample, per source split (Github_hard, Kubernetes, ...).

        python scripts/bench_grammar.py schemas /path/to/jsonschemabench/git-dir --n 1000 --seed 0 --generate 200 --engine 200

    The mirror is a git directory of github.com/guidance-ai/jsonschemabench (read with git; no work tree needed); the
    schemas and their valid / invalid test instances come from maskbench/data/*.json (files stored out of the mirror are
    skipped and counted). Figures, for each key order (``property_order`` "schema" and "any"):
    - refused: schemas whose compilation raises GrammarError;
    - completeness: valid instances replayed token by token stay allowed by the mask, and EOS is allowed at the end
      (a refused schema counts its instances as not complete). "raw": the instance as given, in every whitespace style
      the grammar allows (the default grammar: ", " and ": "; a whitespace-flexible grammar: compact, default and
      indented); "normalised": an instance refused as given is replayed again with its object keys in the schema's
      order (the same JSON value);
    - soundness: invalid instances hit a masked token (EOS included) before their end (llguidance alone: a refused
      schema counts its instances as neither complete nor caught; the figures on the schemas it compiles are given too);
    - generation: a random-weight llama over the tokenizer's vocabulary samples under the processor, with +4 added to
      the logits of EOS and of the tokens holding '"', ']' or '}' (else the nearly uniform random model writes strings
      far longer than the token limit); the outputs that end with EOS are validated with jsonschema (formats checked):
      valid, invalid, named failure (check_failed), unfinished (cut by the token limit);
    - engine (--engine N): the same random model and bias in the engine, one request per schema (response_format): a
      request whose check leaves no valid continuation is rewound and decodes again (up to 3 times), else it ends
      check_failed; the outputs that end with "stop" are validated; --replay 0 skips the replays (generation only);
    - mask time per token: ours against the plain path (the same compiled grammar without checks), on the valid replays,
      for schemas that need no checks and for those that do. The machine may be shared: ratios are within one process.
    """
    if args.merge:
        print(json.dumps(merge([json.loads(Path(f).read_text()) for f in args.merge]), indent=1))
        return
    logging.getLogger("hf_attn_patch").setLevel(logging.ERROR)
    from tqdm import tqdm
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    adapter = get_adapter(tok)
    sample, missing = load_sample(args.mirror, args.n, args.seed)
    llg = LLGuidanceBackend()
    splits: dict = defaultdict(lambda: defaultdict(int))  # split -> counter
    times = defaultdict(float)
    steps = defaultdict(int)
    refusals, compiled_ok = [], []
    t_start = time.perf_counter()
    part, parts = (int(x) for x in args.part.split("/"))
    need = max(args.generate, args.engine) if not args.replay else len(sample)
    for i, (name, entry) in enumerate(tqdm(sample[part::parts] if args.replay else sample, desc="schemas")):
        if len(compiled_ok) >= need:
            break
        if args.out and i % 2 == 1:
            write(args, raw_of(args, sample, missing, splits, times, steps, refusals, t_start), {})
        schema, tests = entry["schema"], entry.get("tests") or []
        c = splits[split_of(name)]
        c["schemas"] += 1
        ours = {}
        for order in ORDERS:
            try:
                spec = GrammarSpec.json_schema(schema, order)
                ours[order] = {
                    "strict": compile_grammar(spec, tok, backend="llguidance", cache=False),
                    "flexible": compile_grammar(spec, tok, backend="llguidance", cache=False, whitespace_flexible=True),
                }
            except GrammarError as err:
                c[f"refused_{order}"] += 1
                if order == args.order:
                    refusals.append((name, str(err)[:160]))
        try:
            alone = llg.compile(GrammarSpec.json_schema(schema), adapter)
        except GrammarError:
            alone = None
            c["refused_llg"] += 1
        if args.order in ours:
            compiled_ok.append((name, schema, ours[args.order]["strict"]))
        for order in ours:
            c[f"with_checks_{order}"] += ours[order]["strict"].checks is not None
        locator = None
        for test in tests if args.replay else ():
            data = test["data"]
            if test["valid"]:
                c["valid"] += 1
                if locator is None:
                    try:
                        locator = SchemaChecks(schema, set(), [])
                    except Exception:  # noqa: BLE001
                        locator = False
                for order, grammars in ours.items():
                    timing: dict = {}
                    result = replay_valid(grammars, adapter, data, locator or None, timing)
                    for key, ok in result.items():
                        c[f"complete_{order}_{key}"] += ok
                    ids = encode(adapter, json.dumps(data, ensure_ascii=False))
                    _, sec_plain, n_plain = replay(plain_state(grammars["strict"], adapter), ids)
                    key = f"{order}_{'check' if grammars['strict'].checks is not None else 'nocheck'}"
                    if result["raw"] and timing["steps"] == n_plain:  # (the same text, one pass each)
                        times[f"ours_{key}"] += timing["seconds"]
                        times[f"plain_{key}"] += sec_plain
                        steps[key] += n_plain
                if alone is not None:
                    c["valid_llg_compiled"] += 1
                    c["complete_llg"] += replay(
                        GrammarState(llg.matcher(alone), adapter.eos_token_ids, adapter.vocab_size),
                        encode(adapter, json.dumps(data, ensure_ascii=False)),
                    )[0]
            else:
                c["invalid"] += 1
                ids = encode(adapter, json.dumps(data, ensure_ascii=False))
                for order, grammars in ours.items():
                    c[f"caught_{order}"] += not replay(grammars["strict"].new_state(), ids)[0]
                if alone is not None:
                    c["invalid_llg_compiled"] += 1
                    c["caught_llg"] += not replay(
                        GrammarState(llg.matcher(alone), adapter.eos_token_ids, adapter.vocab_size), ids
                    )[0]
    raw = raw_of(args, sample, missing, splits, times, steps, refusals, t_start)
    gens = {}
    if args.generate:
        gens["generation"] = generate(compiled_ok[: args.generate], tok, args.max_new_tokens)
    if args.smollm2:
        gens["generation_smollm2"] = generate_smollm2(sample[: args.smollm2], args.max_new_tokens, args.order)
    if args.engine:
        gens["generation_engine"] = generate_engine(compiled_ok[: args.engine], tok, args.max_new_tokens, args.order)
    print(json.dumps(write(args, raw, gens), indent=1))


def raw_of(args, sample, missing, splits, times, steps, refusals, t_start) -> dict:
    return {
        "sample": {
            "n": len(sample),
            "seed": args.seed,
            "skipped_not_in_mirror": missing,
            "part": args.part,
            "tokenizer": Path(args.tokenizer).name,
            "generation_order": args.order,
        },
        "splits": {k: dict(v) for k, v in splits.items()},
        "times": dict(times),
        "steps": dict(steps),
        "refusals": refusals,
        "replay_seconds": round(time.perf_counter() - t_start, 1),
    }


def write(args, raw: dict, gens: dict) -> dict:
    figures = {**report(raw), **gens, "counts": raw}
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1) + "\n")
    return figures


def merge(parts: list[dict]) -> dict:
    """The figures of several parts' --out files (their counts summed; generations as each part gave them)."""
    raw = {
        "sample": parts[0]["counts"]["sample"],
        "splits": {},
        "times": defaultdict(float),
        "steps": defaultdict(int),
        "refusals": [],
        "replay_seconds": 0.0,
    }
    for part in parts:
        c = part["counts"]
        for split, counter in c["splits"].items():
            into = raw["splits"].setdefault(split, defaultdict(int))
            for k, v in counter.items():
                into[k] += v
        for key in ("times", "steps"):
            for k, v in c[key].items():
                raw[key][k] += v
        raw["refusals"] += c["refusals"]
        raw["replay_seconds"] = max(raw["replay_seconds"], c["replay_seconds"])
    gens = {k: v for part in parts for k, v in part.items() if k.startswith("generation")}
    return {**report(raw), **gens}


def report(raw: dict) -> dict:
    """Figures from the counts: overall and per source split; mask time per token."""
    pct = lambda a, b: round(100.0 * a / max(b, 1), 2)  # noqa: E731

    def figures_of(c) -> dict:
        c = defaultdict(int, c)
        row = {
            "schemas": c["schemas"],
            "valid": c["valid"],
            "invalid": c["invalid"],
            "refused_pct": {o: pct(c[f"refused_{o}"], c["schemas"]) for o in ORDERS + ("llg",)},
        }
        for o in ORDERS:
            row[f"completeness_{o}_pct"] = {
                k: pct(c[f"complete_{o}_{k}"], c["valid"]) for k in ("raw", "normalised", *STYLES)
            }
        row["completeness_llg_pct"] = {
            "all": pct(c["complete_llg"], c["valid"]),
            "compiled": pct(c["complete_llg"], c["valid_llg_compiled"]),
        }
        row["soundness_pct"] = {
            **{o: pct(c[f"caught_{o}"], c["invalid"]) for o in ORDERS},
            "llg": pct(c["caught_llg"], c["invalid"]),
            "llg_compiled": pct(c["caught_llg"], c["invalid_llg_compiled"]),
        }
        row["schemas_with_checks"] = {o: c[f"with_checks_{o}"] for o in ORDERS}
        return row

    total = defaultdict(int)
    for c in raw["splits"].values():
        for k, v in c.items():
            total[k] += v
    times, steps = defaultdict(float, raw["times"]), defaultdict(int, raw["steps"])
    mask = {}
    for o in ORDERS:
        for kind in ("nocheck", "check"):
            key = f"{o}_{kind}"
            ours_us = round(1e6 * times[f"ours_{key}"] / max(steps[key], 1), 1)
            plain_us = round(1e6 * times[f"plain_{key}"] / max(steps[key], 1), 1)
            mask[key] = {
                "ours": ours_us,
                "plain": plain_us,
                "ratio": round(ours_us / plain_us, 3) if plain_us else None,
                "tokens": steps[key],
            }
    return {
        "sample": raw["sample"],
        "all": figures_of(total),
        "splits": {k: figures_of(v) for k, v in sorted(raw["splits"].items())},
        "mask_us_per_token": mask,
        "replay_seconds": raw["replay_seconds"],
        "refusals": raw["refusals"][:20],
    }


def random_model(tok):
    """(random-weight tiny llama over the tokenizer's vocabulary, seed 0; the structural logit bias [V]: +4 on EOS
    and on the tokens holding '"', ']' or '}')."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    bias = torch.zeros(len(tok))
    for t, data in enumerate(get_adapter(tok).token_bytes()):
        if any(c in data for c in b'"]}'):
            bias[t] = 4.0
    bias[tok.eos_token_id] = 4.0
    return model, bias


def judge(counts: dict, bad: list, name: str, schema: dict, reason: str, text: str) -> None:
    """Count one generated answer, overall and in its split: valid / invalid (ended, fails the schema) / check_failed
    (ended naming its failure) / dead_end / unfinished (cut by the token limit)."""
    if reason == "ended":
        try:
            ok = validator(schema).is_valid(json.loads(text))
        except ValueError:
            ok = False
        reason = "valid" if ok else "invalid"
        if not ok:
            bad.append((name, text[:200]))
    for c in (counts, counts["splits"].setdefault(split_of(name), {})):
        c[reason] = c.get(reason, 0) + 1


def new_counts(n: int) -> dict:
    return {"schemas": n, "valid": 0, "invalid": 0, "check_failed": 0, "dead_end": 0, "unfinished": 0, "splits": {}}


def generate_engine(compiled: list, tok, max_new_tokens: int, order: str) -> dict:
    """The same random model and bias (a hook on its head) in the engine, one request per schema
    (response_format, sampled, seed = its index), all in one batch: the engine rewinds a request whose check left
    no valid continuation and decodes on (finish_reason check_failed once 3 retries are spent)."""
    from hf_attn_patch.engine import Engine, SamplingParams

    model, bias = random_model(tok)
    model.lm_head.register_forward_hook(lambda module, args, logits: logits + bias[: logits.shape[-1]])
    engine = Engine(model, tok, max_num_seqs=256, max_batch_tokens=2048)
    counts = {**new_counts(len(compiled)), "requests_rewound": 0, "rewinds": 0}
    bad = []
    t0 = time.perf_counter()
    params = [
        SamplingParams(
            max_tokens=max_new_tokens,
            temperature=1.0,
            seed=i,
            response_format={"type": "json_schema", "json_schema": {"schema": schema, "property_order": order}},
        )
        for i, (_, schema, _) in enumerate(compiled)
    ]
    outs = engine.generate([[tok.bos_token_id or 1]] * len(compiled), params)
    for (name, schema, _), out in zip(compiled, outs):
        reason = {"stop": "ended", "length": "unfinished"}.get(out.finish_reason, out.finish_reason)
        judge(counts, bad, name, schema, reason, out.text)
        counts["requests_rewound"] += out.metrics["grammar_retries"] > 0
        counts["rewinds"] += out.metrics["grammar_retries"]
    return finish_tally(counts, bad, t0)


def generate(compiled: list, tok, max_new_tokens: int) -> dict:
    """A random-weight llama samples under each grammar (the processor alone: no retry); outputs that end with EOS
    are validated."""
    from transformers import LogitsProcessorList

    from hf_attn_patch.grammar import GrammarConstrainedLogitsProcessor

    model, bias = random_model(tok)

    def structural_bias(input_ids, scores):
        return scores + bias[: scores.shape[-1]]

    counts = new_counts(len(compiled))
    bad = []
    t0 = time.perf_counter()
    for i, (name, schema, grammar) in enumerate(compiled):
        proc = GrammarConstrainedLogitsProcessor([grammar.spec], tok, backend="llguidance")
        torch.manual_seed(i)
        prompt = torch.tensor([[tok.bos_token_id or 1]])
        with torch.no_grad():
            out = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=max_new_tokens,
                do_sample=True,
                logits_processor=LogitsProcessorList([structural_bias, proc]),
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id,
            )
        tally(counts, bad, name, schema, proc, out[0, 1:].tolist(), tok)
    return finish_tally(counts, bad, t0)


def tally(counts: dict, bad: list, name: str, schema: dict, proc, new: list[int], tok) -> None:
    """Judge one answer of a processor by its finish reason (None when EOS was sampled last: the processor is not
    called after it)."""
    reason = (proc.finish_reasons[0] or ("eos" if new and new[-1] == tok.eos_token_id else "length")).split(":")[0]
    reason = {"eos": "ended", "length": "unfinished"}.get(reason, reason)
    judge(counts, bad, name, schema, reason, tok.decode(new, skip_special_tokens=True))


def finish_tally(counts: dict, bad: list, t0: float) -> dict:
    counts["seconds"] = round(time.perf_counter() - t0, 1)
    counts["invalid_examples"] = bad[:5]
    return counts


def generate_smollm2(sample: list, max_new_tokens: int, order: str) -> dict:
    """SmolLM2-135M-Instruct, greedy, asked for a JSON answer under each schema (shown in the prompt)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_attn_patch.grammar import GrammarConstrainedLogitsProcessor
    from hf_attn_patch.models.pretrained import smollm2_dir

    path = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    counts = {**new_counts(0), "refused": 0}
    bad = []
    t0 = time.perf_counter()
    for name, entry in sample:
        schema = entry["schema"]
        counts["schemas"] += 1
        try:
            proc = GrammarConstrainedLogitsProcessor([GrammarSpec.json_schema(schema, order)], tok)
        except GrammarError:
            counts["refused"] += 1
            continue
        chat = [
            {
                "role": "user",
                "content": "Answer with a JSON value valid under this schema:\n" + json.dumps(schema)[:1500],
            }
        ]
        ids = tok(
            tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
            return_tensors="pt",
            add_special_tokens=False,
        ).input_ids
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                logits_processor=[proc],
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id,
            )
        tally(counts, bad, name, schema, proc, out[0, ids.shape[1] :].tolist(), tok)
    return finish_tally(counts, bad, t0)


# ----------------------------------------------------------------------------------------------------------- key-order
def lark_bytes(schema: dict, adapter, order: str) -> int:
    """Size of the Lark grammar llguidance compiles for `schema` widened as compile_grammar widens it."""
    import llguidance

    be = LLGuidanceBackend()

    def compile_fn(relaxed, options):
        return be.compile(GrammarSpec("json_schema", relaxed), adapter, separators=(", ", ": "), json_options=options)

    _, relaxed = relax_and_compile(schema, compile_fn, known_formats(), "llguidance", order)
    options = relaxed.options or {}
    compiler = llguidance.JsonCompiler(separators=(", ", ": "), coerce_one_of=bool(options.get("coerce_one_of")))
    return len(compiler.compile(json.dumps(relaxed.schema), check=False))


def key_order_options(parser) -> None:
    parser.add_argument("mirror", help="git directory of guidance-ai/jsonschemabench")
    parser.add_argument("--n", type=int, default=1000, help="sample size, as in the schemas part")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--schemas", type=int, default=60, help="schemas of the sample measured")
    parser.add_argument("--instances", type=int, default=3, help="valid instances replayed per schema")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: SmolLM2-135M's)")


def key_order(args):
    """The cost of keys in any order (property_order "any") against declaration order ("schema") on real-world JSON
    Schemas (JSONSchemaBench / MaskBench, the sample of the schemas part), for a real vocabulary (SmolLM2's, 49k tokens).

        python scripts/bench_grammar.py key-order /path/to/jsonschemabench/git-dir --n 1000 --seed 4638 --schemas 60

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
        out[order] = {
            "lark_bytes_median": statistics.median(size[order]),
            "lark_bytes_total": sum(size[order]),
            "compile_ms_median": round(1e3 * statistics.median(compile_s[order]), 1),
            "schemas_with_checks": checked[order],
            "mask_us_per_token": us(mask[order]["ours"]),
            "plain_mask_us_per_token": us(mask[order]["plain"]),
        }
    out["any_vs_schema"] = {
        "lark_bytes_total": round(out["any"]["lark_bytes_total"] / max(out["schema"]["lark_bytes_total"], 1), 3),
        "mask_time": round(mask["any"]["ours"] / max(mask["schema"]["ours"], 1e-9), 3),
    }
    print(json.dumps(out, indent=1))


PARTS: dict[str, benchlib.Part] = {
    "masks": (masks_options, masks),
    "schemas": (schemas_options, schemas),
    "key-order": (key_order_options, key_order),
}

if __name__ == "__main__":
    benchlib.run_parts(__doc__, PARTS)
