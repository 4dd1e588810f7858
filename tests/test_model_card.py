"""The model card `hf-attn convert` writes (hf_attn_patch/hub.py): Hub metadata that huggingface_hub parses into its
ModelCardData, what the model is, how to load it in each engine, its quality against the source, KV bytes per
token, the command that made it, and the licence carried from the source."""

from __future__ import annotations

import json
import shlex
import shutil

import pytest
from huggingface_hub import ModelCard, ModelCardData

from hf_attn_patch.cli import build_parser, convert_options, main
from hf_attn_patch.converters.convert import convert
from hf_attn_patch.converters.options import ConvertOptions
from hf_attn_patch.hub import update_card
from hf_attn_patch.models import load_default

from ._fast import FAST


@pytest.fixture(scope="module")
def mla(tmp_path_factory):
    out = tmp_path_factory.mktemp("card") / "mla"
    convert("default", out, to="mla", kv_budget=0.5, calib_samples=4, **FAST)
    return out


def read(folder) -> tuple[str, dict]:
    return (folder / "README.md").read_text(), json.loads((folder / "conversion_report.json").read_text())


def test_metadata_parses_as_the_hubs(mla):
    text, _ = read(mla)
    data = ModelCard(text).data
    assert isinstance(data, ModelCardData)
    assert data.license == "mit" and data.base_model == "karpathy/tinyllamas"  # stories260K's origin, MIT
    assert data.library_name == "transformers" and data.pipeline_tag == "text-generation"
    assert data.tags == ["hf-attn-patch", "mla"]
    assert ModelCardData(**data.to_dict()).to_dict() == data.to_dict()  # the Hub's own field handling round-trips


def test_body_says_what_it_is_and_how_to_load_it(mla):
    text, report = read(mla)
    kv = report["kv_bytes_per_token_fp16"]
    assert f"{kv['before']:,} B -> {kv['after']:,} B (50.0% of the source)" in text
    assert "stories260K" in text and "import hf_attn_patch" in text and "## Quality against the source" in text
    assert "hf-attn eval OUT --text FILE --reference SRC --update-card" in text  # nothing measured on held-out text
    assert "`mit`, carried from the source" in text


def test_command_makes_the_same_options(mla):
    text, report = read(mla)
    command = next(line for line in text.splitlines() if line.startswith("hf-attn convert "))
    assert command.startswith("hf-attn convert default OUT --to mla")
    args = build_parser().parse_args(shlex.split(command)[1:])
    rebuilt = json.loads(json.dumps(ConvertOptions.from_flat(**convert_options(args)).flat()))
    assert rebuilt == report["options"]


def test_licence_carried_from_a_local_source(tmp_path):
    model, tokenizer = load_default()
    src = tmp_path / "src"
    model.save_pretrained(src)
    tokenizer.save_pretrained(src)
    (src / "README.md").write_text(
        "---\nlicense: other\nlicense_name: my-licence\nlicense_link: https://example.com/licence\n---\n# a model\n"
    )
    convert(str(src), tmp_path / "out", to="mqa", **FAST)
    text, _ = read(tmp_path / "out")
    data = ModelCard(text).data
    assert (data.license, data.license_name, data.license_link) == (
        "other",
        "my-licence",
        "https://example.com/licence",
    )
    assert data.base_model is None  # a local folder: its Hub origin is not known
    (src / "README.md").unlink()
    convert(str(src), tmp_path / "out2", to="mqa", **FAST)
    text, _ = read(tmp_path / "out2")
    assert ModelCard(text).data.license is None and "Unknown: the source's model card names no licence" in text


def test_deepseek_v3_card_loads_without_the_patch(tmp_path):
    convert("default", tmp_path / "ds", to="mla", kv_budget=0.5, format="deepseek_v3", engine="transformers", **FAST)
    text, _ = read(tmp_path / "ds")
    assert "deepseek_v3" in ModelCard(text).data.tags
    assert "vllm serve PATH_OR_REPO" in text and "--outtype f32" in text and "DeepseekV3ForCausalLM" in text
    assert "import hf_attn_patch  # registers" not in text


def test_update_card_records_perplexity_and_accuracy(mla, tmp_path):
    folder = tmp_path / "mla"
    shutil.copytree(mla, folder)
    update_card(
        folder,
        {"text": "held_out.txt", "tokens": 1024, "perplexity": 6.9, "source_perplexity": 5.4, "kl_to_reference": 0.26},
    )
    update_card(folder, {"accuracy": {"arc_easy acc": [0.30, 0.40]}})
    text, report = read(folder)
    assert (
        "perplexity 6.90 against the source's 5.40 (1.278x)" in text
        and "| arc_easy acc | 0.300 | 0.400 | 75.0% |" in text
    )
    assert set(report["evaluation"]) >= {"perplexity", "accuracy"}
    ModelCard(text)
    with pytest.raises(ValueError, match="needs all of"):
        update_card(folder, {"perplexity": 3.0})
    with pytest.raises(ValueError, match="not a converted model folder"):
        update_card(tmp_path, {"accuracy": {}})


