"""Measuring a model, converted or not: perplexity and KL to a reference on held-out text (perplexity), retrieval
over long contexts (retrieval), and lm-evaluation-harness tasks (harness; the optional [eval] extra)."""
