"""The conversion's stages, each a function with a typed result, run in order by `convert()`:

source.open_source        Source: the checkpoint read layer by layer (resident: embeddings, final norm, LM head)
target.resolve_target     Target: what each layer becomes (KV heads, or MLA ranks and RoPE dims), checked first
windows.calibrate         Calibration: the windows (text, or the source's own samples: whole or offloaded)
plan.plan_layers          Plan: a first pass when a decision needs every layer (sensitivity, energy, RoPE stride)
layers.convert_layers     LayersResult: per layer statistics, closed form, reconstruction, export, written
heal.heal_whole           Healed: end-to-end healing on whole models (heal_steps > 0)
write.OutputWriter        the output folder, staged and renamed when complete
report.build_report       conversion_report.json from the results above, with each stage's seconds and memory
"""
