"""Worker service: one model shard, the KV tensors of its layers, and the persistent input batch."""
