"""Drafters built from a target model alone, for speculative decoding (`hf-attn draft MODEL OUT`)."""

from .build import build_drafter

__all__ = ["build_drafter"]
