"""A source model read one decoder layer at a time from its safetensors files.

The resident parts (everything outside the decoder layers: token and position embeddings, final norm, LM head, tied
to the embeddings where the config says so) are loaded once; `layer(i)` builds transformers' own decoder layer for
the config (LlamaDecoderLayer, GPT2Block, ...) with only layer i's weights, read with `safe_open`. The full model is
never materialized: its skeleton lives on the meta device and costs no memory. The skeleton's own forward, with its
decoder layers stood in for, gives what surrounds the layers for any architecture (layer_stream.LayerRunner):
the hidden states entering layer 0, each layer's other arguments, and the logits of the last layer's output.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ...models import fast_linear

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def resolve_folder(source: str | Path) -> Path:
    """The model folder of `source`: 'default' (the embedded stories260k) or a local folder with safetensors weights.

    A folder holding only pickled weights (*.bin, *.pt) is refused: they are never unpickled."""
    from ...models.pretrained import DEFAULT_MODEL_DIR

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
        raise ValueError(
            f"{what}: the checkpoint's keys are not the architecture's; missing {missing}, unexpected {unexpected}"
        )
    stray = [n for n, b in module.named_buffers() if n not in own]
    if stray:
        raise ValueError(f"{what}: non-persistent buffers {stray} cannot be read from a checkpoint")
    module.load_state_dict(tensors, assign=True)
    return module.eval().requires_grad_(False)


@dataclass
class LayerSource:
    """The source read layer by layer. Build with `LayerSource.open(source, device, dtype)`.

    model: the model with its resident parts loaded and its decoder layers left on the meta device;
    files: {tensor name: safetensors file}; layers_name: the module name of the decoder layers' ModuleList
    ('model.layers', 'transformer.h', 'gpt_neox.layers', 'model.decoder.layers')."""

    folder: Path
    config: object
    model: nn.Module
    files: dict[str, Path]
    device: torch.device
    dtype: torch.dtype
    layers_name: str = "model.layers"
    positions: torch.Tensor | None = None  # packed calibration windows' position_ids [T] (io/packing.py), or None

    @classmethod
    def open(
        cls, source, device="cpu", dtype=torch.float32, attn_implementation: str = "sdpa", resident: bool = True
    ) -> "LayerSource":
        """Read the config and (unless resident=False: later, by load_resident()) the resident parts; no decoder
        layer is read until `layer(i)`."""
        from transformers import AutoConfig, AutoModelForCausalLM

        from ...models.architectures import architecture_of

        folder = resolve_folder(source)
        config = AutoConfig.from_pretrained(folder)
        arch = architecture_of(config)  # raises, naming the model_type, for an architecture the package lacks
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
        config = model.config  # carries the attention implementation the decoder layers use
        attention = next(n for n, m in model.named_modules() if type(m).__name__ == arch.attention_class)
        layers_name = attention.rsplit(".", 2)[0]  # <layers>.<i>.<attention>
        src = cls(folder, config, model.eval(), weight_map(folder), torch.device(device), dtype, layers_name)
        if resident:
            src.load_resident()
        logger.info("opened %s (%s, %d layers) on %s", folder, config.model_type, config.num_hidden_layers, device)
        return src

    def load_resident(self) -> None:
        """Every tensor outside the decoder layers, read and given to the skeleton; the LM head tied to the input
        embeddings where the config ties them; rotary embeddings (buffers computed, not stored) rebuilt."""
        prefix = self.layers_name + "."
        keys = [k for k in self.model.state_dict() if not k.startswith(prefix)]
        if self.tied:
            keys = [k for k in keys if k not in self._head_keys()]
        self._check_present(keys)
        tensors = read_tensors(keys, self.files, self.device, self.dtype)
        self.model.load_state_dict(tensors, strict=False, assign=True)
        if self.tied:
            self.model.get_output_embeddings().weight = self.model.get_input_embeddings().weight
        for name, module in list(self.model.named_modules()):
            if name.startswith(prefix) or not any(b.is_meta for b in module.buffers(recurse=False)):
                continue
            if not hasattr(module, "inv_freq"):
                raise ValueError(
                    f"{name}: buffers {[n for n, _ in module.named_buffers(recurse=False)]} are not "
                    f"in the checkpoint and cannot be rebuilt"
                )
            parent, attr = name.rsplit(".", 1)  # inv_freq computed on the CPU, as at the model's construction
            setattr(self.model.get_submodule(parent), attr, type(module)(config=self.config).to(self.device))
        self.model.requires_grad_(False)

    def _head_keys(self) -> list[str]:
        head = self.model.get_output_embeddings()
        return [f"{n}.weight" for n, m in self.model.named_modules() if m is head]

    @property
    def tied(self) -> bool:
        """Whether the LM head is the token embedding matrix (config.tie_word_embeddings)."""
        return bool(getattr(self.config, "tie_word_embeddings", False))

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def layers(self) -> nn.ModuleList:
        """The skeleton's decoder layers (on the meta device)."""
        return self.model.get_submodule(self.layers_name)

    def _check_present(self, keys: list[str]) -> None:
        missing = [k for k in keys if k not in self.files]
        if missing:
            raise ValueError(f"source {str(self.folder)!r}: the checkpoint lacks {missing}")

    def layer_keys(self, i: int) -> list[str]:
        """The checkpoint names of layer i's tensors, e.g. 'model.layers.3.self_attn.q_proj.weight' (old checkpoints'
        per-layer 'rotary_emb.inv_freq' left out, as from_pretrained leaves it: the rotary embedding is built once)."""
        prefix = f"{self.layers_name}.{i}."
        return [k for k in self.files if k.startswith(prefix) and not k.endswith("rotary_emb.inv_freq")]

    def layer(self, i: int) -> nn.Module:
        """Decoder layer i (transformers' class for the config), weights read from the checkpoint, in eval mode,
        on `device` in `dtype`, with no gradients. Input/output: hidden states [B, T, D]."""
        if not 0 <= i < self.num_layers:
            raise ValueError(f"layer index {i} is outside 0..{self.num_layers - 1}")
        cls = type(self.layers[i])
        with torch.device("meta"):
            layer = cls(self.config, i)
        prefix = f"{self.layers_name}.{i}."
        tensors = read_tensors(self.layer_keys(i), self.files, self.device, self.dtype)
        return _load_into(layer, {k[len(prefix) :]: v for k, v in tensors.items()}, f"{self.layers_name}.{i}")

    def layer_calls(self, batch: int, seq_len: int) -> list[tuple[tuple, dict]]:
        """Per decoder layer, the arguments besides the hidden states (args, kwargs) the model's forward passes it
        for `batch` windows of seq_len tokens from position 0 (masks, positions, rotary cos/sin), use_cache off."""
        calls = []

        def record(i, hidden, args, kwargs):
            calls.append((args, kwargs))
            if i == self.num_layers - 1:  # the final norm and the LM head are not needed (logits: B x T x V)
                raise _Entered(hidden)
            return hidden

        try:
            self._skeleton_pass(torch.zeros(batch, seq_len, dtype=torch.long, device=self.device), record)
        except _Entered:
            pass
        return calls

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The hidden states [B, T, D] entering decoder layer 0 for input_ids [B, T] (token, and position,
        embeddings)."""

        def first(i, hidden, args, kwargs):
            raise _Entered(hidden)

        try:
            self._skeleton_pass(input_ids.to(self.device), first)
        except _Entered as entered:
            return entered.hidden
        raise RuntimeError("the model's forward never called its first decoder layer")

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] of the last decoder layer's output hidden [B, T, D] (final norm and LM head, as the
        model's forward applies them)."""
        hidden = hidden.to(self.device)

        def replace(i, h, args, kwargs):
            return hidden if i == 0 else h

        ids = torch.zeros(hidden.shape[:2], dtype=torch.long, device=self.device)
        return self._skeleton_pass(ids, replace).logits

    @torch.no_grad()
    @fast_linear.disabled()  # the converter's kernels: torch's F.linear (models/fast_linear.py, disabled())
    def _skeleton_pass(self, input_ids: torch.Tensor, on_call):
        """The model's forward on input_ids with decoder layer i stood in for by on_call(i, hidden, args, kwargs)."""
        container = self.layers
        originals = list(container)
        for i, layer in enumerate(originals):
            container[i] = _Stand(i, layer, on_call)
        packed = self.positions is not None and input_ids.shape[1] == len(self.positions)
        extra = {"position_ids": self.positions.to(input_ids.device).expand(len(input_ids), -1)} if packed else {}
        try:
            return self.model(input_ids=input_ids, use_cache=False, **extra)
        finally:
            for i, layer in enumerate(originals):
                container[i] = layer

    def resident_state(self) -> dict[str, torch.Tensor]:
        """The resident tensors by checkpoint name (a tied LM head once, as the embeddings)."""
        prefix, head = self.layers_name + ".", self._head_keys() if self.tied else []
        return {k: v for k, v in self.model.state_dict().items() if not k.startswith(prefix) and k not in head}

    def attention(self, layer: nn.Module) -> tuple[str, nn.Module]:
        """(name, module) of a decoder layer's stock attention ('self_attn', 'attn', 'attention')."""
        from ...models.architectures import architecture_of

        cls = architecture_of(self.config).attention_class
        return next((n, m) for n, m in layer.named_children() if type(m).__name__ == cls)

    def size_bytes(self) -> int:
        """Bytes of the checkpoint's weights as stored (the sum of its safetensors files)."""
        return sum(p.stat().st_size for p in set(self.files.values()))


class _Entered(Exception):
    """Raised by a stand-in: the rest of the skeleton's forward is not needed (`hidden`: what it was given)."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden


class _Stand(nn.Module):
    """Stands in for decoder layer i in the skeleton's forward: returns on_call(i, hidden, args, kwargs)."""

    def __init__(self, index: int, layer: nn.Module, on_call):
        super().__init__()
        self.index, self.on_call = index, on_call
        if hasattr(layer, "attention_type"):  # the model picks each layer's mask by it
            self.attention_type = layer.attention_type

    def forward(self, hidden_states, *args, **kwargs):
        return self.on_call(self.index, hidden_states, args, kwargs)
