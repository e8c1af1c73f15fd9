"""The encoder cache's bookkeeping (P1): which items' encoder outputs the model runner holds.

The tensors live in the runner (`worker/encoder_outputs.py: EncoderOutputs`, keyed by `mm_hash`); this file
decides which hashes are resident, who uses them and which go when space is short. Sizes are
embedding tokens: an item's placeholder length (one embedding row per placeholder token).
`mm_hash` is salted (model, processor settings, the request's `cache_salt`), so sharing an
output by hash never crosses tenants.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Protocol, Sequence

SHADOW_HASH_PREFIX = "shadow/"  # a shadow request's private item hashes (`request.shadow_items`)

if TYPE_CHECKING:
    from mmserve.ipc.items import MultiModalItem


class EncoderRequest(Protocol):
    """What the manager reads of a request: its id and its items (hash, placeholder range)."""

    @property
    def request_id(self) -> str: ...

    @property
    def mm_items(self) -> Sequence[MultiModalItem]: ...


class EncoderCacheManager:
    """Resident encoder outputs keyed by `mm_hash`, each with the requests that use it.

    - `check_and_update(req, i)`: True when item i's output is resident; the request then
      references it (an unused entry is restored from the freeable queue). Counts a query and a hit.
    - `can_allocate(req, i, budget, pending)`: True when item i can be encoded this step: it fits
      the step's remaining compute `budget` and the cache can hold it on top of `pending` tokens
      the caller is about to allocate. May evict freeable entries, oldest first, to make room
      (even if the caller then does not allocate: evicted entries were unused).
    - `allocate(req, i)`: item i's output becomes resident, referenced by the request. Counts a query.
    - `free_encoder_input(req, i)` / `free(req)`: drop the request's reference(s); an entry no
      request references becomes freeable — it stays resident (reusable) until space is needed,
      or is dropped at once when `keep_unused` is False (`--encoder-cache-tokens 0`) or its hash
      is a shadow request's (`request.SHADOW_HASH_PREFIX`: never reused, never counted in the stats).
    - `reset()`: drops every unused entry; the entries in use are dropped once unused (`doomed`).
    - `get_freed_hashes()`: hashes dropped since the last call, for the runner to delete; a hash
      allocated again before the call is not reported (the runner overwrites it when it encodes).

    A request references an output through each of its item indices that use it, so the same
    item twice in one request stays referenced until both are consumed.

    Invariants (`check_integrity`): a hash is resident iff it has a user set; the freeable queue
    holds exactly the resident hashes without users, in the order they lost their last user;
    `num_free_tokens = cache_size - resident tokens >= 0`;
    `num_reclaimable_tokens = num_free_tokens + freeable tokens`; reported hashes are not resident.
    """

    def __init__(self, cache_size: int, keep_unused: bool = True) -> None:
        self.cache_size = cache_size  # embedding tokens
        self.keep_unused = keep_unused
        self.num_free_tokens = cache_size  # not held by any resident entry
        self.num_reclaimable_tokens = cache_size  # free, plus held by freeable entries
        self._tokens: dict[str, int] = {}  # resident mm_hash -> embedding tokens
        self._users: dict[str, set[str]] = {}  # resident mm_hash -> ids of the requests referencing it
        self._held: dict[str, dict[int, str]] = {}  # request id -> {item index: mm_hash} it references
        self._freeable: OrderedDict[str, int] = OrderedDict()  # unused resident mm_hash -> tokens, oldest first
        self._freed: list[str] = []  # dropped since the last get_freed_hashes
        self._doomed: set[str] = set()  # in use at a reset: dropped once unused, not kept
        self.num_queries = 0  # lookups decided since start: hits in check_and_update, misses in allocate
        self.num_hits = 0
        self.num_evictions = 0  # freeable entries dropped to make room

    # ---- queries ----------------------------------------------------------------------------

    def contains(self, mm_hash: str) -> bool:
        """True when the output of `mm_hash` is resident (in use or freeable)."""
        return mm_hash in self._tokens

    def held_items(self, request_id: str) -> dict[int, str]:
        """Item index -> mm_hash of the outputs the request references (do not mutate)."""
        return self._held.get(request_id, {})

    @property
    def num_resident_items(self) -> int:
        return len(self._tokens)

    @property
    def num_resident_tokens(self) -> int:
        return self.cache_size - self.num_free_tokens

    # ---- the verbs --------------------------------------------------------------------------

    def check_and_update(self, request: EncoderRequest, idx: int) -> bool:
        """True (and the request references the output) when item `idx`'s output is resident."""
        mm_hash = request.mm_items[idx].mm_hash
        if mm_hash not in self._tokens:
            return False
        self._reference(request.request_id, idx, mm_hash)
        self.num_queries += 1
        self.num_hits += 1
        return True

    def can_allocate(self, request: EncoderRequest, idx: int, compute_budget: int, num_pending_tokens: int) -> bool:
        """True when item `idx` fits `compute_budget` and, with `num_pending_tokens` more, the
        cache; evicts the oldest freeable entries as needed (mutates only then)."""
        num_tokens = request.mm_items[idx].placeholder.length
        if num_tokens > compute_budget:
            return False
        needed = num_tokens + num_pending_tokens
        if needed > self.num_reclaimable_tokens:
            return False
        while needed > self.num_free_tokens:
            mm_hash, _ = self._freeable.popitem(last=False)
            self._drop(mm_hash)
            self.num_evictions += 1
        return True

    def allocate(self, request: EncoderRequest, idx: int) -> None:
        """Make item `idx`'s output resident, referenced by the request (the caller checked
        `can_allocate` and schedules the encoder for it this step)."""
        item = request.mm_items[idx]
        assert item.mm_hash not in self._tokens, "allocate of a resident output: use check_and_update"
        assert item.placeholder.length <= self.num_free_tokens, "allocate without can_allocate"
        self._tokens[item.mm_hash] = item.placeholder.length
        self._users[item.mm_hash] = set()
        self.num_free_tokens -= item.placeholder.length
        self.num_reclaimable_tokens -= item.placeholder.length
        if item.mm_hash in self._freed:  # dropped and back within one step: the runner keeps it
            self._freed.remove(item.mm_hash)
        self._reference(request.request_id, idx, item.mm_hash)
        if not item.mm_hash.startswith(SHADOW_HASH_PREFIX):
            self.num_queries += 1

    def free_encoder_input(self, request: EncoderRequest, idx: int) -> None:
        """Drop the request's reference through item `idx` (no-op if it holds none)."""
        held = self._held.get(request.request_id)
        if held is None or idx not in held:
            return
        mm_hash = held.pop(idx)
        if mm_hash in held.values():
            return  # another item of the request still uses the same output
        if not held:
            del self._held[request.request_id]
        users = self._users[mm_hash]
        users.discard(request.request_id)
        if not users:
            self._freeable[mm_hash] = self._tokens[mm_hash]
            self.num_reclaimable_tokens += self._tokens[mm_hash]
            if not self.keep_unused or mm_hash.startswith(SHADOW_HASH_PREFIX) or mm_hash in self._doomed:
                del self._freeable[mm_hash]
                self._drop(mm_hash)

    def free(self, request: EncoderRequest) -> None:
        """Drop every reference the request holds (it finished, was aborted or preempted)."""
        for idx in list(self._held.get(request.request_id, ())):
            self.free_encoder_input(request, idx)

    def reset(self) -> int:
        """Drop every unused output (`reset_encoder_cache`); outputs a request references stay
        for it, and are dropped as soon as no request does. The number dropped now."""
        unused = list(self._freeable)
        for mm_hash in unused:
            del self._freeable[mm_hash]  # its tokens were reclaimable, and are free now
            self._drop(mm_hash)
        self._doomed.update(self._tokens)
        return len(unused)

    def get_freed_hashes(self) -> list[str]:
        """The hashes dropped since the last call (the runner deletes them); resets the list."""
        freed, self._freed = self._freed, []
        return freed

    # ---- internals --------------------------------------------------------------------------

    def _reference(self, request_id: str, idx: int, mm_hash: str) -> None:
        if mm_hash in self._freeable:  # unused until now: restored
            self.num_reclaimable_tokens -= self._freeable.pop(mm_hash)
        self._users[mm_hash].add(request_id)
        self._held.setdefault(request_id, {})[idx] = mm_hash

    def _drop(self, mm_hash: str) -> None:
        """Forget a resident entry without users (its tokens become free) and report it."""
        tokens = self._tokens.pop(mm_hash)
        del self._users[mm_hash]
        self._doomed.discard(mm_hash)
        self.num_free_tokens += tokens
        self._freed.append(mm_hash)

    def check_integrity(self) -> None:
        assert set(self._users) == set(self._tokens), "resident hashes and user sets disagree"
        expected: dict[str, set[str]] = {h: set() for h in self._tokens}
        for rid, held in self._held.items():
            assert held, f"{rid} holds an empty reference map"
            for mm_hash in held.values():
                assert mm_hash in expected, f"{rid} references {mm_hash}, which is not resident"
                expected[mm_hash].add(rid)
        assert expected == self._users, "user sets disagree with the requests' references"
        unused = [h for h, users in self._users.items() if not users]
        assert sorted(unused) == sorted(self._freeable), "the freeable queue is not the set of unused entries"
        assert all(self._freeable[h] == self._tokens[h] for h in self._freeable)
        assert self.keep_unused or not self._freeable, "an unused entry kept with keep_unused False"
        assert not any(h.startswith(SHADOW_HASH_PREFIX) for h in self._freeable), "a shadow output kept unused"
        assert self.num_free_tokens == self.cache_size - sum(self._tokens.values()) >= 0, "free tokens drifted"
        assert self.num_reclaimable_tokens == self.num_free_tokens + sum(self._freeable.values())
        assert not set(self._freed) & set(self._tokens), "a reported hash is resident"
        assert all(self._users.get(h) for h in self._doomed), "an output doomed at a reset is unused or gone"

