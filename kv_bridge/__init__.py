"""The KV bridge (issue 25, #40): a vLLM pod's KV events as kvharbor's, so the KV index, the KV
cache service and the gateway's prefix routing work over vLLM engines unchanged.

`vllm_events.py` decodes vLLM's ZMQ batches (every envelope and event shape vLLM has sent);
`translate.py` recomputes kvharbor block hashes from their token ids (vLLM's own hashes depend on
its hash algorithm and PYTHONHASHSEED, so they are only keys to resolve removals); `sequencer.py`
keeps the stream whole across gaps, replays and restarts; `bridge.py` ties them together, and
`service.py` is the `kvharbor kv-bridge` process that subscribes over ZMQ and publishes through
common/kv_events.py (`config.py`: its options)."""
