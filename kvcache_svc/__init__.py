"""kvcache_svc: paged-KV block bookkeeping for every replica, served over ZMQ + gRPC admin.

`block_pool` holds the blocks, their ref counts, the LRU of free blocks and the prefix-hash
index (recording its changes when asked); `block_manager` applies one replica's batched
per-step plan on top of a pool and answers prefix queries; `server` runs the plan loop (ZMQ),
the admin API (gRPC) and stamps replies with the instance epoch; `events` publishes each
operation's prefix-index changes (ZMQ PUB); `__main__` parses the config and wires them.
"""
