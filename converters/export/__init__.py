"""Exports in other architectures: an MLA conversion as a stock DeepSeek-V3 checkpoint (deepseek_export, its layers in
deepseek_layers, the stock RoPE in stock_rope, the constants in constants)."""
