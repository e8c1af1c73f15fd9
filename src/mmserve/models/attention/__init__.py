"""Attention, one backend per way of computing it (`--attention-backend`).

- `backend.py`: the interface (`AttentionBackend` and the per-call `StepAttention` /
  `SegmentAttention` the models call) and the selection.
- `torch_sdpa.py`: the torch backend, PyTorch's SDPA (the CPU default).
- `triton_backend.py`: the triton backend (the CUDA default) over our kernels,
  `decode_kernel.py` (split-KV decode), `paged_kernel.py` (steps with prefill chunks),
  `cache_write_kernel.py` (the KV write, with the rotary fused), `varlen_kernel.py` (the towers'
  segments) and `layer_kernels.py` (the small ops between a layer's GEMMs), sharing
  `online_softmax.py` and `tuning.py`; only it imports `triton`.
"""
