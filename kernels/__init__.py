"""Attention kernels (installed as hf_attn_patch.kernels). The GPU kernels and their pure-torch twins land with
the kernels issue; this package exists so the install layout (a root folder under the hf_attn_patch namespace,
never a top-level `kernels` that would shadow Hugging Face's package) is fixed and tested from the start."""
