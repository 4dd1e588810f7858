"""Peak memory and time of the layer-streamed forward against depth, next to the whole model's forward.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_stream_memory.py [--depths 30,60,120] [--width 576]
        [--windows 8] [--tokens 256] [--placement cpu|disk] [--no-whole] [--json rows.json]

Per depth, a synthetic Llama source of random weights (SmolLM2-135M's shape at --width 576: 9 query heads, 3 KV heads,
head_dim 64, MLP 1536, vocab 49152, tied embeddings; other widths scale heads and MLP) is written layer by layer into
a temporary folder (safetensors, 1 GB shards) by a subprocess. Then, each in a fresh subprocess of its own:
- streamed: LayerSource.open + stream_forward (below: the library's LayerRunner) over --windows windows of --tokens tokens (one chunk of all windows,
  activations in CPU memory, or memory-mapped files with --placement disk), logits of the last position;
- whole: AutoModelForCausalLM.from_pretrained + one forward of the same windows (logits_to_keep=1).
Printed per run: the source's size, RSS after the imports (the floor), peak RSS (VmHWM of /proc/self/status, and
resource.getrusage ru_maxrss as a check), the seconds from opening the source to the logits, and the two runs'
last-position logits compared (they must be equal); and the peak RSS over its floor of the process that wrote the
source layer by layer (ShardedWriter).
Memory flat and time linear in depth: the streamed peak minus the floor stays near constant, seconds / layer too.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch


def rss_mb() -> float:
    """Current resident set size of this process in MB, from /proc/self/statm."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> tuple[float, float]:
    """(VmHWM, ru_maxrss) in MB. VmHWM is this process image's own peak RSS; Linux carries ru_maxrss over from the
    parent's memory through fork + exec, so the parent stays small (it builds nothing) to keep the two equal."""
    hwm = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
               if line.startswith("VmHWM:"))  # fmt: skip
    return hwm / 1024, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # both in KB


# The layer-streamed forward measured here (and in tests/test_layer_stream.py): the library's LayerRunner and
# Activations carrying the windows through every decoder layer, one layer resident at a time.


@dataclass
class StreamResult:
    """hidden: the last decoder layer's output [N, T, D] (before the final norm), where `placement` says.
    activation_bytes: bytes of one buffer (N * T * D * itemsize). Close it (or use `with`) to free a disk placement."""

    hidden: torch.Tensor
    placement: str
    activation_bytes: int
    store: object = field(repr=False)

    def close(self) -> None:
        self.hidden = None
        self.store.close()

    def __enter__(self) -> "StreamResult":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def stream_forward(src, input_ids: torch.Tensor, *, chunk_size: int = 8, placement: str | None = None,
                   device_budget: int | None = None, cpu_budget: int | None = None, tmp_root=None,
                   on_layer=None) -> StreamResult:  # fmt: skip
    """Run the windows input_ids [N, T] through the source's (a LayerSource) decoder layers, one layer resident at a
    time. chunk_size: windows per layer call. placement: force 'device' / 'cpu' / 'disk', else chosen by
    `choose_placement` from the budgets. on_layer(i, layer, inputs, outputs): called after layer i ran over all
    windows, before it is freed. Returns the last layer's output; `src.head` makes logits."""
    from hf_attn_patch.converters.io.layer_stream import Activations, LayerRunner, choose_placement

    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [N, T] windows, got shape {tuple(input_ids.shape)}")
    n, t = input_ids.shape
    runner = LayerRunner(src, t, chunk_size)
    nbytes = n * t * src.config.hidden_size * torch.empty((), dtype=src.dtype).element_size()
    placement = placement or choose_placement(nbytes, src.device, device_budget, cpu_budget)
    if placement == "device" and src.device.type == "cpu":
        placement = "cpu"  # the device is the CPU: say so
    store = Activations.allocate((n, t, src.config.hidden_size), src.dtype, placement, src.device, tmp_root)
    try:
        runner.embed(input_ids, store.current)
        for i in range(src.num_layers):
            layer = src.layer(i)
            runner.apply(layer, i, store.current, store.spare)
            if on_layer is not None:
                on_layer(i, layer, store.current, store.spare)
            del layer  # freed before the next layer is read
            store.swap()
    except BaseException:
        store.close()
        raise
    return StreamResult(store.current, placement, nbytes, store)


@torch.no_grad()
def stream_logits(src, result: StreamResult, chunk_size: int = 8) -> torch.Tensor:
    """Logits [N, T, V] on the CPU from a StreamResult: lm_head(norm(hidden)), chunk by chunk."""
    hidden = result.hidden
    return torch.cat([src.head(hidden[lo : lo + chunk_size]).cpu() for lo in range(0, hidden.shape[0], chunk_size)])


def synthetic_config(depth: int, width: int, vocab: int = 49152):
    """A Llama config of SmolLM2-135M's proportions at `width` (head_dim 64, 3:1 GQA, MLP 8/3 x width)."""
    from transformers import LlamaConfig

    heads = width // 64
    return LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=width * 8 // 3, num_hidden_layers=depth,
                       num_attention_heads=heads, num_key_value_heads=max(1, heads // 3), head_dim=64,
                       max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 100000.0})  # fmt: skip


