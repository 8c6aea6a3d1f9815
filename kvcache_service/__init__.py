"""kvharbor KV cache service: the prefix index and shared block store (see kvcache_service/README.md)."""
