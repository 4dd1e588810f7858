"""Structured output on real-world JSON Schemas (JSONSchemaBench / MaskBench): ours (widened grammar + exact checks)
against llguidance alone, on a fixed seeded random sample.

    python scripts/bench_schemas.py /path/to/jsonschemabench/git-dir --n 1000 --seed 0 --generate 200 --engine 200

The mirror is a git directory of github.com/guidance-ai/jsonschemabench (read with git; no work tree needed); the
schemas and their valid / invalid test instances come from maskbench/data/*.json. Figures:
- refused: schemas whose compilation raises GrammarError;
- completeness: valid instances replayed token by token stay allowed by the mask, and EOS is allowed at the end
  (a refused schema counts its instances as not complete). llguidance generates object keys in the order the schema
  lists them; an instance whose keys come in another order is replayed again with its keys in the schema's order
  (the same JSON value); the figure with the keys as given is reported too;
- soundness: invalid instances hit a masked token (EOS included) before their end (llguidance alone: a refused
  schema counts its instances as neither complete nor caught; the figures on the schemas it compiles are given too);
- generation: a random-weight llama over the tokenizer's vocabulary samples under the processor, with +4 added to
  the logits of EOS and of the tokens holding '"', ']' or '}' (else the nearly uniform random model writes strings
  far longer than the token limit); the outputs that end with EOS are validated with jsonschema (formats checked);
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
import subprocess
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


def load_sample(git_dir: str, n: int, seed: int) -> list[tuple[str, dict]]:
    """(name, MaskBench entry) for a seeded random sample of n files of maskbench/data (sorted names first)."""
    names = subprocess.run(["git", "--git-dir", git_dir, "ls-tree", "-r", "--name-only", "HEAD", "maskbench/data/"],
                           capture_output=True, text=True, check=True).stdout.split()
    names = sorted(x for x in names if x.endswith(".json"))
    picked = random.Random(seed).sample(names, min(n, len(names)))
    request = "".join(f"HEAD:{x}\n" for x in picked).encode()
    batch = subprocess.run(["git", "--git-dir", git_dir, "cat-file", "--batch"], input=request, capture_output=True,
                           check=True).stdout
    out, pos = [], 0
    for name in picked:
        header_end = batch.index(b"\n", pos)
        size = int(batch[pos:header_end].split()[2])
        out.append((name, json.loads(batch[header_end + 1: header_end + 1 + size])))
        pos = header_end + 1 + size + 1
    return out


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


def replay(state: GrammarState, ids: list[int]) -> tuple[bool, float, int]:
    """(every token allowed by the mask and EOS allowed at the end, seconds in fill_bitmask, masks computed)."""
    mask = bm.allocate_bitmask(1, state.vocab_size)
    seconds, steps = 0.0, 0
    for t in ids:
        t0 = time.perf_counter()
        state.fill_bitmask(mask, 0)
        seconds += time.perf_counter() - t0
        steps += 1
        if not bm.unpack(mask, state.vocab_size)[0, t] or not state.accept_token(t):
            return False, seconds, steps
    t0 = time.perf_counter()
    state.fill_bitmask(mask, 0)
    seconds += time.perf_counter() - t0
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
    ap.add_argument("--replay", type=int, default=1, help="0: compile only, no replays (for the generation figures)")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    logging.getLogger("hf_attn_patch").setLevel(logging.ERROR)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    adapter = get_adapter(tok)
    sample = load_sample(args.mirror, args.n, args.seed)
    llg = LLGuidanceBackend()
    stats = {k: 0 for k in ("schemas", "refused", "refused_llg", "valid", "complete", "complete_llg", "invalid",
                            "caught", "caught_llg", "with_checks", "reordered", "complete_given_order",
                            "valid_llg_compiled", "invalid_llg_compiled")}
    times = {"plain_nocheck": 0.0, "ours_nocheck": 0.0, "plain_check": 0.0, "ours_check": 0.0}
    steps = {"nocheck": 0, "check": 0}
    refusals, compiled_ok = [], []
    t_start = time.perf_counter()
    for name, entry in sample:
        schema, tests = entry["schema"], entry.get("tests") or []
        stats["schemas"] += 1
        try:
            ours = compile_grammar(GrammarSpec.json_schema(schema), tok, backend="llguidance", cache=False)
        except GrammarError as err:
            ours = None
            stats["refused"] += 1
            refusals.append((name, str(err)[:160]))
        try:
            alone = llg.compile(GrammarSpec.json_schema(schema), adapter)
        except GrammarError:
            alone = None
            stats["refused_llg"] += 1
        if ours is not None:
            compiled_ok.append((name, schema, ours))
            stats["with_checks"] += ours.checks is not None
        locator = None
        for test in tests if args.replay else ():
            ids = encode(adapter, json.dumps(test["data"], ensure_ascii=False))
            if test["valid"] and isinstance(test["data"], (dict, list)):  # also try the schema's property order
                try:
                    locator = locator or SchemaChecks(schema, set(), [])
                    ordered = encode(adapter, json.dumps(schema_order(test["data"], locator), ensure_ascii=False))
                except Exception:  # noqa: BLE001  (a schema jsonschema cannot load: keep the given order)
                    ordered = ids
            else:
                ordered = ids
            key = "nocheck" if ours is None or ours.checks is None else "check"
            if test["valid"]:
                stats["valid"] += 1
                if ours is not None:
                    ok_given = replay(ours.new_state(), ids)[0]  # also warms up the backend's shared lexer cache
                    if not ok_given and ordered != ids:
                        ids = ordered
                        stats["reordered"] += 1
                    ok, sec, n = replay(ours.new_state(), ids)
                    stats["complete"] += ok
                    stats["complete_given_order"] += ok_given
                    _, sec_plain, n_plain = replay(plain_state(ours, adapter), ids)
                    sec = min(sec, replay(ours.new_state(), ids)[1])  # twice each, alternating: the lower time
                    sec_plain = min(sec_plain, replay(plain_state(ours, adapter), ids)[1])
                    if ok and n == n_plain:
                        times[f"ours_{key}"] += sec
                        times[f"plain_{key}"] += sec_plain
                        steps[key] += n
                if alone is not None:
                    stats["valid_llg_compiled"] += 1
                    stats["complete_llg"] += any(replay(GrammarState(llg.matcher(alone), adapter.eos_token_ids,
                                                                     adapter.vocab_size), x)[0] for x in {
                        tuple(ids), tuple(ordered)})
            else:
                stats["invalid"] += 1
                if ours is not None:
                    stats["caught"] += not replay(ours.new_state(), ids)[0]
                if alone is not None:
                    stats["invalid_llg_compiled"] += 1
                    stats["caught_llg"] += not replay(GrammarState(llg.matcher(alone), adapter.eos_token_ids,
                                                                   adapter.vocab_size), ids)[0]
    replay_seconds = time.perf_counter() - t_start

    gen = generate(compiled_ok[: args.generate], tok, args.max_new_tokens) if args.generate else {}
    gen_smol = generate_smollm2(sample[: args.smollm2], args.max_new_tokens) if args.smollm2 else {}
    gen_engine = generate_engine(compiled_ok[: args.engine], tok, args.max_new_tokens) if args.engine else {}
    s = stats
    pct = lambda a, b: round(100.0 * a / max(b, 1), 2)  # noqa: E731
    figures = {
        "sample": {"n": s["schemas"], "seed": args.seed, "tokenizer": Path(args.tokenizer).name,
                   "valid_instances": s["valid"], "invalid_instances": s["invalid"],
                   "schemas_with_checks": s["with_checks"]},
        "refused_pct": {"ours": pct(s["refused"], s["schemas"]), "llguidance": pct(s["refused_llg"], s["schemas"])},
        "completeness_pct": {"ours": pct(s["complete"], s["valid"]), "llguidance": pct(s["complete_llg"], s["valid"]),
                             "llguidance_on_schemas_it_compiles": pct(s["complete_llg"], s["valid_llg_compiled"]),
                             "ours_keys_as_given": pct(s["complete_given_order"], s["valid"]),
                             "instances_replayed_in_schema_key_order": s["reordered"]},
        "soundness_pct": {"ours": pct(s["caught"], s["invalid"]), "llguidance": pct(s["caught_llg"], s["invalid"]),
                          "llguidance_on_schemas_it_compiles": pct(s["caught_llg"], s["invalid_llg_compiled"])},
        "mask_us_per_token": {
            "no_checks": {"ours": round(1e6 * times["ours_nocheck"] / max(steps["nocheck"], 1), 1),
                          "plain": round(1e6 * times["plain_nocheck"] / max(steps["nocheck"], 1), 1)},
            "with_checks": {"ours": round(1e6 * times["ours_check"] / max(steps["check"], 1), 1),
                            "plain": round(1e6 * times["plain_check"] / max(steps["check"], 1), 1)}},
        "generation": gen,
        "generation_smollm2": gen_smol,
        "generation_engine": gen_engine,
        "replay_seconds": round(replay_seconds, 1),
        "refusals": refusals[:20],
    }
    for k in ("no_checks", "with_checks"):
        d = figures["mask_us_per_token"][k]
        d["ratio"] = round(d["ours"] / d["plain"], 3) if d["plain"] else None
    print(json.dumps(figures, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1) + "\n")


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


def generate_engine(compiled: list, tok, max_new_tokens: int) -> dict:
    """The same random model and bias (a hook on its head) in the engine, one request per schema
    (response_format, sampled, seed = its index), all in one batch: the engine rewinds a request whose check left
    no valid continuation and decodes on (finish_reason check_failed once 3 retries are spent)."""
    from hf_attn_patch.engine import Engine, SamplingParams

    model, bias = random_model(tok)
    model.lm_head.register_forward_hook(lambda module, args, logits: logits + bias[: logits.shape[-1]])
    engine = Engine(model, tok, max_num_seqs=256, max_batch_tokens=2048)
    counts = {"schemas": len(compiled), "stop": 0, "stop_valid": 0, "check_failed": 0, "length": 0,
              "requests_rewound": 0, "rewinds": 0, "seconds": 0.0}
    bad = []
    t0 = time.perf_counter()
    params = [SamplingParams(max_tokens=max_new_tokens, temperature=1.0, seed=i,
                             response_format={"type": "json_schema", "json_schema": {"schema": schema}})
              for i, (_, schema, _) in enumerate(compiled)]
    outs = engine.generate([[tok.bos_token_id or 1]] * len(compiled), params)
    for (name, schema, _), out in zip(compiled, outs):
        counts[out.finish_reason if out.finish_reason in counts else "length"] += 1
        counts["requests_rewound"] += out.metrics["grammar_retries"] > 0
        counts["rewinds"] += out.metrics["grammar_retries"]
        if out.finish_reason == "stop":
            try:
                ok = validator(schema).is_valid(json.loads(out.text))
            except ValueError:
                ok = False
            counts["stop_valid"] += ok
            if not ok:
                bad.append((name, out.text[:200]))
    counts["seconds"] = round(time.perf_counter() - t0, 1)
    counts["invalid_examples"] = bad[:5]
    return counts


def generate(compiled: list, tok, max_new_tokens: int) -> dict:
    """A random-weight llama samples under each grammar; outputs that end with EOS are validated."""
    from transformers import LogitsProcessorList

    from hf_attn_patch.grammar import GrammarConstrainedLogitsProcessor

    model, bias = random_model(tok)

    def structural_bias(input_ids, scores):
        return scores + bias[: scores.shape[-1]]

    counts = {"schemas": len(compiled), "eos": 0, "eos_valid": 0, "check_failed": 0, "dead_end": 0, "length": 0,
              "eos_with_checks": 0, "seconds": 0.0}
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
        tally(counts, bad, name, schema, proc, out[0, 1:].tolist(), tok, other="dead_end")
    return finish_tally(counts, bad, t0)


def tally(counts: dict, bad: list, name: str, schema: dict, proc, new: list[int], tok, other: str) -> None:
    """Count one generated answer by its end (a reason outside `counts` counts as `other`); validate it when it
    ended with EOS (kept in `bad` when invalid)."""
    reason = proc.finish_reasons[0]  # None when EOS was sampled last (the processor is not called after it)
    reason = (reason or ("eos" if new and new[-1] == tok.eos_token_id else "length")).split(":")[0]
    counts[reason if reason in counts else other] += 1
    if reason != "eos":
        return
    text = tok.decode(new, skip_special_tokens=True)
    try:
        ok = validator(schema).is_valid(json.loads(text))
    except ValueError:
        ok = False
    counts["eos_valid"] += ok
    counts["eos_with_checks"] += proc.grammars[0].checks is not None
    if not ok:
        bad.append((name, text[:200]))


def finish_tally(counts: dict, bad: list, t0: float) -> dict:
    counts["seconds"] = round(time.perf_counter() - t0, 1)
    counts["eos_valid_pct"] = round(100.0 * counts["eos_valid"] / max(counts["eos"], 1), 2)
    counts["invalid_examples"] = bad[:5]
    return counts


def generate_smollm2(sample: list, max_new_tokens: int) -> dict:
    """SmolLM2-135M-Instruct, greedy, asked for a JSON answer under each schema (shown in the prompt)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_attn_patch.grammar import JSONSchemaLogitsProcessor
    from hf_attn_patch.models.pretrained import smollm2_dir

    path = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    counts = {"schemas": 0, "refused": 0, "eos": 0, "eos_valid": 0, "check_failed": 0, "length": 0,
              "eos_with_checks": 0, "seconds": 0.0}
    bad = []
    t0 = time.perf_counter()
    for name, entry in sample:
        schema = entry["schema"]
        counts["schemas"] += 1
        try:
            proc = JSONSchemaLogitsProcessor(schema, tok)
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
        tally(counts, bad, name, schema, proc, out[0, ids.shape[1]:].tolist(), tok, other="length")
    return finish_tally(counts, bad, t0)


if __name__ == "__main__":
    main()
