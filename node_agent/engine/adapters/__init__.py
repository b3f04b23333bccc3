"""Adapters: the PEFT loader, verified adapter files, and the per-rank LoRA pool."""
