"""The BlockManager process: the KV cache's bookkeeping
(`python -m actorserve.actors.block_manager.block_manager`).

Inbox: AllocateStep, FreeBlocks, Reset, StatsQuery from the Scheduler.
Owns: the BlockPool (block_pool.py: free list with LRU order, ref counts, block tables, the prefix
cache keyed by runtime/block_hash.py's chained hashes, swap space); the Worker owns the memory.
Outbox: KV events (kv_events.py) on its PUB socket, for the gateways that route on them.
"""
