"""patch() / unpatch(): stock models untouched, variant models built with our modules, originals restored."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import transformers
from transformers.configuration_utils import PreTrainedConfig
from transformers.generation import configuration_utils as generation_config_module
from transformers.generation.utils import GenerationMixin
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

import hf_attn_patch
from hf_attn_patch._patching import patched_objects
from hf_attn_patch.attention import GroupedQueryAttention
from hf_attn_patch.models import ARCHITECTURES

from .conftest import tiny_config, tiny_model


@pytest.fixture(autouse=True)
def repatch():
    """Every test leaves the patch installed, as `import hf_attn_patch` does."""
    yield
    hf_attn_patch.patch()


def test_import_patches_and_originals_are_recorded():
    code = (
        "import transformers.models.llama.modeling_llama as m; before = m.LlamaAttention;"
        "import hf_attn_patch; assert hf_attn_patch.is_patched(); assert m.LlamaAttention is not before;"
        "hf_attn_patch.unpatch(); assert m.LlamaAttention is before; print('ok')"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "ok\n"


def test_unpatch_restores_every_original_object():
    originals = {(id(owner), name): original for owner, name, original in patched_objects()}
    # one attention class per architecture, config validation, the cache name, two generate() hooks,
    # the "paged_kv" attention and mask functions
    assert len(originals) == len(ARCHITECTURES) + 9
    hf_attn_patch.patch()  # idempotent: nothing re-recorded, nothing wrapped twice
    assert {(id(o), n): orig for o, n, orig in patched_objects()} == originals
    modules = [arch.attention_module() for arch in ARCHITECTURES.values()]
    hf_attn_patch.unpatch()
    assert not hf_attn_patch.is_patched()
    for module, arch in zip(modules, ARCHITECTURES.values()):
        assert getattr(module, arch.attention_class) is originals[(id(module), arch.attention_class)]
    assert vars(PreTrainedConfig)["__post_init__"] is originals[(id(PreTrainedConfig), "__post_init__")]
    for name in ("_prepare_cache_for_generation", "_prefill"):
        assert vars(GenerationMixin)[name] is originals[(id(GenerationMixin), name)]
    assert "paged_kv" not in generation_config_module.ALL_CACHE_IMPLEMENTATIONS
    assert "paged_kv" not in AttentionInterface._global_mapping
    assert "paged_kv" not in AttentionMaskInterface._global_mapping
    hf_attn_patch.unpatch()  # idempotent too


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_stock_logits_bit_identical_before_during_after(model_type):
    ids = torch.randint(0, 97, (2, 7))
    hf_attn_patch.unpatch()
    model = tiny_model(model_type, seed=3)
    with torch.no_grad():
        before = model(ids).logits
        hf_attn_patch.patch()
        during_model = tiny_model(model_type, seed=3)  # built while patched: the stock class, same init
        during = during_model(ids).logits
        hf_attn_patch.unpatch()
        after = tiny_model(model_type, seed=3)(ids).logits
    assert torch.equal(before, during) and torch.equal(before, after)
    assert not any(isinstance(m, GroupedQueryAttention) for m in during_model.modules())


def test_patched_path_taken_only_while_patched():
    config = tiny_config("gpt2", attention_variant="gqa", num_key_value_heads=2)
    model = transformers.AutoModelForCausalLM.from_config(config)
    ours = [m for m in model.modules() if isinstance(m, GroupedQueryAttention)]
    assert len(ours) == config.n_layer and ours[0].spec.num_key_value_heads == 2
    calls = []
    ours[0].register_forward_hook(lambda *a: calls.append(1))
    model(torch.randint(0, 97, (1, 5)))
    assert calls == [1]
    hf_attn_patch.unpatch()
    stock = transformers.AutoModelForCausalLM.from_config(config)
    assert not any(isinstance(m, GroupedQueryAttention) for m in stock.modules())


def test_isinstance_against_patched_name_answers_like_the_stock_class():
    from transformers.models.gpt2 import modeling_gpt2

    stock = tiny_model("gpt2")
    assert isinstance(stock.transformer.h[0].attn, modeling_gpt2.GPT2Attention)
    assert issubclass(type(stock.transformer.h[0].attn), modeling_gpt2.GPT2Attention)
    assert not isinstance(torch.nn.Linear(1, 1), modeling_gpt2.GPT2Attention)


def test_gpt2_cross_attention_stays_stock():
    config = tiny_config("gpt2", attention_variant="gqa", num_key_value_heads=3, add_cross_attention=True)
    model = transformers.AutoModelForCausalLM.from_config(config)
    block = model.transformer.h[0]
    assert isinstance(block.attn, GroupedQueryAttention)
    assert not isinstance(block.crossattention, GroupedQueryAttention)


def test_wrong_transformers_version_fails_clearly():
    code = "import transformers; transformers.__version__ = '5.22.0'; import hf_attn_patch"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0
    assert "hf_attn_patch supports transformers 5.23.x, found 5.22.0" in result.stderr


def test_kernels_and_converters_install_under_the_namespace():
    import importlib.util

    import hf_attn_patch.converters
    import hf_attn_patch.kernels

    assert hf_attn_patch.kernels.__name__ == "hf_attn_patch.kernels"
    assert hf_attn_patch.converters.__name__ == "hf_attn_patch.converters"
    spec = importlib.util.find_spec("kernels")  # Hugging Face's package, if installed, is not shadowed by ours
    assert spec is None or "hf_attn_patch" not in (spec.origin or "")
