"""Conversion methods, one module per family: GQA / MQA merges (gqa_merge, gqa_blocks), the MLA lift (mla_lift,
mla_plan), the exact re-expression (exact) and KV budgets by measured sensitivity (budgets)."""
