"""Layer-streamed reading, forward and writing of models: equal to the whole model's forward and save_pretrained."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from hf_attn_patch.converters.io.layer_source import LayerSource, resolve_folder
from hf_attn_patch.converters.io.layer_stream import Activations, LayerRunner, choose_placement
from hf_attn_patch.models import fast_linear

STORIES15M = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories15m"


def _load_bench():
    """scripts/bench_memory.py (its stream part): the synthetic deep source and the streamed forward it measures."""
    import importlib.util
    import sys

    scripts = Path(__file__).resolve().parents[1] / "scripts"
    if str(scripts) not in sys.path:  # the script imports its sibling benchlib, as `python scripts/...` finds it
        sys.path.insert(0, str(scripts))
    spec = importlib.util.spec_from_file_location("bench_memory", scripts / "bench_memory.py")
    bench = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclass looks its module up
    spec.loader.exec_module(bench)
    return bench


_bench = _load_bench()
stream_forward, stream_logits = _bench.stream_forward, _bench.stream_logits


def write_streamed(model: torch.nn.Module, out, max_shard_size: int | str = "5GB") -> Path:
    """Write an in-memory causal LM layer by layer through ShardedWriter (state_groups), as the conversion does."""
    from hf_attn_patch.converters.io.layer_writer import ShardedWriter, state_groups

    with ShardedWriter(out, max_shard_size) as writer:
        for group in state_groups(model):
            writer.add(group)
        gen = getattr(model, "generation_config", None)
        return writer.finish(model.config, gen if gen is not None and model.can_generate() else None)


def tiny_qwen2(folder: Path, shard: str | None = None) -> Path:
    """A random 3-layer Qwen2 (q/k/v biases, untied head, GQA 4:2) saved as safetensors, sharded if `shard`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # biases start at zero: make them count
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(0, 0.5)
    model.save_pretrained(folder, max_shard_size=shard) if shard else model.save_pretrained(folder)
    return folder


def tiny_qwen3(folder: Path) -> Path:
    """A random 2-layer Qwen3 (per-head q/k RMSNorms, head_dim 16 != hidden / heads)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(2)
    config = Qwen3Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    Qwen3ForCausalLM(config).save_pretrained(folder)
    return folder


def tiny_mistral_sliding(folder: Path) -> Path:
    """A random 2-layer Mistral whose sliding window (5) is shorter than the windows tested."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(1)
    config = MistralConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        sliding_window=5,
    )
    MistralForCausalLM(config).save_pretrained(folder)
    return folder


def whole_logits(folder, ids, attn="sdpa", dtype=torch.float32):
    """The whole model's logits with the kernels the streamed passes run: torch's F.linear (the converter's passes run
    with the packed CPU linear layers off, fast_linear.disabled())."""
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attn, dtype=dtype).eval()
    with torch.no_grad(), fast_linear.disabled():
        return model(ids).logits


def streamed_logits(folder, ids, **kw):
    src = LayerSource.open(folder, attn_implementation=kw.pop("attn", "sdpa"), dtype=kw.pop("dtype", torch.float32))
    with stream_forward(src, ids, **kw) as result:
        return stream_logits(src, result), result.placement


def sources(tmp_path):
    out = {
        "default": "default",
        "qwen2-sharded": tiny_qwen2(tmp_path / "qwen2", shard="20KB"),
        "qwen3": tiny_qwen3(tmp_path / "qwen3"),
    }
    assert (out["qwen2-sharded"] / "model.safetensors.index.json").exists()
    if STORIES15M.exists():
        out["stories15m"] = STORIES15M
    return out


def test_source_refuses_pickled_and_missing(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ValueError, match="pytorch_model.bin"):
        resolve_folder(tmp_path)
    with pytest.raises(ValueError, match="not 'default' or a local model folder"):
        resolve_folder(tmp_path / "absent")


