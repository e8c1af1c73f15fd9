"""The attention kernels' shared inner step: one key tile folded into a running softmax."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_tile(q, k, v, seen, m_i, l_i, acc, scale):
    """Fold one key/value tile into the running state (flash attention's online softmax).

    q: [M, D]; k, v: [N, D]; seen: [M, N] bool, True where the row's query sees the key;
    m_i (running max of scores), l_i (running sum of exp(score - m_i)): [M] float32;
    acc (running sum of probabilities x values): [M, D] float32. Returns the new (m_i, l_i, acc).
    A row must see some key of its first tile, or its max stays -inf and the exps are NaN."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [M, N]
    s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i * alpha + tl.sum(p, 1), acc
