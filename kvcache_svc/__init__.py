"""kvcache_svc: paged-KV block bookkeeping for every replica, served over ZMQ + gRPC admin.

`block_pool` holds the blocks, their ref counts, the LRU of free blocks and the prefix-hash
index; `block_manager` applies one replica's batched per-step plan on top of a pool; `server`
runs the plan loop (ZMQ) and the admin API (gRPC); `__main__` parses the config and wires them.
"""
