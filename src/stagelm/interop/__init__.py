"""Checkpoints from elsewhere and to elsewhere: transformers folders and GGUF files in, both out."""