def test_layer_is_transformers_own_and_reads_only_its_weights(tmp_path):
    folder = tiny_qwen2(tmp_path / "q")
    src = LayerSource.open(folder)
    ref = AutoModelForCausalLM.from_pretrained(folder).eval()
    layer = src.layer(1)
    assert type(layer).__name__ == "Qwen2DecoderLayer"
    want = ref.model.layers[1].state_dict()
    assert layer.state_dict().keys() == want.keys()
    assert all(torch.equal(layer.state_dict()[k], want[k]) for k in want)
    assert all(p.device.type == "meta" for p in src.model.model.layers.parameters())  # no layer kept resident
    assert not torch.equal(src.model.lm_head.weight, src.model.model.embed_tokens.weight)  # untied head read
    with pytest.raises(ValueError, match="layer index 3"):
        src.layer(3)


def test_checkpoint_key_mismatch_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tiny_qwen2(tmp_path / "q")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # old checkpoints: ignored
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    src = LayerSource.open(folder)
    src.layer(1)
    with pytest.raises(ValueError, match=r"model.layers.2: .*missing \['mlp.up_proj.weight'\]"):
        src.layer(2)


def test_tied_head_is_the_embedding():
    src = LayerSource.open("default")
    assert src.tied and src.model.lm_head.weight is src.model.model.embed_tokens.weight


@pytest.mark.parametrize("name", ["default", "stories15m", "qwen2-sharded", "qwen3"])
def test_streamed_logits_equal_whole_model(tmp_path, name):
    folder = sources(tmp_path).get(name)
    if folder is None:
        pytest.skip("stories15m is not present")
    config = LayerSource.open(folder).config
    ids = torch.randint(0, config.vocab_size, (5, 24), generator=torch.Generator().manual_seed(0))
    want = whole_logits(resolve_folder(folder), ids)
    # One chunk of all windows: the same ops on the same shapes as the whole model's forward, so bitwise equal.
    got, placement = streamed_logits(folder, ids, chunk_size=5)
    assert placement == "cpu" and torch.equal(got, want)
    # Chunks of 2 windows: each window's rows go through the same kernels; GEMM row blocking may depend on the row
    # count, so allow fp32 reordering noise: |err| <= a few ulp(|logit|) ~ 4 * 2**-23 * max|logit| (max|logit| < 20).
    got, _ = streamed_logits(folder, ids, chunk_size=2)
    torch.testing.assert_close(got, want, rtol=0, atol=4 * 2**-23 * want.abs().max().item())


