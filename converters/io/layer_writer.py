"""Write a model's tensors into safetensors shards as they are produced, one layer at a time.

Tensors are added in the order they are produced (embeddings, layer 0, ..., layer L-1, final norm, LM head) and
grouped greedily into shards of at most `max_shard_size` bytes by save_pretrained's rule (a tensor larger than the limit
gets a shard of its own). save_pretrained walks the names in lexical order (layers.10 before layers.2), which a stream
cannot, so the shards hold other groupings, but the names, tensors, file metadata and index metadata are the same and
`from_pretrained` loads the same model. Each tensor's bytes go to disk as soon as it is added (into the shard's data
file; the safetensors header, which must come first, is prepended when the shard closes), so the writer holds no
tensor in memory whatever max_shard_size is.
Everything is written into a staging folder next to the output, renamed onto it at `finish()`: nothing half-written.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


# safetensors' dtype names (https://github.com/huggingface/safetensors, format: little-endian, row-major)
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}  # fmt: skip


class ShardFile:
    """One safetensors file written tensor by tensor: the data goes to `path`.data at once, the header at close().

    File layout: 8-byte little-endian header length, the JSON header ({name: {dtype, shape, data_offsets}},
    "__metadata__") padded with spaces to a multiple of 8, then the tensors' bytes in the order added."""

    def __init__(self, path: Path):
        self.path, self.data_path = path, path.with_name(path.name + ".data")
        self.data = open(self.data_path, "wb")
        self.header: dict[str, dict] = {}
        self.nbytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Append a contiguous CPU tensor's bytes (its dtype one of DTYPES)."""
        size = tensor.numel() * tensor.element_size()
        if size:
            self.data.write(tensor.reshape(-1).view(torch.uint8).numpy())
        self.header[name] = {
            "dtype": DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [self.nbytes, self.nbytes + size],
        }
        self.nbytes += size

    def close(self) -> list[str]:
        """Write `path` (header, then the data copied over by the kernel), remove the data file; returns the names."""
        self.data.close()
        header = json.dumps({"__metadata__": {"format": "pt"}, **self.header}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)
        with open(self.path, "wb") as out, open(self.data_path, "rb") as data:
            out.write(len(header).to_bytes(8, "little"))
            out.write(header)
            out.flush()
            _copy(data, out)
        self.data_path.unlink()
        return list(self.header)


def _copy(src, dst) -> None:
    """src's bytes appended to dst: os.sendfile (in the kernel, no buffer in this process) where there is one, else
    8 MB blocks."""
    size, offset = os.fstat(src.fileno()).st_size, 0
    try:
        while offset < size:
            sent = os.sendfile(dst.fileno(), src.fileno(), offset, size - offset)
            if sent == 0:
                break
            offset += sent
    except (AttributeError, OSError):
        src.seek(offset)
        dst.seek(0, os.SEEK_END)
        shutil.copyfileobj(src, dst, 8 * 2**20)


def parse_size(size: int | str) -> int:
    """Bytes of '5GB' / '500MB' / '20KB' (powers of 10, as huggingface_hub reads them) or an int."""
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"max_shard_size={size} must be positive")
        return size
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        return parse_size_to_int(size)
    except ValueError as err:
        raise ValueError(f"max_shard_size={size!r} is not a size like '5GB' ({err})") from err


