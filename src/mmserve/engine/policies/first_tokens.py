"""First tokens of greedy prompts (`--enable-first-token-caching`, over last-block caching).

A greedy request with no logits processing (penalties, `logit_bias`, `min_tokens`, a grammar)
samples the argmax of its last prompt position's logits: a function of the prompt alone. Once such
a prompt has been computed, its first token is kept under the key of the prompt's last block,
which chains every token, item hash and the salt of the prompt (`block_hash.py`).

A later identical prompt whose prefix-cache hits reach that last block already has the KV of every
prompt token (its full blocks, and the last block the runner copies), so with its first token
kept too it needs no forward at all: the scheduler admits it with its whole prompt computed and
that token appended (the runner learns both from its `NewRequestData`, as for a request resumed
after preemption) and answers the token after the step. That request must be plain greedy too,
ask for no log probabilities (they need the logits) and be a single completion (`n` = 1).

The token is the one the first prompt's own forward sampled, so a hit answers exactly what that
computation answered. The scheduler asks `FirstTokenAnswers` at each admission (`token_for`), tells
it what each step sampled (`learn`), and hands out or takes back the step's answers (`drain`,
`take_back`). Entries are kept LRU, at most `capacity` (a few bytes each); a stale one costs
nothing, since a hit also needs the last block to be cached.

An embedding request (`Request.return_hidden`, greedy and one token) is answered the same way,
with the hidden state its prompt's computation sent back: an entry keeps it when an embedding
request computed the prompt (LRU within `HIDDEN_BYTES`; the token stays when it goes), and an
embedding request takes an entry only with it. So an identical prompt embedded again costs no
forward and gets the very vector the first one got. `/metrics` reports the layer as
`first_token`: lookups (a request that could take a token, and whose hits reached a cached last
block), hits, evictions and entries.
"""

from __future__ import annotations

from collections import OrderedDict

from mmserve.engine.block_hash import BlockHash
from mmserve.engine.request import Request
from mmserve.ipc.messages import CacheStats
from mmserve.sampling_params import SamplingParams

HIDDEN_BYTES = 64 << 20  # the embeddings' hidden states kept (a 7B's: 14 KiB each, ~4,700)


def plain_greedy(params: SamplingParams) -> bool:
    """Whether a request's token is the argmax of its raw logits."""
    return params.greedy and not params.needs_logits_processing


