"""Grammar-constrained decoding (JSON Schema, regex, Lark/GBNF) as logits processors for generate()."""
