"""Structured output on real-world JSON Schemas (JSONSchemaBench / MaskBench): ours (widened grammar + exact checks)
against llguidance alone, on a fixed seeded random sample, per source split (Github_hard, Kubernetes, ...).

    python scripts/bench_schemas.py /path/to/jsonschemabench/git-dir --n 1000 --seed 0 --generate 200 --engine 200

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

from __future__ import annotations

import argparse
import json
import logging
import random
import re
import subprocess
from collections import defaultdict
import time
from pathlib import Path

import torch

from hf_attn_patch.grammar import GrammarError, GrammarSpec, GrammarState, compile_grammar
from hf_attn_patch.grammar import bitmask as bm
from hf_attn_patch.grammar.backends import LLGuidanceBackend
from hf_attn_patch.grammar.formats import format_checker
from hf_attn_patch.grammar.schema_checks import SchemaChecks
from hf_attn_patch.grammar.vocab import get_adapter

ROOT = Path(__file__).resolve().parents[1]


def load_sample(git_dir: str, n: int, seed: int) -> tuple[list[tuple[str, dict]], int]:
    """((name, MaskBench entry) for a seeded random sample of n files of maskbench/data (sorted names first), files
    stored out of the mirror (large files) that were skipped)."""
    names = subprocess.run(["git", "--git-dir", git_dir, "ls-tree", "-r", "--name-only", "HEAD", "maskbench/data/"],
                           capture_output=True, text=True, check=True).stdout.split()
    names = sorted(x for x in names if x.endswith(".json"))
    picked = random.Random(seed).sample(names, min(n, len(names)))
    request = "".join(f"HEAD:{x}\n" for x in picked).encode()
    batch = subprocess.run(["git", "--git-dir", git_dir, "cat-file", "--batch"], input=request, capture_output=True,
                           check=False).stdout
    out, pos, missing = [], 0, 0
    for name in picked:
        header_end = batch.index(b"\n", pos)
        header = batch[pos:header_end].split()
        if header[-1] == b"missing":
            missing, pos = missing + 1, header_end + 1
            continue
        size = int(header[2])
        out.append((name, json.loads(batch[header_end + 1: header_end + 1 + size])))
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
    return GrammarState(compiled.backend.matcher(compiled._compiled), adapter.eos_token_ids, adapter.vocab_size,
                        backend="plain", banned_token_ids=adapter.special_token_ids)


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
        out[style] = replay(grammars["flexible"].new_state(), encode(adapter, json.dumps(data, ensure_ascii=False,
                                                                                         **STYLES[style])))[0]
    out["raw"], timing["seconds"], timing["steps"] = replay(grammars["strict"].new_state(),
                                                            encode(adapter, json.dumps(data, ensure_ascii=False)))
    out["normalised"] = out["raw"]
    if not out["raw"] and isinstance(data, (dict, list)):
        try:
            ordered = schema_order(data, locator)
        except Exception:  # noqa: BLE001  (a schema jsonschema cannot load: the given order only)
            ordered = data
        out["normalised"] = replay(grammars["strict"].new_state(), encode(adapter, json.dumps(ordered,
                                                                                                ensure_ascii=False)))[0]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mirror", help="git directory of guidance-ai/jsonschemabench")
    ap.add_argument("--n", type=int, default=1000, help="schemas in the sample (default 1000)")
    ap.add_argument("--seed", type=int, default=0, help="sample seed (default 0)")
    ap.add_argument("--tokenizer", default=str(ROOT.parent / "shared/models/stories260k"),
                    help="tokenizer folder (default: stories260k)")
    ap.add_argument("--generate", type=int, default=200, help="schemas of the sample to generate for (default 200)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--smollm2", type=int, default=0,
                    help="also generate with SmolLM2-135M-Instruct (greedy, chat prompt) on this many schemas")
    ap.add_argument("--engine", type=int, default=0,
                    help="also generate with the random model in the engine (retries) on this many schemas")
    ap.add_argument("--order", default="any", choices=ORDERS, help="key order of the generation runs")
    ap.add_argument("--replay", type=int, default=1, help="0: compile only, no replays (for the generation figures)")
    ap.add_argument("--part", default="0/1", help="i/k: replay every k-th schema of the sample from the i-th (run the "
                    "k parts at once, then --merge their --out files)")
    ap.add_argument("--merge", nargs="+", default=None, help="--out files of the parts: print their figures together")
    ap.add_argument("--out", default=None, help="write the figures (and the counts, for --merge) as JSON here; "
                    "rewritten every 2 schemas")
    args = ap.parse_args()
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
                ours[order] = {"strict": compile_grammar(spec, tok, backend="llguidance", cache=False),
                               "flexible": compile_grammar(spec, tok, backend="llguidance", cache=False,
                                                           whitespace_flexible=True)}
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
                    c["complete_llg"] += replay(GrammarState(llg.matcher(alone), adapter.eos_token_ids,
                                                             adapter.vocab_size),
                                                encode(adapter, json.dumps(data, ensure_ascii=False)))[0]
            else:
                c["invalid"] += 1
                ids = encode(adapter, json.dumps(data, ensure_ascii=False))
                for order, grammars in ours.items():
                    c[f"caught_{order}"] += not replay(grammars["strict"].new_state(), ids)[0]
                if alone is not None:
                    c["invalid_llg_compiled"] += 1
                    c["caught_llg"] += not replay(GrammarState(llg.matcher(alone), adapter.eos_token_ids,
                                                               adapter.vocab_size), ids)[0]
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
    return {"sample": {"n": len(sample), "seed": args.seed, "skipped_not_in_mirror": missing, "part": args.part,
                       "tokenizer": Path(args.tokenizer).name, "generation_order": args.order},
            "splits": {k: dict(v) for k, v in splits.items()}, "times": dict(times), "steps": dict(steps),
            "refusals": refusals, "replay_seconds": round(time.perf_counter() - t_start, 1)}


def write(args, raw: dict, gens: dict) -> dict:
    figures = {**report(raw), **gens, "counts": raw}
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1) + "\n")
    return figures


def merge(parts: list[dict]) -> dict:
    """The figures of several parts' --out files (their counts summed; generations as each part gave them)."""
    raw = {"sample": parts[0]["counts"]["sample"], "splits": {}, "times": defaultdict(float),
           "steps": defaultdict(int), "refusals": [], "replay_seconds": 0.0}
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
        row = {"schemas": c["schemas"], "valid": c["valid"], "invalid": c["invalid"],
               "refused_pct": {o: pct(c[f"refused_{o}"], c["schemas"]) for o in ORDERS + ("llg",)}}
        for o in ORDERS:
            row[f"completeness_{o}_pct"] = {k: pct(c[f"complete_{o}_{k}"], c["valid"])
                                            for k in ("raw", "normalised", *STYLES)}
        row["completeness_llg_pct"] = {"all": pct(c["complete_llg"], c["valid"]),
                                       "compiled": pct(c["complete_llg"], c["valid_llg_compiled"])}
        row["soundness_pct"] = {**{o: pct(c[f"caught_{o}"], c["invalid"]) for o in ORDERS},
                                "llg": pct(c["caught_llg"], c["invalid"]),
                                "llg_compiled": pct(c["caught_llg"], c["invalid_llg_compiled"])}
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
            mask[key] = {"ours": ours_us, "plain": plain_us, "ratio": round(ours_us / plain_us, 3) if plain_us else None,
                         "tokens": steps[key]}
    return {"sample": raw["sample"], "all": figures_of(total),
            "splits": {k: figures_of(v) for k, v in sorted(raw["splits"].items())}, "mask_us_per_token": mask,
            "replay_seconds": raw["replay_seconds"], "refusals": raw["refusals"][:20]}


def random_model(tok):
    """(random-weight tiny llama over the tokenizer's vocabulary, seed 0; the structural logit bias [V]: +4 on EOS
    and on the tokens holding '"', ']' or '}')."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
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
    return {"schemas": n, "valid": 0, "invalid": 0, "check_failed": 0, "dead_end": 0, "unfinished": 0,
            "splits": {}}


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
    params = [SamplingParams(max_tokens=max_new_tokens, temperature=1.0, seed=i, response_format={
        "type": "json_schema", "json_schema": {"schema": schema, "property_order": order}})
        for i, (_, schema, _) in enumerate(compiled)]
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
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                                 do_sample=True, logits_processor=LogitsProcessorList([structural_bias, proc]),
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
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
        chat = [{"role": "user", "content": "Answer with a JSON value valid under this schema:\n"
                 + json.dumps(schema)[:1500]}]
        ids = tok(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False), return_tensors="pt",
                  add_special_tokens=False).input_ids
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, logits_processor=[proc], eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.eos_token_id)
        tally(counts, bad, name, schema, proc, out[0, ids.shape[1]:].tolist(), tok)
    return finish_tally(counts, bad, t0)


if __name__ == "__main__":
    main()
