"""Packed CPU weights for every nn.Linear of a model: q/k/v/o, the MLP, the LM head (the one owner of the swap).

While patched, every transformers model built (`PreTrainedModel.post_init`, a row of _patching.py) has its plain
`nn.Linear` modules turned into `FastLinear`, a subclass whose forward multiplies by a copy of the weight packed
once in oneDNN's blocked layout (kernels/cpu_linear.py) whenever that is exact and available:

- the weight and the input are CPU tensors of one dtype, float32 or bfloat16 (bf16 only where the CPU has oneDNN's
  bf16 kernels);
- no gradient is asked for (inside `torch.no_grad()` / `inference_mode()`, as in generate() and the engine, or with
  frozen weights and an input that needs none): the packed product has no backward;
- not while torch.compile traces the module (the compiled graph makes its own choice).

One exception by choice: a single fp32 row times a small weight (under GEMV_MAX_ELEMENTS) runs MKL's gemv
(F.linear), which is faster there (counted as "gemv"). Everything else runs nn.Linear's own forward (F.linear),
counted under its reason in `counts()`; a missing CPU
capability is also logged once at WARNING, naming the fallback. "Exact" means: the same products summed in another
order, so fp32 outputs differ from F.linear's by fp32 rounding and bf16 ones by at most one bf16 ulp
(kernels/cpu_linear.py derives both); greedy tokens are those of the stock model (tests/test_fast_linear.py).

    from hf_attn_patch.models import fast_linear
    fast_linear.install(model)      # a model built before the import or unpatched (the engine calls it itself)
    fast_linear.restore(model)      # this model's layers back to nn.Linear, packed copies freed
    fast_linear.set_enabled(False)  # every FastLinear runs F.linear until set_enabled(True)
    with fast_linear.disabled():    # every FastLinear runs F.linear inside the block (blocks nest; process-wide)
        ...
    fast_linear.counts()            # {"packed": n, "gemv": n, "<fallback reason>": n, ...} since reset_counts()

`disabled()` is for computations that must be bitwise reproducible whatever runs them: the converter
(converters/convert.py, converters/fitting/heal.py, the layer-streamed passes of converters/io/) runs inside it, so
a conversion's weights and report do not depend on this switch, on the CPU's bf16 support or on which of its
modules happen to be FastLinear (decoder layers it builds itself are plain nn.Linear), and a layer-streamed
conversion stays bitwise equal to the whole model's.
`HF_ATTN_PATCH_FAST_LINEAR=0` in the environment turns it off before anything is built. `unpatch()` turns every
FastLinear back into nn.Linear (and frees its packed copy); `patch()` turns them into FastLinear again.

Cost: the packed copy is a second copy of each weight (the model's linear weights twice in memory), made at a
layer's first packed call and again whenever the weight changes (its storage, version counter, dtype or shape).
`state_dict()`, parameters and saving are nn.Linear's: the packed copy lives outside them.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import weakref

import torch
from torch import nn

from ..kernels.cpu_linear import onednn_linear_unsupported, pack_linear_weight, packed_linear

logger = logging.getLogger(__name__)

ENV_SWITCH = "HF_ATTN_PATCH_FAST_LINEAR"
PACKED = "packed"  # the key of counts() for products that ran on the packed weight
# fp32, one row, a weight of fewer elements than this: MKL's gemv (F.linear) is faster than the packed product's
# fixed cost (scripts/bench_kernels.py fast-linear --part linear, one thread: 576 x 576 0.031 vs 0.046 ms,
# 192 x 576 0.013 vs 0.032, 1,536 x 576 0.075 vs 0.083; from 576 x 1,536 (0.100 vs 0.092) and up, and at 2+ rows,
# packed wins)
GEMV = "gemv"  # the key of counts() for those: a choice of the fast path, not a fallback
GEMV_MAX_ELEMENTS = 1_000_000
FAST = (PACKED, GEMV)  # what counts() holds when nothing fell back
# fallback reasons, the keys of counts() for products that ran F.linear
DISABLED, GRAD, DEVICE, MIXED_DTYPES, COMPILING = "disabled", "grad", "not cpu", "mixed dtypes", "compiling"


class _Switch:
    """Whether FastLinear runs packed, the one place that holds it: the user's switch (set_enabled(), the
    environment at import) and how many disabled() blocks are open. Process-wide: a block opened in one thread turns
    the packed path off for every thread until it closes; the count changes under a lock, so blocks opened and
    closed in several threads at once nest correctly."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.blocks = 0
        self.lock = threading.Lock()

    def on(self) -> bool:
        return self.enabled and not self.blocks

    def enter(self) -> None:
        with self.lock:
            self.blocks += 1

    def exit(self) -> None:
        with self.lock:
            self.blocks -= 1


