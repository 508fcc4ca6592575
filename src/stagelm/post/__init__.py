"""Post-training on top of the loop: SFT (full or LoRA), distillation into a smaller student, GRPO."""
