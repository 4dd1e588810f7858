"""The model runner: owns the paged KV storage, builds the step's AttentionMetadata once, runs one forward, samples.

    runner = ModelRunner(model, num_blocks=..., block_size=16)   # runner.groups: the KV manager's block groups
    result = runner.execute(plan, masks)    # plan: SchedulerOutput, masks: GrammarMasks or None -> ModelRunnerOutput
    logits = runner.forward(plan, keep)     # the forward alone -> float32 logits [len(keep), V]

`execute` is a step's model side: the forward keeping the plan's logits rows, then (sampler.py) every sampling
request's grammar mask, draw or draft verification and logprobs at once, and the prompt logprobs; the answer is a
value (runner_output.py). Between steps the runner keeps nothing of a request but its KV (and constant state).

The scheduled tokens of many requests go through the model as one row [1, T] with their own position ids. The
metadata travels in a forward context (cache/metadata.py); while it is set, transformers' attention lookup returns
the paged backend (attention/backend.py), which writes each layer's new K/V at slot_mapping and attends over the
block tables. The model is called without a cache and with a 4-D placeholder mask, which transformers passes
through untouched (the metadata is the mask); nothing on the model or its config is changed, except that its
nn.Linear layers become FastLinear (models/fast_linear.py: packed oneDNN weights on the CPU, as every model built
while patched already has; a no-op where that is turned off).

Hybrid models (constant-state layers: attention/state_layers.py lists the families): the KV manager gives each
sequence a state slot, the runner keeps the slots' states (cache/state_pool.py) and hands the forward each
sequence's Cache in the forward context (`states`); a sequence at position 0 starts from an empty state.
"""

from __future__ import annotations

import torch

from ..attention.backend import lookups_routed
from ..attention.state_layers import check_state_layers
from ..cache.block_pool import NULL_BLOCK
from ..cache.kv_storage import apply_copies
from ..cache.manager import STATE, layer_groups
from ..cache.metadata import ForwardContext, build_metadata, forward_context
from ..cache.state_pool import StateStorage
from ..kv_memory import layer_cache_specs
from ..models import fast_linear
from .grammar_link import GrammarMasks
from .runner_output import ModelRunnerOutput
from .sampler import prompt_logprobs, sample_requests
from .scheduler_output import SchedulerOutput


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, max_num_seqs: int = 64, chunked_prefill: bool = True):
        config = model.config.get_text_config(decoder=True)
        self.layer_groups = layer_groups(config)
        hybrid = STATE in self.layer_groups
        if hybrid:
            check_state_layers(model, self.layer_groups, chunked_prefill)  # each one we can run per sequence
        self.groups = sorted(set(self.layer_groups) - {STATE}, key=lambda g: (g is not None, g or 0))
        if not self.groups:
            raise ValueError("Engine: the model has no attention layer (constant-state layers only); not served")
        self.block_size = block_size
        self.vocab_size = config.vocab_size  # logits columns past it (padding) are never sampled
        self.states = StateStorage(config, max_num_seqs) if hybrid else None  # per slot: transformers Cache
        self.model = model
        self.device = next(model.parameters()).device
        self.storage: list = [None] * len(self.layer_groups)  # per layer its KVStorage (made at its first write)
        self.specs = layer_cache_specs(config)  # per layer what it caches: the storage's layout
        self._mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.device)
        fast_linear.install(model)  # a model built before the import or unpatched gets the packed layers too
        self._allocate_storage(num_blocks)

    def _allocate_storage(self, num_blocks: int) -> None:
        """Make every layer's KV storage now (the backend makes it, zeroed, at a layer's first write), so the first
        request does not pay for zeroing the whole pool (stories260k, 256 MiB: 60 ms of its time to first token).
        One token goes through the model written into the null block, which is zeroed again after."""
        if not lookups_routed():
            return  # unpatched: forward() refuses later with the reason
        metadata = build_metadata(
            [{g: [NULL_BLOCK] for g in self.groups}], [0], [1], self.block_size, self.layer_groups, self.device
        )
        self._run(metadata, None, [0], [0], [0], dict.fromkeys(self.groups, num_blocks))
        for storage in self.storage:
            if storage is not None:
                storage.zero_block(NULL_BLOCK)  # the null block reads as zeros (cache/manager.py)

    def execute(self, plan: SchedulerOutput, masks: GrammarMasks | None = None) -> ModelRunnerOutput:
        """One step: the forward, then per request id its drawn tokens, their logprobs and its prompt logprobs."""
        logits = self.forward(plan, list(plan.logits_rows))[:, : self.vocab_size]
        prompt = prompt_logprobs(logits, plan.prompt_logprobs)
        sampled, logprobs = sample_requests(logits, plan.sampling, masks)
        return ModelRunnerOutput(sampled, logprobs, prompt)

    def forward(self, output: SchedulerOutput, keep: list[int]) -> torch.Tensor:
        """Packed forward of the step's scheduled tokens -> float32 logits on the CPU of the packed positions `keep`
        (indices into the step's tokens, in scheduling order)."""
        if not lookups_routed():  # the forward context reaches attention only through the patched lookup
            raise RuntimeError("Engine: hf_attn_patch is unpatched (unpatch() was called); call hf_attn_patch.patch()")
        tokens = [t for ids in output.token_ids for t in ids]
        positions = [p for start, n in zip(output.starts, output.num_tokens) for p in range(start, start + n)]
        apply_copies(output.copies, list(zip(self.layer_groups, self.storage)))
        metadata = build_metadata(
            output.block_tables, output.starts, output.num_tokens, self.block_size, self.layer_groups, self.device
        )
        states = None
        if self.states is not None:  # each sequence's state; one at position 0 starts empty (new, or recomputed)
            states = [
                self.states.cache(slot, fresh=start == 0) for slot, start in zip(output.state_slots, output.starts)
            ]
        return self._run(metadata, states, tokens, positions, keep, output.pool_blocks)

    def _run(
        self, metadata, states, tokens: list[int], positions: list[int], keep: list[int], pool_blocks: dict
    ) -> torch.Tensor:
        """One forward of the packed row under the metadata's forward context -> float32 logits [len(keep), V]."""
        context = ForwardContext(metadata, self.storage, pool_blocks, states=states, specs=self.specs)
        device = self.device
        keep = torch.tensor(keep, dtype=torch.long, device=device)
        with torch.no_grad(), forward_context(context):
            out = self.model(
                input_ids=torch.tensor([tokens], device=device),
                position_ids=torch.tensor([positions], device=device),
                attention_mask=self._mask,
                use_cache=False,
                logits_to_keep=keep,
            )
        return out.logits[0].float().cpu()
