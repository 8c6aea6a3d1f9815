"""The KV cache: the paged block pool and its prefix cache (block_pool, kv_cache_manager), how many
blocks fit (capacity), KV quantization (kv_quant), the shared block store (kv_offload), block I/O
between engines (kv_transfer) and P/D hand-offs (kv_handoff, kv_handoff_link, handoff_handles).
Its events reach the KV index through common/kv_publisher.py."""