def test_eval_cli_updates_the_card(mla, tmp_path):
    folder = tmp_path / "mla"
    shutil.copytree(mla, folder)
    text_file = tmp_path / "held_out.txt"
    text_file.write_text("Once upon a time, there was a little girl named Lily. She liked to play outside. " * 40)
    main(
        [
            "eval",
            str(folder),
            "--text",
            str(text_file),
            "--reference",
            "default",
            "--ctx",
            "64",
            "--max-tokens",
            "256",
            "--update-card",
        ]
    )
    text, report = read(folder)
    assert report["evaluation"]["tokens"] == 4 * 63 and "Measured on `held_out.txt` (252 tokens" in text


def test_eval_tasks_cli_updates_the_card(mla, tmp_path):
    pytest.importorskip("lm_eval")
    from pathlib import Path

    folder = tmp_path / "mla"
    shutil.copytree(mla, folder)
    tasks = Path(__file__).parent / "data" / "lm_eval"
    main(
        [
            "eval",
            str(folder),
            "--tasks",
            "tiny_stories_cloze",
            "--limit",
            "4",
            "--include-path",
            str(tasks),
            "--reference",
            "default",
            "--update-card",
        ]
    )
    text, report = read(folder)
    assert "tiny_stories_cloze acc" in report["evaluation"]["accuracy"] and "| tiny_stories_cloze acc |" in text
    with pytest.raises(SystemExit, match="--update-card needs --reference"):
        main(["eval", str(folder), "--text", "x.txt", "--update-card"])


def test_eval_long_context_prints_and_records_the_shares_of_the_source(mla, tmp_path):
    """--long-context: repeated passages and fact recall 1,024 / 2,048 / 4,096 tokens back in the user's text, for
    the model and its reference, recorded in the card. stories260k's context (512) is too short for these gaps, so
    both folders are given one of 2,400 here (RoPE runs at any position), which holds the 1,024 and 2,048 items but
    not the 4,096 ones: a check of the machinery and of the distances kept, not of quality."""
    from hf_attn_patch.converters.io.calibration import read_calibration_text

    folder, reference = tmp_path / "mla", tmp_path / "reference"
    shutil.copytree(mla, folder)
    model, tokenizer = load_default()
    model.config.max_position_embeddings = 2400
    model.save_pretrained(reference)
    tokenizer.save_pretrained(reference)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2400}))
    text_file = tmp_path / "own.txt"
    text_file.write_text(read_calibration_text(None)[:40_000])
    main(
        [
            "eval",
            str(folder),
            "--text",
            str(text_file),
            "--reference",
            str(reference),
            "--ctx",
            "64",
            "--max-tokens",
            "128",
            "--long-context",
            "--long-context-items",
            "2",
            "--update-card",
        ]
    )
    text, report = read(folder)
    lc = report["evaluation"]["long_context"]
    assert lc["gaps"] == [1024, 2048] and lc["text"] == "own.txt" and lc["items"] == 2
    for kind in ("passage", "facts"):
        for cell in lc[kind].values():
            assert 0 <= cell["accuracy"] <= 1 and 0 <= cell["source"] <= 1
            if cell["source"]:  # the share of the unrounded accuracies, rounded apart
                assert cell["retained"] == pytest.approx(cell["accuracy"] / cell["source"], abs=2e-3)
            else:
                assert cell["retained"] is None
    assert "Long-context retrieval on `own.txt`" in text and "| fact recall |" in text
    assert "| probe | 1,024 tokens back | 2,048 tokens back |" in text
    with pytest.raises(SystemExit, match="--long-context needs --text FILE"):
        main(["eval", str(folder), "--text", str(text_file), "--long-context"])
    with pytest.raises(SystemExit, match="none fits the model's context of 512 tokens"):  # stories260k as it ships
        main(["eval", str(mla), "--text", str(text_file), "--reference", "default", "--long-context"])


def test_the_card_names_the_text_that_calibrated_and_healed_the_model(mla, tmp_path):
    text, _ = read(mla)
    assert "Calibrated on the package's default corpus (a TinyStories sample" in text and "--calib-data" in text
    report = convert(
        "default",
        tmp_path / "long",
        to="latent_kv",
        kv_budget=0.5,
        context="long",
        heal_steps=2,
        heal_len=384,
        calib_samples=4,
    )
    card = (tmp_path / "long" / "README.md").read_text()
    assert report["options"]["calib_data"] == "general"
    assert "Calibrated and healed on the package's general-domain corpus (WikiText-2" in card
    quality = card.split("## Quality against the source")[1]
    assert "SmolLM2" not in quality and "kept" not in quality  # no figure measured on another model
