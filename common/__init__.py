"""kvharbor.common: shared contracts of kvharbor, a Kubernetes-operated, multi-tenant LLM inference platform.

`kvharbor.common` holds the contracts every part shares (block hashing, KV events, the load report,
Redis key names, the OpenAI and Responses wire APIs, model families) and the plumbing they share
(configuration, logs, tracing, the tokenizer, the Redis client). It imports none of the parts:
`kvharbor.engine`, `kvharbor.gateway`, `kvharbor.kvcache_service` and `kvharbor.operator` live in
their own top-level folders.
"""

__version__ = "0.1.0"
