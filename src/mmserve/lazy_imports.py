"""Heavy imports that a process does not need stay out of it.

An API server (P0) never runs a kernel, yet Triton reached it at start-up: transformers'
`processing_utils` imports `modeling_utils`, whose fp8 integration touches `torch._dynamo`, whose
import asks `torch.utils._triton.has_triton_package()` — which imports Triton to answer. Triton's
nanobind extension then printed ~60 lines of `nanobind: leaked ...` at every clean exit.
`keep_triton_out` answers torch's probe "absent" (it is cached for the process) before any of
that runs; Triton itself stays importable for whoever imports it by name. xgrammar (P0's schema
check, the runner's grammars) is imported by the first request that asks for a structure.
"""

from __future__ import annotations

import sys


def keep_triton_out() -> None:
    """Make torch's cached Triton probe answer False in this process, without importing Triton.

    Call it in a process that runs no kernel (an API server), before transformers is imported;
    a no-op where Triton is loaded already."""
    if "triton" in sys.modules:
        return
    from torch.utils._triton import has_triton_package

    if has_triton_package.cache_info().currsize:  # type: ignore[attr-defined]
        return  # asked before: the answer is already cached
    sys.modules["triton"] = None  # type: ignore[assignment]  # `import triton` raises ImportError
    try:
        has_triton_package()
    finally:
        del sys.modules["triton"]
