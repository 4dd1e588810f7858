"""Checkpoint conversion (installed as hf_attn_patch.converters): MHA/GQA -> GQA, MQA, MLA, latent K/V.

The target table loads first: ConvertOptions checks each target's options through it (converters/targets/)."""

from . import targets  # noqa: F401
