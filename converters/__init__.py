"""Checkpoint conversion (installed as hf_attn_patch.converters): MHA/GQA -> GQA, MQA, MLA."""
