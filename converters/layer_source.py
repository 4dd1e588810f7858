"""A source model read one decoder layer at a time from its safetensors files.

The resident parts (token embeddings [V, D], final norm [D], LM head [V, D], tied to the embeddings where the config
says so) are loaded once; `layer(i)` builds transformers' own decoder layer for the config (LlamaDecoderLayer,
Qwen2DecoderLayer, ...) with only layer i's weights, read with `safe_open`. The full model is never materialized: its
skeleton lives on the meta device and costs no memory.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

logger = logging.getLogger(__name__)

# Base models whose forward is exactly: embed -> layers (one causal or sliding mask per layer, one rotary embedding)
# -> norm -> lm_head. Others (embedding scaling, soft-capping, per-layer rotary) would need their own streamed forward.
STREAMABLE_TYPES = ("llama", "mistral", "qwen2", "qwen3")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def resolve_folder(source: str | Path) -> Path:
    """The model folder of `source`: 'default' (the embedded stories260k) or a local folder with safetensors weights.

    A folder holding only pickled weights (*.bin, *.pt) is refused: they are never unpickled."""
    from ..models.pretrained import DEFAULT_MODEL_DIR

    folder = DEFAULT_MODEL_DIR if str(source) == "default" else Path(source)
    if not folder.is_dir():
        raise ValueError(f"source={str(source)!r} is not 'default' or a local model folder")
    if not (folder / INDEX_FILE).exists() and not (folder / SINGLE_FILE).exists():
        pickled = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        found = f"; it holds only pickled weights {pickled}, which are never read" if pickled else ""
        raise ValueError(f"source={str(source)!r} has no {SINGLE_FILE} or {INDEX_FILE}{found}")
    if not (folder / "config.json").exists():
        raise ValueError(f"source={str(source)!r} has no config.json")
    return folder


def weight_map(folder: Path) -> dict[str, Path]:
    """{tensor name: the safetensors file holding it}, from the index of a sharded checkpoint or the single file."""
    index = folder / INDEX_FILE
    if index.exists():
        entries = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in entries.items()}
    with safe_open(folder / SINGLE_FILE, framework="pt") as f:
        return {name: folder / SINGLE_FILE for name in f.keys()}


def read_tensors(names: list[str], files: dict[str, Path], device, dtype) -> dict[str, torch.Tensor]:
    """The named tensors, each opened with safe_open from its own file; floating ones cast to `dtype` on `device`."""
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    out = {}
    for file, file_names in by_file.items():
        with safe_open(file, framework="pt") as f:
            for name in file_names:
                t = f.get_tensor(name)
                out[name] = t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
    return out


def _load_into(module: nn.Module, tensors: dict[str, torch.Tensor], what: str) -> nn.Module:
    """Give the meta-device `module` its `tensors`: exactly its state dict's keys, else an error."""
    own = set(module.state_dict())
    if own != set(tensors):
        missing, unexpected = sorted(own - set(tensors)), sorted(set(tensors) - own)
        raise ValueError(f"{what}: the checkpoint's keys are not the architecture's; missing {missing}, "
                         f"unexpected {unexpected}")  # fmt: skip
    stray = [n for n, b in module.named_buffers() if n not in own]
    if stray:
        raise ValueError(f"{what}: non-persistent buffers {stray} cannot be read from a checkpoint")
    module.load_state_dict(tensors, assign=True)
    return module.eval().requires_grad_(False)


