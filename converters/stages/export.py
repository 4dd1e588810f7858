"""The deepseek_v3 export inside the layer loop (deepseek_layers.py: the per-layer pieces; deepseek_export.py: why).

Layer l's latent scale needs the latent c = kv_a_proj(x) of the native converted layer on its own inputs: the export
track carries the native prefix's hidden states one window at a time (as the whole-model export ran them), layer l
runs on it with LatentStats hooked to its kv_a_proj, and its tensors are rewritten. The KL of the export to the
native form (and, for llama.cpp, to the export with a plain q_proj) is measured on the first 4 windows: their
export-form tracks are carried beside, through each exported layer.
"""

from __future__ import annotations

import logging
import math

import torch

from ..export.deepseek_export import check_export, export_report
from ..export.deepseek_layers import LatentStats, export_config, export_layer, export_resident, export_shape
from ..io.layer_source import LayerSource
from ..io.layer_stream import Activations, LayerRunner

logger = logging.getLogger(__name__)
CHECK_WINDOWS = 4  # windows the export's KL to the native form is measured on


class LayerExport:
    """Built with the source (its config and resident parts), the engine, the export's RoPE dims, the latent norm
    mode and the frequency stride; `layer(...)` rewrites one layer; `resident()` the embeddings and head;
    `report()` the report's section."""

    def __init__(
        self, src: LayerSource, engine: str, rope_dim: int, latent_norm: str, stride: int, windows: torch.Tensor
    ):
        check_export(engine, latent_norm)
        self.src, self.engine, self.rope_dim, self.latent_norm, self.stride = src, engine, rope_dim, latent_norm, stride
        self.check = windows[: min(CHECK_WINDOWS, len(windows))]
        self.shape = self.config = self.forms = None
        self.scales, self.deviations, self.parameters = [], [], 0

    def _start(self, native_config) -> None:
        """At layer 0: the shape, the stock config, the export forms' resident parts and their check tracks."""
        self.shape = export_shape(native_config, self.engine, self.rope_dim, self.latent_norm)
        self.config, self.rope = export_config(native_config, self.src.config, self.shape, self.stride)
        state = {
            "model.embed_tokens.weight": self.src.model.model.embed_tokens.weight,
            "model.norm.weight": self.src.model.model.norm.weight,
            "lm_head.weight": self.src.model.lm_head.weight,
        }
        export_resident(state, self.shape)
        self.resident_state = state
        self.forms = {"export": _Form(self.config, state, self.src, self.check)}
        if self.shape.q_lora:
            plain = type(self.config).from_dict({**self.config.to_dict(), "q_lora_rank": None})
            self.forms["q_proj"] = _Form(plain, state, self.src, self.check)

    @torch.no_grad()
    def layer(
        self, i: int, native: torch.nn.Module, native_config, runner: LayerRunner, track: Activations, state: dict
    ) -> dict:
        """Layer i's export tensors (full names) from its native ones `state`; advances the export track."""
        if self.shape is None:
            self._start(native_config)
        self.parameters += sum(p.numel() for p in native.parameters())
        stats = LatentStats(self.shape.d_c, self.latent_norm)
        hook = native.self_attn.kv_a_proj_with_mqa.register_forward_hook(lambda m, a, out: stats.add(out))
        try:
            runner.apply(native, i, track.current, track.spare)
        finally:
            hook.remove()
        track.swap()
        scale, latent_map, deviation = stats.scale()
        self.scales.append(scale)
        self.deviations.append(deviation)
        state = {k: v.cpu() for k, v in state.items()}  # the export is built on the CPU
        q_proj_state = export_layer(state, i, self.shape, scale, latent_map)
        self.forms["export"].apply(i, state)
        if "q_proj" in self.forms:
            plain = {k: v for k, v in state.items() if ".q_a_" not in k and ".q_b_" not in k}
            self.forms["q_proj"].apply(i, {**plain, **q_proj_state})
        return state

    def resident(self) -> dict:
        """The export's embeddings (times the residual scale), final norm and LM head."""
        return self.resident_state

    @torch.no_grad()
    def report(self, native_hidden: torch.Tensor) -> dict:
        """The report's "deepseek_v3" section; native_hidden: the export track's last hidden states [n, T, D]."""
        native = [self.src.head(native_hidden[j : j + 1]) for j in range(len(self.check))]
        exported = self.forms["export"].logits()
        kl = _kl(native, exported)
        q_lora_kl = _kl(self.forms["q_proj"].logits(), exported) if "q_proj" in self.forms else None
        self.parameters += sum(
            t.numel() for t in (self.src.model.model.embed_tokens.weight, self.src.model.model.norm.weight)
        )
        if not self.src.tied:
            self.parameters += self.src.model.lm_head.weight.numel()
        logger.info(
            "deepseek_v3 export (%s, latent norm %s): KL to the native conversion %.3g per token",
            self.engine,
            self.latent_norm,
            kl,
        )
        return export_report(
            self.shape,
            self.src.config,
            self.engine,
            self.stride,
            self.rope,
            self.scales,
            self.deviations,
            kl,
            len(self.check),
            q_lora_kl,
            self.parameters,
        )


class _Form:
    """An exported model's check track: its resident parts on the meta-built shell, its layers applied as built."""

    def __init__(self, config, resident: dict, src: LayerSource, windows: torch.Tensor):
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            shell = AutoModelForCausalLM.from_config(config, dtype=src.dtype)
        shell.model.rotary_emb = type(shell.model.rotary_emb)(config=config).to(src.device)
        for name, tensor in resident.items():
            module_name, attr = name.rsplit(".", 1)
            setattr(shell.get_submodule(module_name), attr, torch.nn.Parameter(tensor.to(src.device), False))
        self.config, self.shell = config, shell.eval()
        self.view = LayerSource(src.folder, config, shell, {}, src.device, src.dtype)
        self.runner = LayerRunner(self.view, windows.shape[1], 1)
        self.hidden = torch.empty(*windows.shape, config.hidden_size, dtype=src.dtype, device=src.device)
        self.runner.embed(windows, self.hidden)

    def apply(self, i: int, state: dict) -> None:
        prefix = f"model.layers.{i}."
        with torch.device("meta"):
            layer = type(self.shell.model.layers[i])(self.config, i)
        own = {k[len(prefix) :]: v.to(self.view.device) for k, v in state.items() if k.startswith(prefix)}
        layer.load_state_dict(own, strict=True, assign=True)
        out = torch.empty_like(self.hidden)
        self.runner.apply(layer.eval(), i, self.hidden, out)
        self.hidden = out

    def logits(self) -> list[torch.Tensor]:
        return [self.view.head(self.hidden[j : j + 1]) for j in range(len(self.hidden))]


def _kl(reference: list[torch.Tensor], model: list[torch.Tensor]) -> float:
    """KL(reference || model) per predicted position, in float64, from per-window logits [1, T, V]
    (evaluate.evaluate's formula)."""
    total, count = 0.0, 0
    for ref, own in zip(reference, model):
        log_p = torch.log_softmax(own[0, :-1].double(), dim=-1)
        log_q = torch.log_softmax(ref[0, :-1].double(), dim=-1)
        total += (log_q.exp() * (log_q - log_p)).sum().item()
        count += own.shape[1] - 1
    return total / count if count else math.nan
