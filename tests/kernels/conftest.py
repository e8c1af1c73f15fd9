"""Sets Triton's interpreter up (tests/triton_device.py) before any test module here is imported."""

from __future__ import annotations

import triton_device  # noqa: F401
