"""`hf-attn demo`: KV tables and a story from the embedded model, stock vs our attention, then the paged cache,
speculative decoding, JSON output and a conversion on it. Imports what it needs when it runs."""

from __future__ import annotations

import time


def cmd_demo(args) -> None:
    import torch

    from .converters.targets.exact import to_variant
    from .kv_memory import kv_report, llama3_8b_configs
    from .models import load_default

    model, tokenizer = load_default()
    print("== KV cache of the embedded model (stories260k: 5 layers, 8 query heads, 4 KV heads, head_dim 8)")
    print(kv_report({"stories260k": model.config}, seq_len=512, batch_size=1, dtype="float32"))
    print("\n== KV cache of a Llama-3-8B-shaped model (32 layers, 32 query heads of 128) at 32,000 tokens")
    print("   per layer per token (fp16): MHA 16384 B, MQA 512 B, GQA 4096 B, MLA 1152 B")
    print("   at batch 4 and at batch 64:")
    for batch in (4, 64):
        print(kv_report(llama3_8b_configs(), seq_len=32_000, batch_size=batch, dtype="float16"))
    print("\n== Greedy story, stock attention vs our attention classes (same weights, exact re-expression)")
    prompt = tokenizer("Once upon a time", return_tensors="pt")
    texts = {}
    for name, m in (("stock", model), ("ours GQA", to_variant(model, "gqa")), ("ours MLA", to_variant(model, "mla"))):
        start = time.perf_counter()
        with torch.no_grad():
            out = m.generate(**prompt, max_new_tokens=args.max_new_tokens, do_sample=False)
        texts[name] = tokenizer.decode(out[0], skip_special_tokens=True)
        attn = type(m.model.layers[0].self_attn).__name__
        print(f"-- {name} ({attn}, {time.perf_counter() - start:.2f} s):\n{texts[name]}\n")
    same = len(set(texts.values())) == 1
    print("identical text from all three:", same)
    if not same:
        raise SystemExit(1)
    _demo_paged_cache(model, tokenizer, args.max_new_tokens)
    _demo_speculative(model, tokenizer, args.max_new_tokens)
    _demo_json(model, tokenizer)
    _demo_conversion()