def test_bf16_streamed_equals_whole_bf16():
    """In bf16 too the ops are the same (rotary cos/sin from fp32 inv_freq in both): bitwise equal."""
    ids = torch.randint(0, 512, (3, 16), generator=torch.Generator().manual_seed(5))
    want = whole_logits(resolve_folder("default"), ids, dtype=torch.bfloat16)
    got, _ = streamed_logits("default", ids, chunk_size=3, dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_sliding_window_masks_follow_the_model(tmp_path):
    folder = tiny_mistral_sliding(tmp_path / "m")
    ids = torch.randint(0, 61, (3, 12), generator=torch.Generator().manual_seed(2))
    for attn in ("sdpa", "eager"):
        want = whole_logits(folder, ids, attn)
        got, _ = streamed_logits(folder, ids, chunk_size=3, attn=attn)
        assert torch.equal(got, want), attn


def test_disk_placement_is_memory_mapped_and_equal(tmp_path):
    ids = torch.randint(0, 512, (4, 16), generator=torch.Generator().manual_seed(3))
    want = whole_logits(resolve_folder("default"), ids)
    src = LayerSource.open("default")
    seen = []
    with stream_forward(
        src,
        ids,
        chunk_size=4,
        cpu_budget=0,
        tmp_root=tmp_path,
        on_layer=lambda i, layer, x, y: seen.append((i, x.shape, y.shape)),
    ) as result:
        assert result.placement == "disk"
        assert len(list(tmp_path.glob("hf-attn-activations-*/*.bin"))) == 2
        assert torch.equal(stream_logits(src, result), want)
    assert not list(tmp_path.glob("hf-attn-activations-*"))  # the files are removed on close
    assert [s[0] for s in seen] == list(range(5)) and seen[0][1] == (4, 16, 64)


def test_stream_forward_refuses_bad_input():
    src = LayerSource.open("default")
    with pytest.raises(ValueError, match=r"\[N, T\] windows, got shape \(5,\)"):
        stream_forward(src, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_size=0"):
        stream_forward(src, torch.zeros(1, 5, dtype=torch.long), chunk_size=0)
    with pytest.raises(ValueError, match="placement='gpu'"):
        stream_forward(src, torch.zeros(1, 5, dtype=torch.long), placement="gpu")
    with stream_forward(src, torch.zeros(1, 5, dtype=torch.long), placement="device") as result:
        assert result.placement == "cpu"


def test_choose_placement():
    assert choose_placement(100, "cpu", cpu_budget=200) == "cpu"
    assert choose_placement(101, "cpu", cpu_budget=200) == "disk"
    assert choose_placement(100, "meta", device_budget=200, cpu_budget=0) == "device"
    assert choose_placement(100, "meta", device_budget=199, cpu_budget=200) == "cpu"
    assert choose_placement(100, "cpu", cpu_budget=399, buffers=4) == "disk"  # two tracks: four buffers


def test_runner_carries_two_tracks(tmp_path):
    """A conversion's two tracks (source, converted prefix) through one runner: a converted layer that is the source
    layer keeps them equal; one that differs changes only its own track. Tracks on CPU and on disk."""
    src = LayerSource.open("default")
    ids = torch.randint(0, 512, (3, 10), generator=torch.Generator().manual_seed(6))
    runner = LayerRunner(src, seq_len=10, chunk_size=2)
    tracks = [Activations.allocate((3, 10, 64), torch.float32, p, "cpu", tmp_path) for p in ("cpu", "disk")]
    for track in tracks:
        runner.embed(ids, track.current)
    for i in range(src.num_layers):
        layer = src.layer(i)
        runner.apply(layer, i, tracks[0].current, tracks[0].spare)
        if i == src.num_layers - 1:  # the "converted" last layer: its attention output projection scaled
            layer.self_attn.o_proj.weight.mul_(2)
        runner.apply(layer, i, tracks[1].current, tracks[1].spare)
        for track in tracks:
            track.swap()
        if i < src.num_layers - 1:
            assert torch.equal(tracks[0].current, tracks[1].current)
    with stream_forward(src, ids, chunk_size=2) as result:
        assert torch.equal(tracks[0].current, result.hidden)
        assert not torch.equal(tracks[1].current, result.hidden)
    for track in tracks:
        track.close()
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("shard", ["5GB", "20KB", 3000])
def test_writer_equals_save_pretrained(tmp_path, shard):
    import json

    for folder in (tiny_qwen2(tmp_path / "q"), resolve_folder("default")):  # untied head with biases; tied head
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        ours, theirs = tmp_path / f"ours-{folder.name}", tmp_path / f"theirs-{folder.name}"
        write_streamed(model, ours, max_shard_size=shard)
        model.save_pretrained(theirs, max_shard_size=shard)
        tensors = {}
        for which in (ours, theirs):  # {name: tensor} over all shards, each shard's file metadata checked
            tensors[which] = {}
            for path in which.glob("model*.safetensors"):
                with safe_open(path, "pt") as f:
                    assert f.metadata() == {"format": "pt"}
                    tensors[which].update({k: f.get_tensor(k) for k in f.keys()})
        a, b = tensors[ours], tensors[theirs]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        index, metas = "model.safetensors.index.json", []
        for which in (ours, theirs):  # an index exactly when sharded, naming every tensor's file
            shards = sorted(p.name for p in which.glob("model*.safetensors"))
            assert (which / index).exists() == (len(shards) > 1)
            if len(shards) > 1:
                meta = json.loads((which / index).read_text())
                assert sorted(set(meta["weight_map"].values())) == shards and meta["weight_map"].keys() == a.keys()
                metas.append(meta["metadata"])
        assert len(metas) in (0, 2) and metas[:1] == metas[1:]  # total_size, total_parameters as save_pretrained's
        a = AutoModelForCausalLM.from_pretrained(ours).state_dict()
        b = AutoModelForCausalLM.from_pretrained(theirs).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert not list(tmp_path.glob(".*staging*"))


def test_writer_leaves_nothing_half_written(tmp_path):
    from hf_attn_patch.converters.io.layer_writer import ShardedWriter

    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="boom"):
        with ShardedWriter(out, max_shard_size=16) as writer:
            writer.add({"a": torch.zeros(8), "b": torch.ones(8)})
            raise RuntimeError("boom")
    assert not out.exists() and not list(tmp_path.iterdir())
    with ShardedWriter(out) as writer:  # finish() never called: nothing written, nothing left
        writer.add({"a": torch.zeros(8)})
    assert not out.exists() and not list(tmp_path.iterdir())
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(ValueError, match="exists"):
        ShardedWriter(out)
    with ShardedWriter(out, overwrite=True) as writer:
        writer.add({"a": torch.zeros(2)})
        assert (out / "keep").exists()  # the old output stays until finish
        writer.finish()
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with pytest.raises(ValueError, match="max_shard_size='lots'"):
        ShardedWriter(tmp_path / "x", max_shard_size="lots")


def test_one_layer_resident_at_a_time(tmp_path):
    """A deep synthetic source: each decoder layer is freed before the next one is read."""
    import weakref

    size = _bench.build_source(tmp_path / "deep", depth=24, width=192, vocab=256)
    assert 0 < size <= sum(p.stat().st_size for p in (tmp_path / "deep").glob("*.safetensors"))
    src = LayerSource.open(tmp_path / "deep")
    alive, read = [], src.layer

    def layer(i):  # no gc.collect(): a layer must be freed by reference counting alone, before the next is read
        assert [r() for r in alive if r() is not None] == []
        alive.append(weakref.ref(module := read(i)))
        return module

    src.layer = layer
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(4))
    with stream_forward(src, ids, chunk_size=1) as result:
        assert len(alive) == 24 and result.hidden.shape == (2, 8, 192) and torch.isfinite(result.hidden).all()


