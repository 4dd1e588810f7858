"""Carrying calibration windows through the decoder layers one layer at a time (LayerRunner, Activations, Tracks).

The windows' hidden states [N, T, D] are carried from layer to layer: layer i is read from the checkpoint, run over the
carried states in chunks of windows, and freed. The carried states need two buffers (a layer's input and its output),
2 * N * T * D * itemsize bytes; they are kept on the device when that fits its budget, else in CPU memory, else in a
temporary file on disk mapped into memory. Peak memory: the resident parts + one layer + the two buffers (when in
memory) + one chunk's intermediates, whatever the depth.

The ops and their order are the base model's forward (embed -> layers with the same masks and rotary cos/sin ->
norm -> lm_head), so the logits equal the whole model's with the same kernels: the passes here (and LayerSource's) run
torch's F.linear whatever the CPU inference fast path (models/fast_linear.py, disabled()), as the whole conversion does.
"""

from __future__ import annotations

import inspect
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ...models import fast_linear
from .layer_source import LayerSource

logger = logging.getLogger(__name__)

PLACEMENTS = ("device", "cpu", "disk")
BATCH = 4  # windows per layer call in a conversion: the batches its whole-model passes ran (statistics, fits)


def available_cpu_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else the physical memory size."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def choose_placement(
    nbytes: int, device, device_budget: int | None = None, cpu_budget: int | None = None, buffers: int = 2
) -> str:
    """Where `buffers` activation buffers of `nbytes` each go: 'device' (an accelerator), 'cpu' or 'disk'.

    Two buffers per carried track (a layer's input and output; a conversion carries the source's and the converted
    prefix's: four). Budgets are bytes for all buffers together; None: half the device's free memory / half the CPU's
    available memory.
    On a CPU device the first choice is 'cpu' (the device budget is then ignored)."""
    device = torch.device(device)
    need = buffers * nbytes
    if device.type != "cpu":
        if device_budget is None:
            device_budget = torch.cuda.mem_get_info(device)[0] // 2 if device.type == "cuda" else 0
        if need <= device_budget:
            return "device"
    if cpu_budget is None:
        cpu_budget = available_cpu_bytes() // 2
    return "cpu" if need <= cpu_budget else "disk"


@dataclass
class Activations:
    """Two buffers [N, T, D] (`current`: the next layer's input; `spare`: its output), swapped after each layer.

    placement 'device' / 'cpu': tensors in memory; 'disk': tensors memory-mapped from files in `tmpdir` (removed by
    close())."""

    current: torch.Tensor
    spare: torch.Tensor
    placement: str
    tmpdir: Path | None = None

    @classmethod
    def allocate(cls, shape, dtype, placement: str, device, tmp_root=None) -> "Activations":
        """Two uninitialized buffers of `shape` [N, T, D]. On 'disk' they are files of N*T*D*itemsize bytes in a new
        folder under `tmp_root` (default: the system's temporary folder), mapped shared: the pages touched count in
        the RSS but are the kernel's file cache, written back and dropped under memory pressure."""
        if placement not in PLACEMENTS:
            raise ValueError(f"placement={placement!r} is not one of {PLACEMENTS}")
        if placement != "disk":
            where = torch.device(device) if placement == "device" else torch.device("cpu")
            return cls(
                torch.empty(shape, dtype=dtype, device=where), torch.empty(shape, dtype=dtype, device=where), placement
            )
        tmpdir = Path(tempfile.mkdtemp(prefix="hf-attn-activations-", dir=tmp_root))
        numel = int(torch.Size(shape).numel())
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        buffers = []
        for name in ("a", "b"):
            path = tmpdir / f"{name}.bin"
            with open(path, "wb") as f:
                f.truncate(nbytes)
            buffers.append(torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(shape))
        return cls(buffers[0], buffers[1], placement, tmpdir)

    def swap(self) -> None:
        self.current, self.spare = self.spare, self.current

    def close(self) -> None:
        """Drop the buffers (and their files, on disk)."""
        self.current = self.spare = None
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None


class Tracks:
    """The carried hidden states: {name: Activations}, placed together (device, cpu or disk)."""

    def __init__(self, names: list[str], shape, dtype, device, placement: str | None = None):
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        placement = placement or choose_placement(nbytes, device, buffers=2 * len(names))
        if placement == "device" and torch.device(device).type == "cpu":
            placement = "cpu"
        self.placement, self.bytes = placement, 2 * len(names) * nbytes
        self.stores = {n: Activations.allocate(shape, dtype, placement, device) for n in names}
        logger.info("carrying %d track(s) %s (%.1f MB) on %s", len(names), tuple(shape), self.bytes / 2**20, placement)

    def __getitem__(self, name: str) -> Activations:
        return self.stores[name]

    def close(self) -> None:
        for store in self.stores.values():
            store.close()


class LayerRunner:
    """Runs decoder layers over carried windows [N, T, D] in chunks, with the arguments the model's forward gives them.

    One runner serves every track a conversion carries (the source's hidden states and the converted prefix's):
    `embed(input_ids, out)` fills a buffer with token embeddings, `apply(layer, i, inputs, outputs)` writes
    layer(inputs) into outputs chunk by chunk, on the source's device, whatever the buffers' placement."""

    def __init__(self, src: LayerSource, seq_len: int, chunk_size: int = 8):
        if chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size} must be >= 1")
        self.src, self.seq_len, self.chunk_size = src, seq_len, chunk_size
        self._calls: dict[int, list] = {}  # by chunk batch size: per layer (args, kwargs)

    def calls(self, batch: int) -> list[tuple[tuple, dict]]:
        """Per layer the (args, kwargs) the model's forward passes for `batch` windows (LayerSource.layer_calls)."""
        if batch not in self._calls:
            self._calls[batch] = self.src.layer_calls(batch, self.seq_len)
        return self._calls[batch]

    def layer_kwargs(self, i: int) -> dict:
        """Decoder layer i's arguments besides the hidden states, for a batch of one (they broadcast over a batch),
        all by name (positional ones bound to the forward's parameter names)."""
        args, kwargs = self.calls(1)[i]
        if not args:
            return dict(kwargs)
        layer = self.src.layers[i]
        names = list(inspect.signature(layer.forward).parameters)[1:]  # after hidden_states
        return {**dict(zip(names, args)), **kwargs}

    @torch.no_grad()
    @fast_linear.disabled()  # the converter's kernels: torch's F.linear (models/fast_linear.py)
    def embed(self, input_ids: torch.Tensor, out: torch.Tensor) -> None:
        """out [N, T, D] <- the hidden states entering layer 0 for input_ids [N, T]."""
        for lo in range(0, input_ids.shape[0], self.chunk_size):
            out[lo : lo + self.chunk_size] = self.src.embed(input_ids[lo : lo + self.chunk_size]).to(out.device)

    @torch.no_grad()
    @fast_linear.disabled()
    def apply(self, layer: torch.nn.Module, i: int, inputs: torch.Tensor, outputs: torch.Tensor) -> None:
        """outputs [N, T, D] <- decoder layer i (`layer`, on the source's device) applied to inputs [N, T, D]."""
        for lo in range(0, inputs.shape[0], self.chunk_size):
            x = inputs[lo : lo + self.chunk_size].to(self.src.device)
            args, kwargs = self.calls(x.shape[0])[i]
            y = layer(x, *args, **kwargs)
            outputs[lo : lo + self.chunk_size] = y.to(outputs.device)
