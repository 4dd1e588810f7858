"""fp32 master copies of a low-precision student's trainable weights, and the tensor lists healing checkpoints hold."""

from __future__ import annotations

from pathlib import Path

import torch

from .heal_fsdp import LOW_PRECISION


class MasterWeights:
    """The tensors the optimizer steps: each trainable weight itself, or an fp32 copy of a bf16 / fp16 one.

    A bf16 weight w moves only by steps above half its ulp, |w| 2^-9: AdamW's ~lr steps at lr 1e-5 on weights
    ~0.05 (half ulp ~1e-4) round away (measured on stories260k in bf16: 95% of the attention weights never moved in
    10 steps). The copy accumulates them; step() rounds it into the model, so the weights follow the fp32 path."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.tensors = [p.detach().float().requires_grad_(True) if p.dtype in LOW_PRECISION else p for p in params]
        self.separate = any(m is not p for m, p in zip(self.tensors, self.params))

    def step(self, optimizer) -> None:
        """Gradients (already averaged over processes) to the masters, one optimizer step, masters to the model."""
        for p, m in zip(self.params, self.tensors):
            if m is not p:
                m.grad, p.grad = (None if p.grad is None else p.grad.float()), None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self._push()

    def copy(self) -> list[torch.Tensor]:
        return [m.detach().clone() for m in self.tensors]

    @torch.no_grad()
    def restore(self, state: list[torch.Tensor]) -> None:
        for m, saved in zip(self.tensors, state):
            m.copy_(saved)
        self._push()

    @torch.no_grad()
    def _push(self) -> None:
        for p, m in zip(self.params, self.tensors):
            if m is not p:
                p.copy_(m)


def save_tensors(tensors: list[torch.Tensor], path: Path) -> None:
    """A list of tensors as one safetensors file (keys p0, p1, ...)."""
    from safetensors.torch import save_file

    save_file({f"p{i}": t.detach().contiguous() for i, t in enumerate(tensors)}, str(path))


def load_tensors(path: Path, count: int) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    return [tensors[f"p{i}"] for i in range(count)]