class FirstTokenCache:
    """Prompt last-block key -> the first token a plain greedy request sampled after it.

    `put` adds or refreshes an entry (evicting the least recently used past `capacity`); `get`
    answers a waiting request's cached first token, refreshing the entry; both count (`stats`), and
    `get` records its lookup in the request's own counts (`Request.count_cache`)."""

    def __init__(self, capacity: int, enabled: bool = True) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1; got {capacity}")
        self.capacity = capacity
        self.enabled = enabled
        self._tokens: OrderedDict[BlockHash, int] = OrderedDict()
        self._hidden: OrderedDict[BlockHash, bytes] = OrderedDict()  # keys of `_tokens` an embedding computed
        self._hidden_bytes = 0
        self.num_queries = 0  # lookups, since start
        self.num_hits = 0  # of which found a token
        self.num_evictions = 0

    def get(self, req: Request) -> int | None:
        """`req`'s first token, if it can take one: it has no output yet, is plain greedy, asks
        for no log probabilities, is one completion, and an identical prompt left its token (and,
        for an embedding request, its hidden state: `hidden`)."""
        params = req.sampling_params
        if not self.enabled or req.num_output_tokens or not plain_greedy(params) or params.logprobs is not None \
                or params.n != 1:
            return None
        key = req.last_block_hash(req.num_prompt_tokens)
        if key is None:
            return None
        self.num_queries += 1
        token = self._tokens.get(key)
        if token is not None and req.return_hidden and key not in self._hidden:
            token = None
        if token is not None:
            self._tokens.move_to_end(key)
            if key in self._hidden:
                self._hidden.move_to_end(key)
            self.num_hits += 1
        req.count_cache("first_token", int(token is not None), 1)
        return token

    def hidden(self, req: Request) -> bytes | None:
        """The hidden state kept with `req`'s prompt's token (an embedding computed it), or None."""
        key = req.last_block_hash(req.num_prompt_tokens)
        return None if key is None else self._hidden.get(key)

    def put(self, req: Request, token: int, hidden: bytes | None = None) -> None:
        """Keep `token` as the first token of `req`'s prompt, if `req` sampled it plain greedy,
        and the `hidden` state it was sampled from when an embedding request sent it back."""
        if not self.enabled or not plain_greedy(req.sampling_params):
            return
        key = req.last_block_hash(req.num_prompt_tokens)
        if key is None:
            return
        self._tokens[key] = token
        self._tokens.move_to_end(key)
        if hidden is not None and len(hidden) <= HIDDEN_BYTES:
            self._hidden_bytes += len(hidden) - len(self._hidden.pop(key, b""))
            self._hidden[key] = hidden
            while self._hidden_bytes > HIDDEN_BYTES:
                self._hidden_bytes -= len(self._hidden.popitem(last=False)[1])
        if len(self._tokens) > self.capacity:
            old, _ = self._tokens.popitem(last=False)
            self._hidden_bytes -= len(self._hidden.pop(old, b""))
            self.num_evictions += 1

    def __len__(self) -> int:
        return len(self._tokens)

    def clear(self) -> int:
        """Forget every kept token (`reset_prefix_cache`); the number forgotten."""
        count = len(self._tokens)
        self._tokens.clear()
        self._hidden.clear()
        self._hidden_bytes = 0
        return count

    def stats(self) -> CacheStats:
        return CacheStats(queries=self.num_queries, hits=self.num_hits, evictions=self.num_evictions,
                          entries=len(self._tokens))

    def check_integrity(self) -> None:
        assert len(self._tokens) <= self.capacity
        assert all(key in self._tokens for key in self._hidden), "a hidden state without its token"
        assert self._hidden_bytes == sum(map(len, self._hidden.values())) <= HIDDEN_BYTES


class FirstTokenAnswers:
    """The first-token policy over `cache`: which admissions are answered from it, and those of one step.

    An answered request is admitted with its prompt computed and its cached first token appended
    (`answer`); it is one of the step's requests though nothing of it is scheduled. Its output is
    sent after the step (`drain`), or its token is taken back when the step fails (`take_back`).
    Between steps no answered request is pending."""

    def __init__(self, cache: FirstTokenCache) -> None:
        self.cache = cache
        self._answered: list[Request] = []  # admitted this step with a cached first token

    def token_for(self, req: Request, reaches_last_block: bool) -> int | None:
        """The cached first token to answer waiting `req` with, when its prefix-cache hits
        reach an identical prompt's last block (`PrefixHit.last_block`); else None."""
        return self.cache.get(req) if reaches_last_block else None

    def answer(self, req: Request, token: int) -> None:
        """`req` was admitted with its whole prompt computed: append `token` as its first output
        (an embedding request takes the kept hidden state too)."""
        req.append_output_token_ids([token])
        req.answered_hidden = self.cache.hidden(req) if req.return_hidden else None
        self._answered.append(req)

    def learn(self, req: Request, tokens: list[int], hidden: bytes | None = None) -> None:
        """`req` sampled `tokens` (appended already): keep the first token of a prompt computed whole
        (a step scheduled since, --async-scheduling, counts a token still in flight), and the
        `hidden` state an embedding request sent back with it."""
        if req.num_output_tokens == 1 and req.num_computed_tokens - req.num_in_flight == req.num_prompt_tokens:
            self.cache.put(req, tokens[0], hidden)

    def drain(self) -> list[Request]:
        """The step's answered requests, whose token goes out after the step."""
        answered, self._answered = self._answered, []
        return answered

    def take_back(self) -> list[Request]:
        """The failed step's answered requests, their tokens taken back (they are recomputed)."""
        answered = self.drain()
        for req in answered:
            req.drop_last_token()
            req.answered_hidden = None
        return answered

    def check_integrity(self) -> None:
        self.cache.check_integrity()
        assert not self._answered, "an answered request's output was not sent"
