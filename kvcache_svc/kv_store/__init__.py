"""kvcache_svc's KV store: computed KV kept in chunks, served to any replica.

`tier` is the interface a storage level implements (and the chunk it holds); `memory_tier` and
`disk_tier` are the two levels there are; `store` layers them behind `KvStore`, the one
interface callers use (lookup, save, load, stats); `server` is its ZMQ edge; `config` its flags.
Chunk keys, headers and messages are wire types (`services.kv_store_wire`); chunking and
checks are in `services.kv_chunks`; the client is `services.kv_store_client`.
"""
