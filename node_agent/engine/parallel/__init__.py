"""Parallel layout: tp/dp/ep topology, the sharding rule, and torch.distributed set-up."""
