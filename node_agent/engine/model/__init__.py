"""The model a rank runs: decoder, attention, MLP and MoE, LoRA layers, checkpoint reads."""
