"""Measurements with a real model: TTFT and throughput with KV reused through the pool.

This layer sits above `kv` (and beside `load`): it builds a transformers causal LM from
a config (`lm`), runs it in instance processes (`instance`) that look up, get and put
KV chunks through `KVStore` (`tier`), and drives them (`reuse`: one instance's prefix
got by another started cold; `serving`: K instances under concurrent load).  `report`
writes what they measured, with the TTFT model's prediction beside it.  `cli` wraps
it as `mxfs bench ttft` and `mxfs bench gates`.  torch and transformers are imported
only here and in the instance processes.
"""
