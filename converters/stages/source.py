"""The source: its folder of safetensors weights, read one decoder layer at a time (layer_source.LayerSource), its
tokenizer and generation config. The whole model is loaded only by the stages that need one (teacher sampling when
it fits, end-to-end healing), and freed after."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from safetensors import safe_open

from ...devices import resolve_device
from ...models.architectures import AttentionShape
from ...models.pretrained import DEFAULT_MODEL_DIR, check_source_folder
from ..io.layer_source import LayerSource, weight_map

logger = logging.getLogger(__name__)


@dataclass
class Source:
    """layers: the source read layer by layer on `device`; tokenizer; generation_config (None if the folder has
    none)."""

    name: str
    layers: LayerSource
    tokenizer: object
    generation_config: object
    device: torch.device

    @property
    def config(self):
        return self.layers.config

    @cached_property
    def shape(self) -> AttentionShape:
        """The source's attention shape, read once from its config: the stages pass it on."""
        return AttentionShape.of(self.config)

    def whole(self):
        """The whole source model on `device`, in eval mode (transformers' from_pretrained: the checkpoint's dtype)."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.layers.folder, use_safetensors=True).eval()
        return model.to(self.device)


def source_folder(source: str) -> Path:
    """The local folder of `source`: 'default' (the embedded stories260k), 'smollm2' (SmolLM2-135M-Instruct in fp32),
    a local folder with safetensors weights, or a Hub id (its safetensors, config and tokenizer files downloaded)."""
    if source == "default":
        return Path(DEFAULT_MODEL_DIR)
    if source == "smollm2":
        from ...models.pretrained import smollm2_dir

        return smollm2_dir()
    check_source_folder(source)  # a folder without config.json, or with only pickled weights, is refused
    if Path(source).is_dir():
        return Path(source)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, allow_patterns=["*.safetensors", "*.json", "*.model", "*.txt"]))
    except Exception as err:  # huggingface_hub raises several types (offline, not found, gated)
        raise ValueError(
            f"{source!r} is not a model folder, 'default', 'smollm2' or a reachable Hub id ({err})"
        ) from err


def checkpoint_dtype(folder: Path, config) -> torch.dtype:
    """The dtype from_pretrained loads by default: the config's, else the first floating tensor's."""
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    files = weight_map(folder)
    for name, file in files.items():
        with safe_open(file, framework="pt") as f:
            t = f.get_slice(name)
            kind = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
            if t.get_dtype() in kind:
                return kind[t.get_dtype()]
    return torch.float32


def open_source(source: str, device: str) -> Source:
    """The Source on resolve_device(device): its config, tokenizer and skeleton; no weight is read yet (the
    resident parts: Source.layers.load_resident(), once the target is checked)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    folder = source_folder(source)
    dtype = checkpoint_dtype(folder, AutoConfig.from_pretrained(folder))
    where = resolve_device(device)
    layers = LayerSource.open(folder, where, dtype, resident=False)
    try:
        generation = GenerationConfig.from_pretrained(folder)
    except OSError:
        generation = GenerationConfig.from_model_config(layers.config)
    return Source(str(source), layers, AutoTokenizer.from_pretrained(folder), generation, torch.device(where))
