"""patch() / unpatch(): stock models untouched, variant models built with our modules, originals restored."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import transformers
from transformers.generation import configuration_utils as generation_config_module
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

import hf_attn_patch
from hf_attn_patch._patching import MISSING, applied, patch_table
from hf_attn_patch.attention import GroupedQueryAttention
from hf_attn_patch.models import ARCHITECTURES
from hf_attn_patch.models.construction_hooks import AttentionDispatch

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


def _current(owner, name: str):
    return (owner if isinstance(owner, dict) else vars(owner)).get(name, MISSING)


def test_every_row_of_the_table_is_installed_and_is_ours():
    rows = applied()
    assert [(id(a.patch.owner), a.patch.name) for a in rows] == [(id(p.owner), p.name) for p in patch_table()]
    assert {a.patch.name for a in rows} >= {arch.attention_class for arch in ARCHITECTURES.values()}
    for i, row in enumerate(rows):
        owner, name, original, installed = row.patch.owner, row.patch.name, row.original, row.installed
        assert installed is not original and installed is not MISSING, name
        later = [r for r in rows[i + 1 :] if r.patch.owner is owner and r.patch.name == name]
        # the object there now is this row's, or (rows stacked on one name) the next row wrapped it
        assert (later[0].original if later else _current(owner, name)) is installed, name
        if isinstance(owner, dict):  # a registry: a name that was not there, holding the registered function
            assert original is MISSING and owner[name] is installed, name
        elif isinstance(installed, AttentionDispatch):  # the stand-in for a stock attention class
            assert installed.original is original and isinstance(original, type), name
        elif isinstance(installed, tuple):  # the cache names
            assert installed == original + ("paged_kv",), name
        else:  # a wrapper: our function around the original
            assert installed.__module__.startswith("hf_attn_patch.") and installed.__wrapped__ is original, name
    hf_attn_patch.patch()  # idempotent: nothing re-recorded, nothing wrapped twice
    assert [(a.original, a.installed) for a in applied()] == [(a.original, a.installed) for a in rows]


def _transformers_state() -> dict[str, dict]:
    """Every attribute of every loaded transformers module and of each class defined there, and the attention
    and mask registries: name -> {attribute: object}."""
    state = {
        "AttentionInterface": dict(AttentionInterface._global_mapping),
        "AttentionMaskInterface": dict(AttentionMaskInterface._global_mapping),
    }
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith("transformers"):
            continue
        state[module_name] = dict(vars(module))
        for attribute, value in list(vars(module).items()):
            if isinstance(value, type) and value.__module__ == module_name:
                state[f"{module_name}.{attribute}"] = dict(vars(value))
    return state


def test_unpatch_restores_transformers_exactly():
    rows = applied()
    hf_attn_patch.unpatch()
    assert not hf_attn_patch.is_patched()
    first = {}  # (owner, name) -> the first row there: its original is what transformers had
    for row in rows:
        first.setdefault((id(row.patch.owner), row.patch.name), row)
    for row in first.values():  # each original back, `is`-identical; registry names that were new are gone
        assert _current(row.patch.owner, row.patch.name) is row.original, row.patch.name
    assert "paged_kv" not in generation_config_module.ALL_CACHE_IMPLEMENTATIONS
    assert "paged_kv" not in AttentionInterface._global_mapping
    assert "paged_kv" not in AttentionMaskInterface._global_mapping
    # and nothing else in transformers moved: a whole patch / unpatch cycle leaves every attribute identical
    stock = _transformers_state()
    hf_attn_patch.patch()
    assert hf_attn_patch.is_patched() and _transformers_state() != stock
    hf_attn_patch.unpatch()
    after = _transformers_state()
    assert after.keys() == stock.keys()
    for where, attributes in stock.items():
        assert after[where].keys() == attributes.keys(), where
        moved = [name for name, value in attributes.items() if after[where][name] is not value]
        assert not moved, (where, moved)
    hf_attn_patch.unpatch()  # idempotent too


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "deepseek_v3"])
def test_stock_logits_bit_identical_before_during_after(model_type):
    """Built and run before patch(), while patched and after unpatch(): the same logits and greedy generate()
    bit for bit (DeepSeek-V3 is the one stock class we replace while patched: only before == after holds)."""
    ids = torch.randint(0, 97, (2, 7))
    replaced = ARCHITECTURES[model_type].replaces_stock
    hf_attn_patch.unpatch()
    with torch.no_grad():
        model = tiny_model(model_type, seed=3)
        before = model(ids).logits
        before_generated = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
        hf_attn_patch.patch()
        during_model = tiny_model(model_type, seed=3)  # built while patched: the stock class, same init
        during = during_model(ids).logits
        hf_attn_patch.unpatch()
        after_model = tiny_model(model_type, seed=3)
        after = after_model(ids).logits
        after_generated = after_model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(before, after) and torch.equal(before_generated, after_generated)
    assert torch.equal(model(ids).logits, before)  # the model built before patch() still runs stock
    if not replaced:
        assert torch.equal(before, during)
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


def test_kernels_and_converters_install_under_the_namespace():
    import importlib.util

    import hf_attn_patch.converters
    import hf_attn_patch.kernels

    assert hf_attn_patch.kernels.__name__ == "hf_attn_patch.kernels"
    assert hf_attn_patch.converters.__name__ == "hf_attn_patch.converters"
    spec = importlib.util.find_spec("kernels")  # Hugging Face's package, if installed, is not shadowed by ours
    assert spec is None or "hf_attn_patch" not in (spec.origin or "")


def test_the_repository_root_imports():
    """A Python started at the repository root (REPL, `python -c`, `python -m`) has the root first on sys.path: no
    regular package named `kernels` may sit there, or it would shadow Hugging Face's `kernels`, which transformers
    imports (5.25 imports it when installed)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = (
        "import sys, transformers, hf_attn_patch, hf_attn_patch.kernels.ops; import kernels; "
        "assert sys.path[0] == '', sys.path[0]; "
        "print(getattr(kernels, '__file__', None) or 'namespace', hf_attn_patch.kernels.ops.__name__)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found, _ = result.stdout.split()
    assert not found.startswith(str(root / "kernels")), found
