"""An embedding request's answer from the hidden state P1 sent back: vLLM's LAST pooling (the
prompt's last token, after the decoder's final norm), L2-normalized unless asked not to be, as
vLLM's default pooler for decoder models gives it (`normalize`: x / max(||x||, 1e-12), in float32)."""

from __future__ import annotations

import numpy as np

from mmserve.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput

EPS = 1e-12  # torch.nn.functional.normalize's floor on the norm


def pool(hidden: bytes, normalize: bool) -> np.ndarray:
    """The float32 vector of `hidden` (float32 bytes), L2-normalized with `normalize`."""
    vector = np.frombuffer(hidden, dtype=np.float32)
    if not normalize:
        return vector.copy()
    norm = np.float32(np.sqrt(np.dot(vector.astype(np.float64), vector.astype(np.float64))))
    return vector / max(norm, np.float32(EPS))


def embedding_output(last: RequestOutput | None, normalize: bool) -> EmbeddingRequestOutput:
    """An embedding request's `EmbeddingRequestOutput` from its last `RequestOutput`."""
    if last is None or last.hidden is None:
        raise RuntimeError(f"the engine sent no hidden state for embedding request "
                           f"{None if last is None else last.request_id}")
    return EmbeddingRequestOutput(last.request_id, list(last.prompt_token_ids),
                                  EmbeddingOutput(pool(last.hidden, normalize).tolist()), True, last.num_cached_tokens)
