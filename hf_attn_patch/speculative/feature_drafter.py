"""A feature drafter in the EAGLE style: one decoder layer that drafts from the target's own last hidden states.

Position i of the drafter reads x_i = fc([norm(h_{i-1}); norm(embed(t_i))]): h_{i-1} is the target's final hidden
state at the previous position (what its LM head reads; zeros at a row's first token), embed the target's input
embedding. One Llama decoder layer and a final norm give g_i, trained to equal h_i; the draft logits are
g_i @ W[ids]^T, the rows of the target's LM head W for the draft vocabulary `ids` (the N tokens the target emits
most), so a draft step costs one layer and an N x D product instead of a V x D one. Drafting k tokens: the first
step reads the target's real h_n, the later ones feed back the drafter's own g.

The checkpoint holds fc, the layer, the norms and `ids`; the embedding and the LM head stay the target's, attached
by `bind(target)` (speculative decoding does it) and never copied into the checkpoint. Verification is unchanged:
tokens outside the draft vocabulary get probability 0 from the drafter, which rejection sampling handles exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import DynamicCache, LlamaConfig
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import ModelOutput
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from ..compat import attention_cache, cache_kwarg
from .drafters import Draft, Drafter, draft_chain
from .ragged import RaggedModel
from .sequences import Sequences

MODEL_TYPE = "hf_attn_feature_drafter"


@strict
class FeatureDrafterConfig(LlamaConfig):
    """A one-layer Llama config plus what the drafter drafts for. `vocab_size` is the target's (generate() checks
    that assistant and target agree); `draft_vocab_size` is N, the rows of the LM head the drafter scores."""

    model_type = MODEL_TYPE
    draft_vocab_size: int = 0
    max_draft_tokens: int = 6  # the longest draft the adaptive length may pick
    drafts_for: dict | None = None  # the target: name_or_path, model_type, hidden_size, vocab_size


@dataclass
class FeatureDrafterOutput(ModelOutput):
    logits: torch.Tensor | None = None  # [B, n or logits_to_keep, N]: over the draft vocabulary
    features: torch.Tensor | None = None  # [B, n, D]: g, the predicted target hidden states
    cache: object = None


class FeatureDrafterForCausalLM(LlamaPreTrainedModel):
    config_class = FeatureDrafterConfig
    base_model_prefix = "drafter"

    def __init__(self, config: FeatureDrafterConfig):
        super().__init__(config)
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.feature_norm = LlamaRMSNorm(dim, eps=eps)
        self.embed_norm = LlamaRMSNorm(dim, eps=eps)
        self.fc = nn.Linear(2 * dim, dim, bias=False)
        self.layer = LlamaDecoderLayer(config, 0)
        self.norm = LlamaRMSNorm(dim, eps=eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.register_buffer("draft_token_ids", torch.arange(config.draft_vocab_size), persistent=True)
        self._target: dict = {}  # a plain dict: the target's modules must not become submodules (nor be saved)
        self.post_init()

    def bind(self, target) -> None:
        """Use `target`'s input embedding and the draft vocabulary's rows of its LM head (derived, not saved)."""
        if self._target.get("model") is target:
            return
        text = target.config.get_text_config(decoder=True)
        if (text.hidden_size, text.vocab_size) != (self.config.hidden_size, self.config.vocab_size):
            mine = f"hidden_size={self.config.hidden_size}, vocab_size={self.config.vocab_size}"
            raise ValueError(f"this drafter drafts for {mine}; the target has {text.hidden_size}, {text.vocab_size}")
        head = target.get_output_embeddings().weight.detach()
        rows = head[self.draft_token_ids.to(head.device)].to(self.fc.weight.dtype)
        self._target = {"model": target, "embed": target.get_input_embeddings(), "head": rows}

    def forward(
        self,
        input_ids: torch.Tensor,
        target_hidden: torch.Tensor,
        attention_mask=None,
        position_ids=None,
        cache=None,
        use_cache: bool = True,
        logits_to_keep: int = 0,
        past_key_values=None,
        **kwargs,
    ) -> FeatureDrafterOutput:
        """input_ids [B, n], target_hidden [B, n, D] (the target's h at each token's previous position)."""
        if not self._target:
            raise ValueError("the feature drafter is not bound to its target: call drafter.bind(target) first")
        embed = self._target["embed"](input_ids).to(self.fc.weight.dtype)
        x = self.fc(torch.cat([self.feature_norm(target_hidden.to(embed.dtype)), self.embed_norm(embed)], dim=-1))
        cache = attention_cache(cache, past_key_values)  # under either name (compat.py)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            seen = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(x.shape[1], device=x.device) + seen)[None]
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=x,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **cache_kwarg(cache),
        )
        x = self.layer(
            x,
            attention_mask=mask,
            position_embeddings=self.rotary_emb(x, position_ids=position_ids),
            position_ids=position_ids,
            use_cache=use_cache,
            **cache_kwarg(cache),
        )
        features = self.norm(x)
        kept = features[:, -logits_to_keep:] if logits_to_keep else features
        return FeatureDrafterOutput(logits=kept @ self._target["head"].T, features=features, cache=cache)


class FeatureDrafter(Drafter):
    """Drives a FeatureDrafterForCausalLM inside speculative decoding (protocol in drafters.py).

    The target's last hidden states are read by a forward hook on its decoder (removed by `finish`). The drafter's
    cache holds only positions fed with the target's real features: each round feeds the tokens verified since the
    last round (with the features the target computed for them), drafts k tokens, then rolls the draft steps back.
    Invariant: row b's tokens not yet in the drafter's cache are its last sum(len(f) for f in self.pending[b]),
    and self.pending[b] holds their features (the target's h at each one's previous position)."""

    def __init__(self, target, drafter: FeatureDrafterForCausalLM, vocab_size: int):
        drafter.bind(target)
        self.model, self.vocab_size = drafter, vocab_size
        self._captured = None
        self._hook = target.get_decoder().register_forward_hook(self._capture)

    def _capture(self, module, args, output) -> None:
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        self._captured = hidden.detach()

    def finish(self) -> None:
        self._hook.remove()

    def start(self, sequences: Sequences, attention_mask: torch.Tensor, target: RaggedModel | None = None) -> None:
        mask = attention_mask.long()
        batch, width = mask.shape
        feats = self._captured.to(self.model.dtype)  # the prefill's [B, w, D]; w < width after prefix-cache hits
        if feats.shape[1] < width:  # positions the prefill did not run: no feature (quality only, not exactness)
            feats = torch.cat([feats.new_zeros(batch, width - feats.shape[1], feats.shape[2]), feats], dim=1)
        previous = torch.cat([feats.new_zeros(batch, 1, feats.shape[2]), feats[:, :-1]], dim=1)
        previous = previous * torch.cat([mask[:, :1] * 0, mask[:, :-1]], dim=1)[..., None]  # a row's first: zeros
        cache = DynamicCache(config=self.model.config)
        self.state = RaggedModel(self.model, cache, mask[:, :0], torch.zeros_like(mask[:, 0]))
        self.state.forward(sequences.tokens, mask.bool(), last_only=True, target_hidden=previous)
        self.pending = [[feats[b, -1:]] for b in range(batch)]
        self._proposed = 0

    def propose(self, sequences: Sequences, k: int, process, do_sample: bool) -> Draft:
        counts = torch.tensor([sum(len(f) for f in row) for row in self.pending], device=sequences.tokens.device)
        n = int(counts.max())
        feed = sequences.tokens[:, -n:]
        valid = torch.arange(n, device=feed.device)[None, :] >= (n - counts)[:, None]
        feats = feed.new_zeros((len(self.pending), n, self.model.config.hidden_size), dtype=self.model.dtype)
        for b, row in enumerate(self.pending):
            feats[b, n - int(counts[b]) :] = torch.cat(row)
        self.state.mark()
        logits = self.state.forward(feed, valid, last_only=True, target_hidden=feats)[:, -1]

        def step(token):  # the next draft step reads the drafter's own last feature
            own = self.state.outputs.features[:, -1:]
            return self._full_vocab(self.state.forward(token[:, None], last_only=True, target_hidden=own)[:, -1])

        tokens, probs = draft_chain(sequences, k, process, do_sample, self._full_vocab(logits), step)
        self._counts, self._proposed = counts, k
        return Draft(tokens, torch.full_like(counts, k), probs)

    def accepted(self, counts: torch.Tensor) -> None:
        if self._proposed:  # keep the positions fed with real features, drop the draft steps
            self.state.keep(self._counts)
            self.pending = [[] for _ in self.pending]
            self._proposed = 0
        verified = self._captured.to(self.model.dtype)  # the target's verification forward [B, k + 1, D]
        for b, count in enumerate(counts.tolist()):
            self.pending[b].append(verified[b, : count + 1])

    def select(self, rows: torch.Tensor) -> None:
        self.state.select(rows)
        self.pending = [self.pending[i] for i in rows.tolist()]

    def _full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, N] draft-vocabulary logits -> [B, V] with -inf outside the draft vocabulary."""
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        return full.index_copy_(1, self.model.draft_token_ids.to(logits.device), logits)
