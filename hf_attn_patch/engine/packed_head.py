"""The output projection (lm_head) in oneDNN's blocked weight layout, for fp32 models on the CPU.

    head = PackedHead.for_model(model)    # None where it does not apply (a GPU, another dtype, no plain Linear)
    with head.swapped():                  # during the engine's forward only: lm_head runs the packed weight
        logits = model(...)

torch's F.linear on a [V, d] fp32 weight with a small hidden size (d 288-576, V 32-49k) and 1-32 rows runs at a
fraction of the memory bandwidth; the same product by a weight reordered once for oneDNN
(torch.ops.mkldnn._reorder_linear_weight, what vLLM-CPU's onednn_mm does) takes 0.4-0.6x the time at 8-32 rows
(scripts/bench_vs_vllm.py measures the engine). The sums run in another order: logits differ by fp32 rounding
(~1e-6 on stories15M's). The packed copy costs V x d x 4 bytes more memory (tied embeddings keep theirs) and is made
again when the weight changes (its version counter or storage moves). Outside `swapped()` the model is untouched.
"""

from __future__ import annotations

import contextlib

import torch

ROWS_HINT = 32  # the batch oneDNN tunes the layout for (vLLM-CPU's choice)


class PackedHead:
    def __init__(self, head: torch.nn.Linear):
        self.head = head
        self._key = None
        self._packed = None

    @classmethod
    def for_model(cls, model) -> PackedHead | None:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if type(head) is not torch.nn.Linear or not torch.backends.mkldnn.is_available():
            return None
        weight = head.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
            return None
        return cls(head)

    def _weight(self) -> torch.Tensor:
        weight = self.head.weight
        key = (weight.data_ptr(), weight._version, tuple(weight.shape))
        if key != self._key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)
            self._key = key
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., d] -> [..., V] = x W^T + b."""
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.ops.mkldnn._linear_pointwise(flat, self._weight(), self.head.bias, "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1])

    @contextlib.contextmanager
    def swapped(self):
        """lm_head calls forward() instead of its own (an instance attribute; whatever was there is back on exit)."""
        previous = self.head.__dict__.get("forward")
        self.head.forward = self.forward
        try:
            yield
        finally:
            if previous is None:
                del self.head.forward
            else:
                self.head.forward = previous
