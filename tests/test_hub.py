"""Model cards and hf-attn push (tested with a client object: no machine here reaches a Hub)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hf_attn_patch.converters.convert import convert
from hf_attn_patch.hub import push

from ._fast import FAST


class RecordingClient:
    """Stands in for huggingface_hub.HfApi: records the calls push() makes."""

    def __init__(self):
        self.calls = []

    def create_repo(self, repo_id, private=False, exist_ok=False):
        self.calls.append(("create_repo", repo_id, private, exist_ok))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, folder_path, repo_id, commit_message):
        self.calls.append(("upload_folder", folder_path, repo_id))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "mqa"
    convert("default", out, to="mqa", **FAST)
    return out


def test_model_card_has_hub_metadata_and_loading(converted):
    card = (converted / "README.md").read_text()
    assert card.startswith("---\nbase_model: karpathy/tinyllamas")
    assert "- hf-attn-patch" in card and "- mqa" in card and "640 B -> 160 B (25.0% of the source)" in card
    assert "import hf_attn_patch" not in card  # a stock-format GQA export loads with plain transformers


def test_push_creates_repo_and_uploads(converted):
    client = RecordingClient()
    result = push(converted, "me/stories-mqa", private=True, client=client)
    assert client.calls == [
        ("create_repo", "me/stories-mqa", True, True),
        ("upload_folder", str(converted), "me/stories-mqa"),
    ]
    assert "model.safetensors" in result["files"] and result["url"].endswith("me/stories-mqa")


def test_push_refuses_bad_input(converted, tmp_path):
    with pytest.raises(ValueError, match="is not a converted model folder"):
        push(tmp_path, "me/x", client=RecordingClient())
    with pytest.raises(ValueError, match="repo_id='nope' must look like 'owner/name'"):
        push(converted, "nope", client=RecordingClient())


def test_push_cli_dry_run(converted):
    cmd = [sys.executable, "-m", "hf_attn_patch.cli", "push", str(converted), "me/stories-mqa", "--dry-run"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["dry_run"] and "conversion_report.json" in plan["files"] and "README.md" in plan["files"]


def test_convert_pushes_when_asked_and_checks_the_repo_first(tmp_path):
    client = RecordingClient()
    report = convert(
        "default",
        tmp_path / "gqa",
        to="gqa",
        kv_heads=2,
        push_to_hub="me/stories-gqa",
        private=True,
        hub_client=client,
        **FAST,
    )
    assert client.calls[0] == ("create_repo", "me/stories-gqa", True, True)
    assert client.calls[1] == ("upload_folder", str(tmp_path / "gqa"), "me/stories-gqa")
    assert report["hub"]["url"] == "https://huggingface.co/me/stories-gqa"
    with pytest.raises(ValueError, match="push_to_hub='no-slash' must look like 'owner/name'"):
        convert("default", tmp_path / "never", to="gqa", kv_heads=2, push_to_hub="no-slash", **FAST)
    assert not (tmp_path / "never").exists()  # refused before any work


def test_sharded_export_has_an_index_and_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    convert("default", tmp_path / "sharded", to="mla", kv_budget=0.5, max_shard_size="300KB", **FAST)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # several shards
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "sharded")
    assert model.config.attention_variant == "mla"