class ShardedWriter:
    """Streams tensors into `out` as safetensors shards. Use as a context manager: an exception removes the staging.

    add(tensors): {full name: tensor}, in state-dict order; tensors are copied to the CPU, contiguous.
    finish(config=..., files=...): writes the last shard, renames the shards to model-0000k-of-0000n.safetensors (or
    model.safetensors when there is one), writes the index and the config, and renames the staging folder to `out`."""

    def __init__(
        self,
        out: str | os.PathLike,
        max_shard_size: int | str = "5GB",
        overwrite: bool = False,
        prefix: str | None = None,
    ):
        self.out = Path(out)
        self.max_bytes = parse_size(max_shard_size)
        if self.out.exists() and not overwrite:
            raise ValueError(f"out={str(self.out)!r} exists; pass overwrite=True to replace it")
        if self.out.exists() and not self.out.is_dir():
            raise ValueError(f"out={str(self.out)!r} exists and is not a folder")
        self.overwrite = overwrite
        self.out.parent.mkdir(parents=True, exist_ok=True)
        prefix = prefix or f".{self.out.name}.staging-"  # the staging folder's name prefix
        self.staging = Path(tempfile.mkdtemp(dir=self.out.parent, prefix=prefix))
        umask = os.umask(0)
        os.umask(umask)
        self.staging.chmod(0o777 & ~umask)  # mkdtemp's 0700 would otherwise become the output's mode
        self.shards: list[list[str]] = []  # names per written shard, in order
        self.current: ShardFile | None = None
        self.current_bytes = 0
        self.opened = 0  # shard files opened (their temporary names)
        self.total_bytes = 0
        self.total_numel = 0
        self.seen: set[str] = set()
        self.finished = False

    def __enter__(self) -> "ShardedWriter":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if not self.finished:  # an error, or finish() never called: nothing is left behind
            if exc_type is None:
                logger.warning("%s: closed without finish(), nothing written", self.out)
            self.abort()

    def _part(self, k: int) -> Path:
        return self.staging / f"shard-{k:05d}.part"

    def _open(self) -> ShardFile:
        self.opened += 1
        return ShardFile(self.staging / f"open-{self.opened:05d}.part")

    def _close(self, shard: ShardFile) -> None:
        """Close a shard and number it by completion (save_pretrained's order), as shard-0000k.part."""
        names = shard.close()
        os.replace(shard.path, self._part(len(self.shards)))
        self.shards.append(names)

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        """Add named tensors (e.g. one converted layer's, with 'model.layers.i.' names); full shards are written."""
        for name, tensor in tensors.items():
            if name in self.seen:
                raise ValueError(f"tensor {name!r} was already written")
            if tensor.dtype not in DTYPES:
                raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store")
            self.seen.add(name)
            t = tensor.detach().to("cpu").contiguous()
            size = t.numel() * t.element_size()
            self.total_bytes += size
            self.total_numel += t.numel()
            if size > self.max_bytes:  # its own shard, before the one being filled (as save_pretrained orders them)
                own = self._open()
                own.add(name, t)
                self._close(own)
                continue
            if self.current is not None and self.current_bytes + size > self.max_bytes:
                self.flush()
            if self.current is None:
                self.current = self._open()
            self.current.add(name, t)
            self.current_bytes += size

    def flush(self) -> None:
        """Write the shard being filled (if any)."""
        if self.current is not None:
            self._close(self.current)
        self.current, self.current_bytes = None, 0

    def finish(self, config=None, generation_config=None, files: dict[str, str] | None = None) -> Path:
        """Close the output: shards renamed, index written (if sharded), config(s) and extra text `files` written,
        the staging folder moved onto `out`. Returns `out`."""
        self.flush()
        if not self.shards:
            raise ValueError("no tensor was added: nothing to write")
        n = len(self.shards)
        names = [WEIGHTS] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
        for k, name in enumerate(names):
            os.replace(self._part(k), self.staging / name)
        if n > 1:
            weight_map = {t: names[k] for k, shard in enumerate(self.shards) for t in shard}
            index = {
                "metadata": {"total_parameters": self.total_numel, "total_size": self.total_bytes},
                "weight_map": weight_map,
            }
            (self.staging / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        if config is not None:
            config.save_pretrained(self.staging)
        if generation_config is not None:
            generation_config.save_pretrained(self.staging)
        for name, text in (files or {}).items():
            (self.staging / name).write_text(text, encoding="utf-8")
        if self.out.exists():  # overwrite: swap, then drop the old folder
            trash = Path(tempfile.mkdtemp(dir=self.out.parent, prefix=f".{self.out.name}.old-"))
            os.replace(self.out, trash / "old")
            os.replace(self.staging, self.out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(self.staging, self.out)
        self.finished = True
        logger.info("wrote %s: %d shard(s), %.1f MB", self.out, n, self.total_bytes / 2**20)
        return self.out

    def abort(self) -> None:
        """Remove the staging folder; `out` is left as it was."""
        if self.current is not None:
            self.current.data.close()
        shutil.rmtree(self.staging, ignore_errors=True)


def state_groups(model: torch.nn.Module):
    """A whole in-memory causal LM's tensors, one dict per decoder layer (the others one each), in its state-dict
    order; a tied LM head left out (as save_pretrained drops it)."""
    state = model.state_dict()
    tied = getattr(model.config, "tie_word_embeddings", False) and "lm_head.weight" in state
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        if tied and name == "lm_head.weight":
            continue
        parts = name.split(".")
        key = ".".join(parts[:3]) if parts[:2] == ["model", "layers"] else name  # one group per layer
        groups.setdefault(key, {})[name] = tensor
    yield from groups.values()