def _demo_conversion() -> None:
    """Convert the embedded model to MLA at half its KV bytes (zero-shot) and show the saving and its cost."""
    import tempfile
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from .converters.io.calibration import DEFAULT_CORPUS, read_calibration_text
    from .converters.convert import convert
    from .evaluation.perplexity import evaluate, windows_of
    from .models import load_default

    source, tokenizer = load_default()
    held_out = windows_of(read_calibration_text(DEFAULT_CORPUS)[-60_000:], tokenizer, ctx=256, max_tokens=1024)
    print(
        "\n== hf-attn convert default OUT --to mla --kv-budget 0.5 --reconstruct-steps 0 (closed forms only: no "
        "reconstruction, no healing)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        report = convert("default", Path(tmp) / "mla", to="mla", kv_budget=0.5, reconstruct_steps=0)
        converted = AutoModelForCausalLM.from_pretrained(Path(tmp) / "mla").eval()
    kv = report["kv_bytes_per_token_fp16"]
    before, after = evaluate(source, held_out, progress=False), evaluate(converted, held_out, source, progress=False)
    print(f"   KV bytes per token (fp16, all layers): {kv['before']} -> {kv['after']} ({report['kv_ratio']:.0%})")
    print(
        f"   perplexity on held-out TinyStories: {before.perplexity:.2f} -> {after.perplexity:.2f} "
        f"(KL {after.kl_to_reference:.2f} per token; reconstruction, on by default, and --heal-steps close the "
        f"gap)"
    )


def _demo_speculative(model, tokenizer, max_new_tokens: int) -> None:
    """Batched speculative decoding (transformers refuses batch_size > 1): n-gram lookup, greedy, exact."""
    import torch

    from .speculative import SpeculativeStats

    prompts = [
        'The little bird said, "I want to fly!" The little bird',
        "Tom and Sue went to the park. They played on the swings. They played on the slide.",
    ]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    start = time.perf_counter()
    plain = model.generate(**batch, **kw)
    plain_seconds, start = time.perf_counter() - start, time.perf_counter()
    stats = SpeculativeStats()
    fast = model.generate(**batch, prompt_lookup_num_tokens=6, speculative_stats=stats, **kw)
    fast_seconds = time.perf_counter() - start
    print("\n== Speculative decoding at batch 2 (n-gram prompt lookup, adaptive draft length), greedy")
    print(f"   same tokens as plain generate(): {torch.equal(plain, fast)}")
    print(
        f"   {stats.rounds} verification forwards for {max_new_tokens} tokens per row; acceptance rate "
        f"{stats.acceptance_rate:.0%}, {stats.mean_accepted_per_step:.2f} draft tokens accepted per row per step; "
        f"{plain_seconds:.2f} s plain vs {fast_seconds:.2f} s speculative"
    )


def _demo_json(model, tokenizer) -> None:
    """A JSON-Schema-constrained generation from the embedded model, validated."""
    import json

    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age", "likes"],
              "properties": {"name": {"type": "string", "maxLength": 16},
                             "age": {"type": "integer", "minimum": 1, "maximum": 12},
                             "likes": {"type": "array", "items": {"enum": ["cats", "dogs", "cake", "rain"]},
                                       "minItems": 1, "maxItems": 3}}}  # fmt: skip
    batch = tokenizer(["Once upon a time, there was a girl"], return_tensors="pt")
    out = model.generate(
        **batch,
        max_new_tokens=80,
        do_sample=False,
        tokenizer=tokenizer,
        response_format={"type": "json_schema", "json_schema": {"schema": schema}},
    )
    text = tokenizer.decode(out[0, batch.input_ids.shape[1] :], skip_special_tokens=True)
    print("\n== JSON Schema constrained generation (response_format=..., llguidance backend)")
    print(f"   schema: {json.dumps(schema)}")
    print(f"   output: {text}")
    try:
        import jsonschema

        jsonschema.validate(json.loads(text), schema)
        print("   valid: True (checked with jsonschema)")
    except ImportError:
        print(f"   parses as JSON: {isinstance(json.loads(text), dict)}")


def _demo_paged_cache(model, tokenizer, max_new_tokens: int) -> None:
    """A ragged batch through DynamicCache and PagedKVCache: same tokens, memory held, prefix reuse."""
    import torch
    from transformers import DynamicCache

    from .cache import PagedKVCache

    prompts = [
        "Once upon a time",
        "Tom and his little sister Sue went to the big park near their house. They saw",
        "The cat",
    ]
    tokenizer.padding_side = "left"
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.unk_token
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    dynamic, paged = DynamicCache(config=model.config), PagedKVCache(model.config, block_size=16)
    out_dynamic = model.generate(**batch, cache=dynamic, **kw)
    out_paged = model.generate(**batch, cache=paged, **kw)
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in dynamic.layers)
    stats = paged.stats()
    print("\n== Paged KV cache vs DynamicCache: a left-padded batch of 3 prompts of different lengths")
    print(f"   same tokens: {torch.equal(out_dynamic, out_paged)}")
    print(f"   DynamicCache holds {held:,} B (every row padded to the longest)")
    print(
        f"   PagedKVCache holds {stats['allocated_bytes']:,} B in {stats['blocks_used']} blocks of 16 tokens, "
        f"{stats['utilization']:.1%} of it in use (padding takes no blocks)"
    )
    again = model.generate(**batch, cache=paged, **kw)
    print(
        f"   the same prompts again on that cache: {paged.stats()['prefix_hit_tokens']} prompt tokens reused "
        f"from the prefix cache, same tokens: {torch.equal(again, out_paged)}"
    )
