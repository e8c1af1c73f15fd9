"""Cache resets in P1: vLLM's `reset_prefix_cache` and `reset_encoder_cache` (and the engine's half of
`reset_mm_cache`), applied between two steps.

What a reset drops, and what it keeps (the whole contract; P0's half is `frontend/cache_resets.py`):
- prefix: every KV block's keys — full blocks, prompts' last blocks, the partial-block index — and
  the first-token cache. A block a running request owns keeps its contents for that request, which
  goes on and registers only the blocks it completes after the reset. KV events: one
  `AllBlocksCleared`.
- encoder: every output no request references, at once; an output in use stays for its requests
  (and for a request admitted meanwhile that asks for the same item) and is dropped as soon as none
  references it, instead of being kept for reuse.
- mm (the IPC receiver of the asking API server): emptied, in the epoch P0's sender starts with it.

Nothing is lost that a request in flight needs: a reset never preempts, never moves a block and
never changes a computed value, so every output is the one the request would have had without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmserve.ipc.messages import CachesReset, ResetCaches

if TYPE_CHECKING:
    from mmserve.engine.scheduler import Scheduler


def reset_caches(scheduler: Scheduler, ask: ResetCaches) -> CachesReset:
    """Apply `ask`'s prefix and encoder resets to the scheduler's caches; what they dropped."""
    done = CachesReset(ask.call_id)
    if ask.prefix:
        done.prefix_blocks = scheduler.kv_cache.reset_prefix_cache()
        done.first_tokens = scheduler.first_tokens.clear()
    if ask.encoder:
        done.encoder_items = scheduler.encoder_cache.reset()
    return done
