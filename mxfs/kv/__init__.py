"""The KV spill tier: KV-cache chunks on the pool, shared, bounded and persistent.

`KVStore(mount, namespace)` puts and gets chunks; `keys` builds stable keys and
the chained token-chunk hashes of LMCache, SGLang and vLLM; `adapters` plugs the
store into those engines (imported only where the engine is installed).
"""

from mxfs.kv.kvstore import KVStore, key_bytes

__all__ = ["KVStore", "key_bytes"]
