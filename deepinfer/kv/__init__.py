"""The KV cache room: block pools per KV group, per-sequence block tables, sizing.

`manager.py` (KVCacheManager: admission, growth, sliding-window trim, free), `planner.py`
(how many blocks each group gets for a memory budget), `block_pool.py` (free lists).
Prefix caching, host / disk tiers and eviction policies land here.
"""
