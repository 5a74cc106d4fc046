"""Tensor parallelism: rank processes, their group and collectives, and which shard each holds."""
