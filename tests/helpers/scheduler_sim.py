"""Driving a `Scheduler` without a model: the runner is simulated; small prefix-cache setups."""

from __future__ import annotations

from mmserve.config import SchedulerConfig
from mmserve.engine.block_hash import BlockHasher
from mmserve.engine.policies.first_tokens import FirstTokenCache
from mmserve.engine.kv_cache import KVCacheManager
from mmserve.engine.request import Request
from mmserve.engine.scheduler import Scheduler
from mmserve.ipc.items import MultiModalItem, PlaceholderRange
from mmserve.ipc.messages import EngineCoreOutputs
from mmserve.ipc.worker_messages import ModelRunnerOutput, SchedulerOutput
from mmserve.sampling_params import SamplingParams

BS = 4  # block size of `make_scheduler`
IMG = 32000  # the placeholder token of `make_request`


def fake_step(s: Scheduler, token: int = 7) -> tuple[SchedulerOutput, EngineCoreOutputs]:
    """Schedule, then 'sample' `token` for every request whose known tokens are all computed."""
    so = s.schedule()
    sampled = {rid: ([token] if s.requests[rid].num_computed_tokens == s.requests[rid].num_tokens else [])
               for rid in so.num_scheduled_tokens}
    out = s.update_from_output(so, ModelRunnerOutput(sampled))
    s.check_integrity()
    return so, out


def admit(s: Scheduler, req: Request) -> SchedulerOutput:
    """Add `req` and run one step; that step's scheduler output."""
    s.add_request(req)
    so, _ = fake_step(s)
    return so


def make_scheduler(num_blocks=64, max_tokens=64, enable_caching=True, encoder_cache_tokens=None,
                   last_blocks=False, first_tokens=False, partial_blocks=False) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_tokens,
                                     encoder_cache_tokens=encoder_cache_tokens),
                     KVCacheManager(num_blocks, BS, enable_caching, last_blocks, partial_blocks), 256,
                     first_tokens=FirstTokenCache(num_blocks, enabled=first_tokens))


def make_request(rid, tokens, images=(), salt=None, max_tokens=3, **params) -> Request:
    """`images`: (mm_hash, offset, length); their placeholder tokens are set to IMG."""
    tokens = list(tokens)
    items = []
    for h, off, length in images:
        tokens[off:off + length] = [IMG] * length
        items.append(MultiModalItem("image", h, None, PlaceholderRange(off, length)))
    return Request(rid, tokens, items, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params), None, 0.0,
                   cache_salt=salt, block_hasher=BlockHasher(BS))


def run(s: Scheduler, *reqs: Request) -> None:
    for r in reqs:
        s.add_request(r)
    while s.num_unfinished_requests:
        fake_step(s)
