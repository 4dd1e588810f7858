"""A model plus its KV cache whose batch rows advance by different numbers of tokens.

Speculative verification appends the same number of columns to every row, but each row keeps its own number of
them. Rejected columns are not moved: they become holes, masked out of attention by the 2-D attention mask, and
the columns that no row kept are cropped off the end. Position ids count only a row's valid tokens, so every
kept token sees exactly the keys and positions plain decoding would give it.

Invariants: `mask` [B, C] has one column per cache column (C == cache.get_seq_length());
`next_position[b]` = number of valid tokens of row b (the position its next token gets).
Layers with a sliding window count cache columns, holes included, so batches > 1 refuse them (see
`check_supported`); batch 1 never has holes.

`early_exit_view(model, n)`: the model's first n layers, final norm and LM head as a module of its own, sharing
every weight and leaving the user's model untouched (early-exit drafting).
"""

from __future__ import annotations

import copy
import inspect

import torch
from torch import nn

from ..compat import cache_kwarg


def check_supported(config, batch_size: int) -> None:
    """Raise before any work when holes would change the model's math (sliding windows count columns)."""
    layer_types = getattr(config, "layer_types", None) or []
    sliding = getattr(config, "sliding_window", None) is not None and (
        not layer_types or any("sliding" in str(kind) for kind in layer_types)
    )
    if sliding and batch_size > 1 and getattr(config, "use_sliding_window", True):
        raise ValueError(
            f"speculative decoding with batch_size={batch_size} does not support sliding-window attention "
            f"(config.sliding_window={config.sliding_window}): rows would attend to different windows; use batch 1"
        )


def decoder_layers(model) -> nn.ModuleList:
    """The model's list of decoder layers: the first ModuleList (module order) of config.num_hidden_layers."""
    count = model.config.get_text_config(decoder=True).num_hidden_layers
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == count:
            return module
    raise ValueError(f"{type(model).__name__}: no ModuleList of {count} decoder layers found for early exit")


def early_exit_view(model: nn.Module, num_layers: int) -> nn.Module:
    """A view of `model` that runs its first `num_layers` decoder layers, then its final norm and LM head.

    The user's model is not touched: the modules on the path from the root to the layer list are shallow copies
    (own `_modules` dict, every parameter, buffer and submodule shared), the layer list is a new ModuleList of the
    same first layers, and the copies read a copy of the text config with `num_hidden_layers = num_layers` (model
    code slices `layers[: config.num_hidden_layers]`, and a DynamicCache built from the view's config gets one
    layer per kept layer). Embeddings, rotary embedding and mask construction are the model's own code.
    """
    config = model.config.get_text_config(decoder=True)
    if not 1 <= num_layers < config.num_hidden_layers:
        top = config.num_hidden_layers - 1
        raise ValueError(f"assistant_early_exit={num_layers}: must be in [1, {top}] for this model")
    layers = decoder_layers(model)
    path = _path_to(model, layers)  # [(module, child name)] from the root down to the owner of `layers`
    view_config = copy.copy(config)
    view_config.num_hidden_layers = num_layers
    copies = [_shallow_copy(module, config, view_config) for module, _ in path]
    for (_, name), parent, child in zip(path, copies, copies[1:]):
        setattr(parent, name, child)
    setattr(copies[-1], path[-1][1], nn.ModuleList(list(layers)[:num_layers]))
    return copies[0]


def _path_to(root: nn.Module, target: nn.Module) -> list[tuple[nn.Module, str]]:
    for name, child in root.named_children():
        if child is target:
            return [(root, name)]
        below = _path_to(child, target)
        if below:
            return [(root, name), *below]
    return []


def _shallow_copy(module: nn.Module, config, view_config) -> nn.Module:
    """A module object sharing everything with `module` except its child dict and (where it is `config`) config."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    if getattr(module, "config", None) is config:
        clone.config = view_config
    return clone


class RaggedModel:
    """Forward passes of `model` over `cache` where rows keep different numbers of the appended columns."""

    def __init__(self, model, cache, mask: torch.Tensor, next_position: torch.Tensor):
        self.model, self.cache = model, cache
        self.mask = mask.to(torch.long)  # [B, C]
        self.next_position = next_position.to(torch.long)  # [B]
        params = inspect.signature(model.forward).parameters
        self._takes_positions = "position_ids" in params
        self._takes_logits_to_keep = "logits_to_keep" in params
        self._mark = None

    @property
    def columns(self) -> int:
        return self.mask.shape[1]

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor | None = None, last_only: bool = False, **extra):
        """Append tokens [B, n] (valid [B, n] bool; invalid ones are holes) -> float32 logits [B, n or 1, V].

        Positions of valid tokens continue each row's count (`keep` may roll them back). `extra` inputs go to the
        model as they are; its whole output stays in `self.outputs` until the next forward."""
        valid = torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid
        positions = self.next_position[:, None] + valid.long().cumsum(1) - 1
        positions = positions.clamp(min=0)
        self.mask = torch.cat([self.mask, valid.long()], dim=1)
        self.next_position = self.next_position + valid.long().sum(1)
        # an all-ones mask (no padding, no holes: always so at batch 1) is dropped, as generate() does: plain causal
        mask = None if bool(self.mask.all()) else self.mask
        inputs = {"input_ids": tokens, "attention_mask": mask, "use_cache": True, **cache_kwarg(self.cache)}
        inputs.update(extra)
        if self._takes_positions:
            inputs["position_ids"] = positions
        if last_only and self._takes_logits_to_keep:
            inputs["logits_to_keep"] = 1
        self.outputs = self.model(**inputs)
        logits = self.outputs.logits
        return (logits[:, -1:] if last_only else logits).float()

    def mark(self) -> None:
        """Remember where the next appended columns start (and the row positions there), for `keep`."""
        self._mark = (self.columns, self.next_position.clone())

    def keep(self, counts: torch.Tensor) -> None:
        """Of the columns appended since `mark()`, row b keeps its first counts[b] valid ones; the rest become holes
        and the columns no row kept are cropped from the cache."""
        start, positions = self._mark
        appended = self.mask[:, start:].bool()
        kept = appended & (appended.long().cumsum(1) <= counts[:, None])
        self.mask = torch.cat([self.mask[:, :start], kept.long()], dim=1)
        used = kept.any(0).nonzero()
        new_columns = start + (int(used[-1]) + 1 if used.numel() else 0)
        if new_columns < self.columns:
            self.cache.crop(new_columns - self.columns)
            self.mask = self.mask[:, :new_columns]
        self.next_position = positions + kept.sum(1)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only the given batch rows (finished rows leave the batch)."""
        self.cache.batch_select_indices(rows)
        self.mask = self.mask[rows]
        self.next_position = self.next_position[rows]
        self._mark = None
