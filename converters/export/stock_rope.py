"""The stock DeepSeek-V3 RoPE of an export: which source frequencies its pairs keep (one stride s) and the
theta' that turns stock pair j at source pair j*s (deepseek_export.py says why this is exact)."""

from __future__ import annotations

import math

import torch

from ...models.architectures import AttentionShape


def stock_frequencies(ranked_per_layer: list[list], half: int, n: int) -> tuple[list[int], int]:
    """(frequencies 0, s, ..., (n-1)s; s) maximizing the summed score of each layer's best component per frequency.

    ranked_per_layer: every layer's (score, RopeComponent) list, best first (methods.ranked_components)."""
    scores = torch.zeros(half, dtype=torch.float64)
    for ranked in ranked_per_layer:
        best = {}
        for score, comp in ranked:
            best.setdefault(comp.freq, score)  # ranked best first
        scores += torch.tensor([best.get(i, 0.0) for i in range(half)], dtype=torch.float64)
    strides = range(1, (half - 1) // (n - 1) + 1) if n > 1 else [1]
    best = max(strides, key=lambda s: float(scores[[j * s for j in range(n)]].sum()))
    return [j * best for j in range(n)], best


def stock_rope_theta(config, frequencies: list[int], n_out: int) -> tuple[float, dict]:
    """(theta', report) with theta'^(-2j/(2 n_out)) = the source's inverse frequency of pair frequencies[j].

    Plain RoPE: exact (theta' = theta^(s d_r / d_rot)). llama3 scaling: exact when every kept frequency is in the
    unchanged band, else theta' fits the kept log inverse frequencies by least squares; the report says which."""
    params = config.rope_parameters or {}
    theta, rope_type = params["rope_theta"], params.get("rope_type", "default")
    shape = AttentionShape.of(config)
    d_rot = shape.rotary_dim
    stride = frequencies[1] - frequencies[0] if len(frequencies) > 1 else 1
    exact_theta = theta ** (stride * 2 * n_out / d_rot)
    if rope_type == "default":
        return exact_theta, {"rope_type": "default", "exact": True}
    inv = torch.tensor(shape.frequencies, dtype=torch.float64)  # as the model computes them (fp32 for scaled types)
    plain = 1.0 / (theta ** (torch.arange(0, d_rot, 2, dtype=torch.float64) / d_rot))
    kept = torch.tensor(frequencies)
    unchanged = torch.isclose(inv[kept], plain[kept], rtol=1e-6, atol=0).all().item()  # transformers: fp32
    j = torch.arange(len(frequencies), dtype=torch.float64)
    if unchanged:
        fitted = exact_theta
    else:  # log inv_j = -(2j / d_r) log theta': least squares through the origin over j >= 1
        x, y = 2 * j[1:] / (2 * n_out), -torch.log(inv[kept][1:])
        fitted = math.exp(float((x @ y) / (x @ x))) if len(x) else exact_theta
    got = fitted ** (-2 * j / (2 * n_out))
    err = float(((got - inv[kept]).abs() / inv[kept]).max())
    return fitted, {
        "rope_type": rope_type,
        "exact": bool(unchanged),
        "max_relative_frequency_error": err,
        "why": "every kept frequency lies in the band the scaling leaves unchanged"
        if unchanged
        else "kept frequencies in the scaled band: theta' fitted to their log inverse frequencies",
    }