def test_shard_file_reads_back_every_dtype(tmp_path):
    from safetensors.torch import load_file

    from hf_attn_patch.converters.io.layer_writer import ShardedWriter

    g = torch.Generator().manual_seed(7)
    tensors = {"f32": torch.randn(3, 5, generator=g), "bf16": torch.randn(7, generator=g).bfloat16(),
               "f16": torch.randn(2, 2, generator=g).half(), "i64": torch.arange(5),
               "flag": torch.tensor([True, False]), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4),
               "strided": torch.randn(4, 6, generator=g).t()}  # fmt: skip
    with ShardedWriter(tmp_path / "out", max_shard_size=40) as writer:  # several shards, one tensor over the limit
        writer.add(tensors)
        writer.finish()
    got = {}
    for path in (tmp_path / "out").glob("model-*.safetensors"):
        with safe_open(path, "pt") as f:
            assert f.metadata() == {"format": "pt"}
        got.update(load_file(path))
    assert got.keys() == tensors.keys()
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in tensors.items())
    assert not [p for p in (tmp_path / "out").iterdir() if p.suffix not in (".safetensors", ".json")]
    with pytest.raises(ValueError, match="complex64"), ShardedWriter(tmp_path / "bad") as writer:
        writer.add({"z": torch.zeros(2, dtype=torch.complex64)})
    assert not (tmp_path / "bad").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("placement", ["device", "cpu", "disk"])
def test_streamed_on_cuda_equals_whole_model_on_cuda(placement):
    """Layers on the GPU, activations carried on it, in CPU memory or on disk: the same kernels on the same shapes as
    the whole model on the GPU (one chunk of all windows), so the logits are equal."""
    ids = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(8))
    model = AutoModelForCausalLM.from_pretrained(resolve_folder("default")).eval().to("cuda")
    with torch.no_grad():
        want = model(ids.cuda()).logits.cpu()
    src = LayerSource.open("default", device="cuda")
    with stream_forward(src, ids, chunk_size=4, placement=placement) as result:
        assert result.placement == placement
        assert result.hidden.device.type == ("cuda" if placement == "device" else "cpu")
        assert torch.equal(stream_logits(src, result, chunk_size=4), want)


@pytest.mark.smollm2
def test_smollm2_streamed_equals_whole():
    """The real SmolLM2-135M (30 layers, GQA 9:3, tied head): streamed logits equal the whole model's."""
    from hf_attn_patch.models.pretrained import smollm2_dir

    try:
        folder = smollm2_dir()
    except ImportError as err:
        pytest.skip(str(err))
    ids = torch.randint(0, 49152, (3, 64), generator=torch.Generator().manual_seed(9))
    want = whole_logits(folder, ids)
    got, _ = streamed_logits(folder, ids, chunk_size=3)
    assert torch.equal(got, want)
