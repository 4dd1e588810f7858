"""Speculative (assisted) decoding in generate() for any batch size, with exact rejection sampling."""
