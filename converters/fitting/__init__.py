"""Fitting a converted model to its source: layer-wise reconstruction (reconstruct) and end-to-end healing (heal,
with FSDP in heal_fsdp and fp32 master weights in heal_masters)."""