_switch = _Switch(os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no"))
_installed: weakref.WeakSet = weakref.WeakSet()  # modules that are FastLinear now
_suspended: weakref.WeakSet = weakref.WeakSet()  # turned back into nn.Linear by suspend(); resume() swaps them again
_counts: collections.Counter = collections.Counter()
_capability: dict = {}  # dtype -> None (packed product available) or the reason it is not
_logged: set = set()


def _unsupported(dtype: torch.dtype) -> str | None:
    if dtype not in _capability:
        _capability[dtype] = onednn_linear_unsupported(dtype)
    reason = _capability[dtype]
    if reason is not None and reason not in _logged:
        _logged.add(reason)
        logger.warning("hf_attn_patch: %s Linear layers run torch's F.linear: %s", dtype, reason)
    return reason


class FastLinear(nn.Linear):
    """nn.Linear whose forward uses a packed copy of its weight where that is exact (see the module docstring)."""

    # x W^T + b with `weight` as it is, like nn.Linear itself: code that folds the weight into another matrix (MLA's
    # absorbed attention) may treat it as plain, unlike quantized or wrapped Linear subclasses
    plain_weight = True

    def __getstate__(self):
        """copy.deepcopy and pickle: the packed copy (an opaque oneDNN tensor, not copyable) stays behind; the copy
        packs its own at its first product."""
        state = super().__getstate__()
        state.pop("_fast_packed", None)
        state.pop("_fast_key", None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        _installed.add(self)  # a copy made while patched: unpatch() turns it back into nn.Linear too

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        reason = self._fallback_reason(input)
        if reason is None:
            weight = self.weight
            if (
                weight.dtype == torch.float32
                and input.numel() == input.shape[-1]
                and weight.numel() < GEMV_MAX_ELEMENTS
            ):
                _counts[GEMV] += 1
                return nn.Linear.forward(self, input)
            _counts[PACKED] += 1
            return packed_linear(input, self._packed_weight(), self.bias)
        _counts[reason] += 1
        return nn.Linear.forward(self, input)

    def _fallback_reason(self, x: torch.Tensor) -> str | None:
        weight = self.weight
        if not _switch.on():
            return DISABLED
        if weight.device.type != "cpu" or x.device.type != "cpu":
            return DEVICE
        if x.dtype != weight.dtype or (self.bias is not None and self.bias.dtype != weight.dtype):
            return MIXED_DTYPES
        if torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad):
            return GRAD
        if torch.compiler.is_compiling():
            return COMPILING
        return _unsupported(weight.dtype)

    def _packed_weight(self) -> torch.Tensor:
        weight = self.weight
        version = -1 if weight.is_inference() else weight._version  # inference tensors keep no version counter
        key = (weight.data_ptr(), version, weight.dtype, weight.shape)
        state = self.__dict__
        if state.get("_fast_key") != key:
            state["_fast_packed"] = pack_linear_weight(weight)
            state["_fast_key"] = key
        return state["_fast_packed"]


def _to_plain(module: nn.Module) -> None:
    module.__class__ = nn.Linear
    module.__dict__.pop("_fast_packed", None)
    module.__dict__.pop("_fast_key", None)


def install(model: nn.Module) -> int:
    """Turn every plain nn.Linear of `model` into FastLinear (no-op while set_enabled(False); inside disabled() they
    are turned, and run F.linear until the block closes) -> how many were turned."""
    if not _switch.enabled:
        return 0
    turned = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = FastLinear
            _installed.add(module)
            _suspended.discard(module)
            turned += 1
    if turned:
        logger.debug("hf_attn_patch: %d Linear layers of %s run packed weights", turned, type(model).__name__)
    return turned


def restore(model: nn.Module) -> int:
    """Turn `model`'s FastLinear layers back into nn.Linear, freeing their packed copies -> how many."""
    restored = 0
    for module in model.modules():
        if type(module) is FastLinear:
            _to_plain(module)
            _installed.discard(module)
            restored += 1
        _suspended.discard(module)
    return restored


def installed(model: nn.Module) -> int:
    """How many of `model`'s layers are FastLinear now."""
    return sum(type(m) is FastLinear for m in model.modules())


def suspend() -> None:
    """unpatch(): every FastLinear back to nn.Linear (remembered, so resume() swaps them again)."""
    for module in list(_installed):
        if type(module) is FastLinear:
            _to_plain(module)
            _suspended.add(module)
    _installed.clear()


def resume() -> None:
    """patch(): the layers suspend() turned back become FastLinear again."""
    for module in list(_suspended):
        if type(module) is nn.Linear:
            module.__class__ = FastLinear
            _installed.add(module)
    _suspended.clear()


def with_fast_linears(original):
    """`PreTrainedModel.post_init` that installs FastLinear on the model it finishes building."""

    def post_init(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        install(self)
        return result

    post_init.__wrapped__ = original
    return post_init


def set_enabled(enabled: bool) -> None:
    """Off: every FastLinear runs F.linear (counted as "disabled") and install() does nothing; on: back to packed
    (outside disabled() blocks)."""
    _switch.enabled = bool(enabled)


def is_enabled() -> bool:
    """Whether FastLinear layers run packed now (the switch on, no disabled() block open)."""
    return _switch.on()


@contextlib.contextmanager
def disabled():
    """Every FastLinear runs F.linear (counted as "disabled") inside the block, in every thread; blocks nest."""
    _switch.enter()
    try:
        yield
    finally:
        _switch.exit()


def counts() -> dict[str, int]:
    """Products run since reset_counts(): "packed", or the fallback reason they ran F.linear for."""
    return dict(_counts)


def reset_counts() -> None:
    """Zero counts(), and forget the capability checks and what was logged (they are made again on next use)."""
    _counts.clear()
    _capability.clear()
    _logged.clear()
