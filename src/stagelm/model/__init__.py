"""The decoder (Llama-style, Flax NNX), its LoRA adapters, its folder on disk and what it costs in memory."""
