"""`--kv-cache-dtype`: the element type of the paged KV cache (vLLM's flag name).

`auto` keeps the model's dtype (outputs unchanged). `float16` / `bfloat16` allocate the cache in
that type: each step's K/V, computed in the model's dtype, are rounded to it as they are written,
and attention reads them widened back to the compute dtype (float32 sums on the CPU). Half the
bytes of a float32 model's cache: more blocks in the same memory, and a memory-bound decode step
reads less. Not exact, as vLLM's `fp8` is not: the cached K/V are rounded. vLLM's 8-bit values
(`fp8`, `fp8_e4m3`, ...) have no kernels here and are refused at start, with every other name.
The names only (no torch): the config checks them in P0; `worker/device.py` resolves them.
"""

from __future__ import annotations

KV_CACHE_DTYPES = ("auto", "float16", "bfloat16")
_VLLM_FP8 = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")


def check_kv_cache_dtype(name: str) -> None:
    """ValueError, in one line naming what is supported, for a name other than KV_CACHE_DTYPES'."""
    if name in KV_CACHE_DTYPES:
        return
    supported = ", ".join(KV_CACHE_DTYPES)
    if name in _VLLM_FP8:
        raise ValueError(f"kv_cache_dtype {name} (an 8-bit KV cache) is not supported; use one of {supported}")
    raise ValueError(f"kv_cache_dtype must be one of {supported}; got {name!r}")
