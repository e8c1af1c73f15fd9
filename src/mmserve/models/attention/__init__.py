"""Attention, one backend per way of computing it (`--attention-backend`).

- `backend.py`: the interface (`AttentionBackend` and the per-call `StepAttention` /
  `SegmentAttention` the models call) and the selection.
- `torch_sdpa.py`: the torch backend, PyTorch's SDPA (the CPU default).
- `triton_backend.py`: the triton backend (the CUDA default) over our kernels,
  `paged_kernel.py`, `cache_write_kernel.py` and `varlen_kernel.py`; only it imports `triton`.
"""
