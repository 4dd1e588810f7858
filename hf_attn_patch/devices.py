"""Where a model runs: device and dtype names as users give them, resolved once, with errors that name the value.

resolve_device("auto")                  # cuda:LOCAL_RANK if a CUDA GPU exists, else cpu
resolve_dtype("auto", model, device)    # the checkpoint's dtype; fp32 checkpoints run in bf16 on a GPU
"""

from __future__ import annotations

import os

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str, field: str = "device") -> torch.device:
    """The device of `device` ("auto": a CUDA GPU if there is one, else the CPU; under torchrun / accelerate launch
    each process takes the GPU of its LOCAL_RANK); raises, naming the value, for a name torch does not know or a
    device this machine lacks."""
    if device == "auto":
        return torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"{field}={device!r} is not a torch device ('auto', 'cpu', 'cuda', 'cuda:1', ...)") from err
    if resolved.type == "cuda" and (
        not torch.cuda.is_available() or (resolved.index or 0) >= torch.cuda.device_count()
    ):
        raise ValueError(f"{field}={device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"{field}={device!r}: only 'cpu' and 'cuda' devices are supported")
    return resolved


def resolve_dtype(dtype: str, checkpoint_dtype: torch.dtype, device: torch.device, field: str = "dtype") -> torch.dtype:
    """`dtype` by name, or "auto": the checkpoint's dtype, except that a float32 checkpoint runs in bfloat16 on a GPU
    (float16 where bf16 is unsupported) and a half-precision one runs in float32 on the CPU, where half matmuls are
    slow."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"{field}={dtype!r} is not one of {('auto',) + tuple(DTYPES)}")
        return DTYPES[dtype]
    if device.type == "cuda":
        if checkpoint_dtype != torch.float32:
            return checkpoint_dtype
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32
