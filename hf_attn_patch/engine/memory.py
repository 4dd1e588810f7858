"""The engine's KV pool size: fixed bytes, or a share of the device's memory (vLLM's --gpu-memory-utilization).

    budget = kv_budget(model, max_batch_tokens=512, max_num_seqs=64, utilization=0.9)
    budget.kv_bytes   # = utilization x device memory - memory in use (weights, other processes) - activation peak
    num_blocks, block_bytes = pool_blocks(config, dtype, block_size, max_num_seqs, None, budget.kv_bytes)

The activation peak is measured by a profiling forward of max_batch_tokens tokens in one packed row, as the engine
runs them, keeping the logits of max_num_seqs rows: on a GPU from the allocator's peak; on the CPU from the
profiler's allocation records (live tensor bytes over the forward). "Device memory" on the CPU is the machine's RAM,
and memory in use is what the OS does not report as available.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass

import torch

from ..kv_memory import kv_cache_bytes

logger = logging.getLogger(__name__)

DEFAULT_KV_MEMORY = 512 * 1024 * 1024  # bytes, when neither max_memory nor a utilization is given


@dataclass
class KVBudget:
    kv_bytes: int  # what the KV pool may take
    device_bytes: int  # the device's memory (the machine's RAM on the CPU)
    in_use_bytes: int  # in use before the pool: weights, the runtime, other processes
    activation_bytes: int  # peak of the profiling forward
    utilization: float

    def to_dict(self) -> dict:
        return asdict(self)


def device_memory(device: torch.device) -> tuple[int, int]:
    """(total, in use) bytes of `device`; the CPU's from the OS (/proc/meminfo, else sysconf with nothing in use)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total, total - free
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return total, total - info["MemAvailable"]
    except (OSError, KeyError, ValueError):
        return total, 0


def activation_peak(model, tokens: int, rows: int) -> int:
    """Peak bytes of activations of one forward of `tokens` packed tokens that keeps the logits of `rows` of them."""
    device = next(model.parameters()).device
    ids = torch.zeros((1, tokens), dtype=torch.long, device=device)
    keep = torch.arange(tokens - min(rows, tokens), tokens, device=device)
    kwargs = dict(input_ids=ids, use_cache=False, logits_to_keep=keep)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        with torch.no_grad():
            model(**kwargs)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(**kwargs)
    live = peak = 0  # each op's own allocations minus frees, in the order the ops started
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def kv_budget(model, max_batch_tokens: int, max_num_seqs: int, utilization: float) -> KVBudget:
    """The KV pool's bytes for `utilization` of the model's device; ValueError, with the numbers, when nothing is
    left."""
    if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0 < utilization <= 1:
        raise ValueError(f"Engine: memory_utilization={utilization!r} must be a fraction in (0, 1]")
    device = next(model.parameters()).device
    activations = activation_peak(model, max_batch_tokens, max_num_seqs)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    total, in_use = device_memory(device)
    budget = KVBudget(int(utilization * total) - in_use - activations, total, in_use, activations, utilization)
    logger.info(
        "KV pool: %.2f GiB (%.0f%% of %.2f GiB, less %.2f GiB in use and %.2f GiB of activations at %d tokens)",
        budget.kv_bytes / 2**30,
        100 * utilization,
        total / 2**30,
        in_use / 2**30,
        activations / 2**30,
        max_batch_tokens,
    )
    if budget.kv_bytes <= 0:
        raise ValueError(
            f"Engine: memory_utilization={utilization} leaves no memory for the KV cache: "
            f"{utilization} x {total} bytes - {in_use} in use - {activations} of activations at "
            f"max_batch_tokens={max_batch_tokens}; raise memory_utilization or lower max_batch_tokens"
        )
    return budget


def pool_blocks(config, dtype, block_size: int, max_num_seqs: int, num_blocks: int | None, max_memory: int | None):
    """(blocks in the KV pool, bytes of one block over all attention layers): num_blocks, else as many as max_memory
    holds (default DEFAULT_KV_MEMORY) beside the constant states of max_num_seqs sequences (hybrid models)."""
    state = kv_cache_bytes(config, 0, dtype=dtype)  # per sequence; 0 without constant-state layers
    block_bytes = kv_cache_bytes(config, block_size, dtype=dtype) - state
    if num_blocks is None:
        memory = max_memory if max_memory is not None else DEFAULT_KV_MEMORY
        num_blocks = max(0, memory - max_num_seqs * state) // block_bytes
        if state and num_blocks < 2:
            raise ValueError(
                f"Engine: max_memory={memory} cannot hold the constant states of max_num_seqs={max_num_seqs} "
                f"sequences ({state} bytes each) and 2 blocks; raise max_memory or lower max_num_seqs"
            )
    if num_blocks < 2:
        raise ValueError(f"Engine: max_memory={max_memory} holds {num_blocks} blocks; need at least 2")
    return num_blocks, block_bytes
