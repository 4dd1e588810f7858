"""The conversion's stages, each a function with a typed result, run in order by `convert()`:

    source.open_source     the source read layer by layer (resident: embeddings, final norm, LM head)
    target.resolve_target  what each layer becomes (KV heads, or MLA ranks and RoPE dims), checked before any work
    windows.calibrate      calibration windows (text, or the source's own samples)
    plan.plan_layers       first pass, when a decision needs every layer: sensitivity budgets, energy ranks,
                           stock RoPE frequencies
    ..pipeline.run_layers  second pass: per layer statistics, closed form, reconstruction, export, written
    heal.heal_whole        end-to-end healing (whole models)
"""