@dataclass
class LayerSource:
    """The source read layer by layer. Build with `LayerSource.open(source, device, dtype)`.

    model: the model with its resident parts loaded and its decoder layers left on the meta device.
    files: {tensor name: safetensors file}; layer_prefix: the state-dict prefix of the decoder layers."""

    folder: Path
    config: object
    model: nn.Module
    files: dict[str, Path]
    device: torch.device
    dtype: torch.dtype
    layer_prefix: str = "model.layers."

    @classmethod
    def open(cls, source, device="cpu", dtype=torch.float32, attn_implementation: str = "sdpa") -> "LayerSource":
        """Read the config and the resident parts; no decoder layer is read until `layer(i)`."""
        from transformers import AutoConfig, AutoModelForCausalLM

        folder = resolve_folder(source)
        config = AutoConfig.from_pretrained(folder)
        if config.model_type not in STREAMABLE_TYPES:
            raise ValueError(f"model_type={config.model_type!r} cannot be streamed layer by layer; "
                             f"supported: {list(STREAMABLE_TYPES)}")  # fmt: skip
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
        config = model.config  # carries the attention implementation the decoder layers use
        device = torch.device(device)
        files = weight_map(folder)
        src = cls(folder, config, model, files, device, dtype)
        base = model.model
        rotary = type(base.rotary_emb)(config=config)  # inv_freq computed on the CPU, as at the model's construction
        base.rotary_emb = rotary.to(device)
        for name in ("embed_tokens", "norm"):
            part = getattr(base, name)
            keys = [f"model.{name}.{k}" for k in part.state_dict()]
            src._check_present(keys)
            tensors = read_tensors(keys, files, device, dtype)
            _load_into(part, {k.split(".", 2)[2]: v for k, v in tensors.items()}, f"model.{name}")
        if src.tied:
            model.lm_head.weight = base.embed_tokens.weight  # the same Parameter, as transformers ties it
        else:
            src._check_present(["lm_head.weight"])
            head = read_tensors(["lm_head.weight"], files, device, dtype)["lm_head.weight"]
            _load_into(model.lm_head, {"weight": head}, "lm_head")
        model.eval()
        logger.info("opened %s (%s, %d layers) on %s", folder, config.model_type, config.num_hidden_layers, device)
        return src

    @property
    def tied(self) -> bool:
        """Whether the LM head is the token embedding matrix (config.tie_word_embeddings)."""
        return bool(getattr(self.config, "tie_word_embeddings", False))

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def _check_present(self, keys: list[str]) -> None:
        missing = [k for k in keys if k not in self.files]
        if missing:
            raise ValueError(f"source {str(self.folder)!r}: the checkpoint lacks {missing}")

    def layer_keys(self, i: int) -> list[str]:
        """The checkpoint names of layer i's tensors, e.g. 'model.layers.3.self_attn.q_proj.weight' (old checkpoints'
        per-layer 'rotary_emb.inv_freq' left out, as from_pretrained leaves it: the rotary embedding is built once)."""
        prefix = f"{self.layer_prefix}{i}."
        return [k for k in self.files if k.startswith(prefix) and not k.endswith("rotary_emb.inv_freq")]

    def layer(self, i: int) -> nn.Module:
        """Decoder layer i (transformers' class for the config), weights read from the checkpoint, in eval mode,
        on `device` in `dtype`, with no gradients. Input/output: hidden states [B, T, D]."""
        if not 0 <= i < self.num_layers:
            raise ValueError(f"layer index {i} is outside 0..{self.num_layers - 1}")
        cls = type(self.model.model.layers[i])
        with torch.device("meta"):
            layer = cls(self.config, i)
        prefix = f"{self.layer_prefix}{i}."
        tensors = read_tensors(self.layer_keys(i), self.files, self.device, self.dtype)
        return _load_into(layer, {k[len(prefix):]: v for k, v in tensors.items()}, f"{self.layer_prefix}{i}")

    def layer_types(self) -> list[str]:
        """Per layer 'full_attention' or 'sliding_attention', following the base model's forward for the config."""
        types = getattr(self.config, "layer_types", None)
        if types is not None:
            return list(types)
        sliding = getattr(self.config, "sliding_window", None) is not None  # mistral: one mask kind for all layers
        return ["sliding_attention" if sliding else "full_attention"] * self.num_layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [B, T, D] of input_ids [B, T]."""
        return self.model.model.embed_tokens(input_ids.to(self.device))

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] = lm_head(norm(hidden)) of the last layer's output hidden [B, T, D]."""
        return self.model.lm_head(self.model.model.norm(hidden.to(self.device)))

    def size_bytes(self) -> int:
        """Bytes of the checkpoint's weights as stored (the sum of its safetensors files)."""
        return sum(p.stat().st_size for p in set(self.files.values()))
