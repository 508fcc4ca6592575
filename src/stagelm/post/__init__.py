"""Post-training on top of the loop: distillation and GRPO."""