def build_source(folder: Path, depth: int, width: int, vocab: int = 49152) -> int:
    """Write a random source of `depth` layers to `folder`, one layer at a time; returns its weights' bytes."""
    from transformers import LlamaForCausalLM

    from hf_attn_patch.converters.io.layer_writer import ShardedWriter

    config = synthetic_config(depth, width, vocab)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(0)

    def rand(shapes: dict) -> dict:
        return {k: torch.ones(s) if len(s) == 1 else torch.randn(s, generator=gen) * 0.02 for k, s in shapes.items()}

    with ShardedWriter(folder, max_shard_size="1GB") as writer:
        writer.add(rand({"model.embed_tokens.weight": skeleton.model.embed_tokens.weight.shape}))
        for i, layer in enumerate(skeleton.model.layers):
            writer.add(rand({f"model.layers.{i}.{k}": v.shape for k, v in layer.state_dict().items()}))
        writer.add(rand({"model.norm.weight": skeleton.model.norm.weight.shape}))
        writer.finish(config)
    return writer.total_bytes


def child(args) -> None:
    """One measured run (or the source's build) in this fresh process; prints one JSON line."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401  (imported before the floor)

    from hf_attn_patch.converters.io.layer_source import LayerSource
    from hf_attn_patch.converters.io.layer_writer import ShardedWriter  # noqa: F401

    floor = rss_mb()
    if args.child == "build":
        size = build_source(Path(args.folder), args.depth, args.width)
        print(json.dumps({"source_bytes": size, "floor_mb": floor, "peak_mb": peak_rss_mb()[0]}))
        return
    ids = torch.randint(0, 49152, (args.windows, args.tokens), generator=torch.Generator().manual_seed(1))
    start = time.perf_counter()
    with torch.no_grad():
        if args.child == "streamed":
            src = LayerSource.open(args.folder)
            with stream_forward(src, ids, chunk_size=args.windows, placement=args.placement) as result:
                logits = src.head(result.hidden[:, -1:])
                placement = result.placement
        else:
            model = AutoModelForCausalLM.from_pretrained(args.folder).eval()
            logits = model(ids, logits_to_keep=1).logits
            placement = "whole model"
    seconds = time.perf_counter() - start
    torch.save(logits, args.logits_out)
    hwm, maxrss = peak_rss_mb()
    print(json.dumps({"floor_mb": floor, "peak_mb": hwm, "ru_maxrss_mb": maxrss, "seconds": seconds,
                      "placement": placement}))  # fmt: skip


def measure(mode: str, folder: Path, args, logits_out: Path | None = None, depth: int = 0) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--folder", str(folder), "--windows", str(args.windows),
           "--tokens", str(args.tokens), "--placement", args.placement, "--logits-out", str(logits_out),
           "--depth", str(depth), "--width", str(args.width)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise RuntimeError(f"{mode} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="30,60,120")
    parser.add_argument("--width", type=int, default=576)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--placement", choices=["cpu", "disk"], default="cpu", help="where the activations are kept")
    parser.add_argument("--no-whole", action="store_true", help="skip the whole-model baseline runs")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--child", choices=["build", "streamed", "whole"], help=argparse.SUPPRESS)
    parser.add_argument("--depth", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--logits-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    depths = [int(d) for d in args.depths.split(",")]
    if args.width % 64 or args.width < 192:
        parser.error(f"--width={args.width} must be a multiple of 64, at least 192")
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    print(f"width {args.width}, {args.windows} windows x {args.tokens} tokens, fp32, activations on {args.placement}, "
          f"OMP_NUM_THREADS={threads}; RSS in MB")  # fmt: skip
    header = (f"{'layers':>6} {'source MB':>9} | {'floor':>6} {'streamed peak':>13} {'maxrss':>6} {'peak-floor':>10} "
              f"{'s':>7} {'s/layer':>7} | {'whole peak':>10} {'peak-floor':>10} {'s':>7} | {'stream/whole peak':>17} "
              f"logits | build peak-floor")
    print(header)
    rows = []
    for depth in depths:
        root = Path(tempfile.mkdtemp(prefix="bench-stream-"))
        try:
            b = measure("build", root / "src", args, depth=depth)  # built (ShardedWriter) in its own process too
            size = b["source_bytes"]
            s = measure("streamed", root / "src", args, root / "s.pt")
            w = None if args.no_whole else measure("whole", root / "src", args, root / "w.pt")
            same = "-" if w is None else ("equal" if torch.equal(torch.load(root / "s.pt"), torch.load(root / "w.pt"))
                                          else "DIFFER")  # fmt: skip
        finally:
            shutil.rmtree(root, ignore_errors=True)
        row = {"layers": depth, "source_bytes": size, "build": b, "streamed": s, "whole": w, "logits": same}
        rows.append(row)
        whole = (f"{w['peak_mb']:>10.0f} {w['peak_mb'] - w['floor_mb']:>10.0f} {w['seconds']:>7.1f} | "
                 f"{s['peak_mb'] / w['peak_mb']:>17.2f}") if w else f"{'-':>10} {'-':>10} {'-':>7} | {'-':>17}"
        print(f"{depth:>6} {size / 2**20:>9.0f} | {s['floor_mb']:>6.0f} {s['peak_mb']:>13.0f} "
              f"{s['ru_maxrss_mb']:>6.0f} "
              f"{s['peak_mb'] - s['floor_mb']:>10.0f} {s['seconds']:>7.1f} {s['seconds'] / depth:>7.3f} | "
              f"{whole} {same:>6} | {b['peak_mb'] - b['floor_mb']:>16.0f}",
              flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
