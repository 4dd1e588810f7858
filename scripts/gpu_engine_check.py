"""The engine's paged path on the GPU: greedy Engine outputs equal generate() alone, with the kernels called at
block granularity (prefill: paged_prefill_attention, decode: paged_decode_attention / mla_decode); and paged
generate() of a left-padded batch (cache_implementation="paged_kv": rows laid out and read as strided views under
sdpa, pages read by the kernels under the "paged_kv" attention) equal to generate() with DynamicCache; and the
serving set-up (device, dtype, a KV pool sized by a share of the device's memory) answering one request.

    python scripts/gpu_engine_check.py            # used by scripts/gpu_check.sh; CPU: the torch reference runs
"""

from __future__ import annotations

import collections

import torch
import transformers

import hf_attn_patch
import hf_attn_patch.kernels.ops as kernels
from hf_attn_patch import Engine, SamplingParams
from hf_attn_patch.compat import get_cache
from hf_attn_patch.models import load_default

CONFIGS = {
    "llama": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=8,
    ),
    "mistral-window": dict(
        model_type="mistral",
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=7,
    ),
    "llama-mla": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        attention_variant="mla",
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
    ),
}


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    calls = collections.Counter()
    for name in ("paged_decode_attention", "paged_prefill_attention", "mla_decode"):
        original = getattr(kernels, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        setattr(kernels, name, spy)
    failures = 0
    tokenizer = load_default()[1]  # the embedded stories260k tokenizer (token ids below 97 are valid in it)
    for label, fields in CONFIGS.items():
        fields = dict(fields)
        config = transformers.AutoConfig.for_model(
            fields.pop("model_type"), vocab_size=97, num_hidden_layers=2, **fields
        )
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).to(device).eval()
        prompts = [[5, 9, 13, 22, 40, 7, 8, 9, 10, 11, 3, 4], [3, 4, 5], [50, 60, 70, 80, 90, 11, 12]]
        calls.clear()
        engine = Engine(model, tokenizer, block_size=4, max_batch_tokens=16, max_memory=1 << 24)
        outputs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        same = 0
        for prompt, out in zip(prompts, outputs):
            ref = model.generate(
                torch.tensor([prompt], device=device), max_new_tokens=12, do_sample=False, pad_token_id=0
            )[0, len(prompt) :].tolist()
            same += out.token_ids == ref
        ok = same == len(prompts) and (device == "cpu" or sum(calls.values()) > 0)
        failures += not ok
        print(
            f"{label:16s} {device}: {same}/{len(prompts)} token-identical to generate(); kernel calls {dict(calls)}"
            f" -> {'ok' if ok else 'FAIL'}"
        )
        failures += not paged_generate_matches(label, model, device, calls)
    failures += not serve_check(device)
    return 1 if failures else 0


def serve_check(device: str) -> bool:
    """The serving path as `hf-attn serve --device cuda --dtype auto --gpu-memory-utilization 0.2` sets it up: the
    model moved and cast by the Engine, the KV pool sized by the profiled share of the device's memory, and one
    request served over HTTP when fastapi / uvicorn are importable (else through the engine)."""
    model, tokenizer = load_default()
    memory = dict(memory_utilization=0.2) if device == "cuda" else dict(max_memory=1 << 24)  # CPU: tests size it
    engine = Engine(model, tokenizer, device=device, dtype="auto", **memory)
    pool = engine.kv_stats()
    weight = next(engine.model.parameters())
    print(
        f"serve {device}: weights on {weight.device} in {weight.dtype}; KV pool {pool['blocks_total']} blocks, "
        f"{pool['bytes_total'] / 2**30:.2f} GiB; sizing {pool['sizing']}"
    )
    try:
        import urllib.request

        from hf_attn_patch.serving import create_app, make_server
    except ImportError as error:
        [out] = engine.generate(["Once upon a time"], SamplingParams(max_tokens=16, temperature=0))
        text, how = out.text, f"engine.generate (no HTTP: {error})"
    else:
        import json
        import socket
        import threading
        import time

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = make_server(create_app(engine, "stories260k"), "127.0.0.1", port, log_level="warning")
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as reply:
            text = json.loads(reply.read())["choices"][0]["text"]
        server.should_exit = True
        thread.join(timeout=30)
        how = "HTTP /v1/completions"
    ok = bool(text) and weight.device.type == device
    print(f"serve {device}: {how}: {text!r} -> {'ok' if ok else 'FAIL'}")
    return ok


def paged_generate_matches(label: str, model, device: str, calls) -> bool:
    ids = torch.tensor(
        [[0, 0, 0, 5, 9, 13, 22, 40, 7], [3, 4, 5, 6, 7, 8, 9, 10, 11], [0, 0, 0, 0, 0, 50, 60, 70, 80]], device=device
    )
    kw = dict(attention_mask=(ids != 0).long(), max_new_tokens=12, do_sample=False, pad_token_id=0)
    reference = model.generate(ids, **kw)
    ok = True
    for attention in ("sdpa", "paged_kv"):
        calls.clear()
        model.set_attn_implementation(attention)
        try:
            out = model.generate(
                ids, cache_implementation="paged_kv", return_dict_in_generate=True, cache_config={"block_size": 4}, **kw
            )
        finally:
            model.set_attn_implementation("sdpa")
        views = any(layout is not None for layout in get_cache(out).slots.strided.values())
        same = torch.equal(out.sequences, reference)
        ok &= same and (device == "cpu" or attention == "sdpa" or sum(calls.values()) > 0)  # CUDA: kernels ran
        print(
            f"{label:16s} {device}: paged generate(), {attention} attention: token-identical {same}, rows read as "
            f"views {views}, kernel calls {dict(calls)}"
        )
    return ok


if __name__ == "__main__":
    assert hf_attn_patch.is_patched()
    raise SystemExit(main())
