"""The model runner: owns the paged KV storage, builds the step's AttentionMetadata once, runs one forward.

    runner = ModelRunner(model, num_blocks=..., block_size=16)      # runner.kv: the KV manager the scheduler uses
    logits = runner.forward(scheduled)   # scheduled: [(request, n tokens)] -> float32 logits [sum(1 + drafts), V]

The scheduled tokens of many requests go through the model as one row [1, T] with their own position ids. The
metadata travels in a forward context (cache/metadata.py); while it is set, transformers' attention lookup returns
the paged backend (attention/backend.py), which writes each layer's new K/V at slot_mapping and attends over the
block tables. The model is called without a cache and with a 4-D placeholder mask, which transformers passes
through untouched (the metadata is the mask); nothing on the model or its config is changed.

Hybrid models (constant-state layers: attention/state_layers.py lists the families): the KV manager gives each
sequence a state slot, the runner keeps the slots' states (cache/state_pool.py) and hands the forward each
sequence's Cache in the forward context (`states`); a sequence at position 0 starts from an empty state.
"""

from __future__ import annotations

import torch

from ..attention.backend import lookups_routed
from ..attention.state_layers import check_state_layers
from ..cache.block_pool import NULL_BLOCK
from ..cache.manager import STATE, KVManager, layer_groups
from ..cache.metadata import ForwardContext, build_metadata, forward_context
from ..cache.state_pool import StateStorage


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, prefix_caching: bool = True, max_num_seqs: int = 64,
                 chunked_prefill: bool = True):  # fmt: skip
        config = model.config.get_text_config(decoder=True)
        self.layer_groups = layer_groups(config)
        hybrid = STATE in self.layer_groups
        if hybrid:
            check_state_layers(model, self.layer_groups, chunked_prefill)  # each one we can run per sequence
        groups = sorted(set(self.layer_groups) - {STATE}, key=lambda g: (g is not None, g or 0))
        if not groups:
            raise ValueError("Engine: the model has no attention layer (constant-state layers only); not served")
        self.kv = KVManager(block_size, num_blocks, groups, prefix_caching, state_slots=max_num_seqs if hybrid else 0)
        self.states = StateStorage(config, max_num_seqs) if hybrid else None  # per slot: transformers Cache
        self.model = model
        self.device = next(model.parameters()).device
        self.storage: list = [None] * len(self.layer_groups)  # per layer its KVStorage (made at its first write)
        self._mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.device)
        self._allocate_storage()

    def _allocate_storage(self) -> None:
        """Make every layer's KV storage now (the backend makes it, zeroed, at a layer's first write), so the first
        request does not pay for zeroing the whole pool (stories260k, 256 MiB: 60 ms of its time to first token).
        One token goes through the model written into the null block, which is zeroed again after."""
        if not lookups_routed():
            return  # unpatched: forward() refuses later with the reason
        metadata = build_metadata([{g: [NULL_BLOCK] for g in self.kv.groups}], [0], [1], self.kv.block_size,
                                  self.layer_groups, self.device)  # fmt: skip
        self._run(metadata, None, [0], [0], [0])
        for storage in self.storage:
            if storage is not None:
                storage.zero_block(NULL_BLOCK)  # the null block reads as zeros (cache/manager.py)

    def forward(self, scheduled, keep: list[int] | None = None) -> torch.Tensor:
        """Packed forward of the scheduled tokens -> float32 logits on the CPU: by default, per request that reaches
        its end (request.remaining == n), its last token's and (speculation) every draft position's.
        keep: instead, the indices into the step's packed tokens (scheduled order) whose logits to return."""
        if not lookups_routed():  # the forward context reaches attention only through the patched lookup
            raise RuntimeError("Engine: hf_attn_patch is unpatched (unpatch() was called); call hf_attn_patch.patch()")
        tokens, positions, tables, starts, counts, last = [], [], [], [], [], []
        groups = self.kv.groups
        for request, n in scheduled:
            tokens += (request.tokens + request.draft)[request.computed : request.computed + n]
            positions += range(request.computed, request.computed + n)
            tables.append({g: self.kv.table(request.id, g) for g in groups})
            starts.append(request.computed)
            counts.append(n)
            if request.remaining == n:  # logits of its last token, and of each draft position before it
                last.extend(range(len(tokens) - 1 - len(request.draft), len(tokens)))
        self._apply_copies()
        metadata = build_metadata(tables, starts, counts, self.kv.block_size, self.layer_groups, self.device)
        states = None
        if self.states is not None:  # each sequence's state; one at position 0 starts empty (new, or recomputed)
            states = [self.states.cache(self.kv.state_slot(r.id), fresh=r.computed == 0) for r, _ in scheduled]
        return self._run(metadata, states, tokens, positions, last if keep is None else keep)

    def _run(self, metadata, states, tokens: list[int], positions: list[int], keep: list[int]) -> torch.Tensor:
        """One forward of the packed row under the metadata's forward context -> float32 logits [len(keep), V]."""
        context = ForwardContext(metadata, self.storage, {g: self.kv.pools[g].num_blocks for g in self.kv.groups},
                                 states=states)  # fmt: skip
        device = self.device
        keep = torch.tensor(keep, dtype=torch.long, device=device)
        with torch.no_grad(), forward_context(context):
            out = self.model(input_ids=torch.tensor([tokens], device=device),
                             position_ids=torch.tensor([positions], device=device), attention_mask=self._mask,
                             use_cache=False, logits_to_keep=keep)  # fmt: skip
        return out.logits[0].float().cpu()

    def _apply_copies(self) -> None:
        """Copy-on-write copies the manager decided: block contents move before this step writes into them."""
        for group, source, target in self.kv.take_copies():
            for layer, storage in enumerate(self.storage):
                if storage is not None and self.layer_groups[layer] == group:
                    storage.copy_block(source, target)
