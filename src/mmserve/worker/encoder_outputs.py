"""The runner's encoder outputs (`EncoderOutputs`): items encoded once per `mm_hash`, kept on the
device until the scheduler frees their hash, and scattered into a step's token embeddings.

An output is shared by every request whose items have its hash. Rows are [F, D'] per item: the
embedding (D), and for deepstack models (Qwen3-VL) the deepstack features beside it
(D' = D * (1 + layers)). `CacheFault` (a debugging hook, tests of the cache verifier) may alter
the rows a step reads from the cache rather than from this step's encoding.
"""

from __future__ import annotations

from typing import Any

import torch

from mmserve.errors import RequestFault
from mmserve.ipc.items import MultiModalItem
from mmserve.worker.cache_fault import CacheFault
from mmserve.worker.device import item_on
from mmserve.worker.runner_state import RunnerRequest


class EncoderOutputs:
    """`outputs`: mm_hash -> [F, D'] on the model's device; `num_encoded_items` counts the items
    run through the vision encoder since start (tests, benchmarks). The model is the caller's,
    passed to each call (a runner that shuts down drops it: nothing here may keep it alive)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, fault: CacheFault | None) -> None:
        self.device = device
        self.dtype = dtype
        self.fault = fault
        self.outputs: dict[str, torch.Tensor] = {}
        self.num_encoded_items = 0
        self._encoded: set[str] = set()  # the hashes encoded this step (the rest are cache reads)

    def run(self, model: Any, requests: dict[str, RunnerRequest], scheduled: dict[str, list[int]]) -> None:
        """Encode the scheduled items (request id -> its item indices), once per `mm_hash`; an item
        whose output does not fill its placeholders fails its request (`RequestFault`)."""
        keyed = {item.mm_hash: item for rid, idxs in scheduled.items()
                 for item in (requests[rid].mm_items[idx] for idx in idxs)}
        self._encoded = set(keyed)
        if not keyed:
            return
        datas = [_data(item, self.device) for item in keyed.values()]
        features = model.encode_items(datas, self.dtype)  # each [F, D'], on the device
        for (key, item), feats in zip(keyed.items(), features):
            if feats.shape[0] != item.placeholder.length:  # the request's item is at fault, not the engine
                owner = next(rid for rid, idxs in scheduled.items() if any(
                    requests[rid].mm_items[i].mm_hash == key for i in idxs))
                raise RequestFault(owner, ValueError(f"image gives {feats.shape[0]} embeddings for "
                                                     f"{item.placeholder.length} placeholders"))
            self.outputs[key] = feats
        self.num_encoded_items += len(keyed)

    def embed(self, model: Any, requests: dict[str, RunnerRequest], req_ids: list[str], num_sched: dict[str, int],
              input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token embeddings [T, D] of the step (`req_ids` in order, `num_sched` tokens each from
        its `num_computed_tokens`), image placeholders overwritten by encoder outputs, and for
        deepstack models the features added after the first decoder layers [layers, T, D] (zero on
        text tokens; None when the step has no image token)."""
        embeds = model.embed_tokens(input_ids)
        D, layers = embeds.shape[-1], model.num_deepstack
        deepstack = None
        offset = 0
        for rid in req_ids:
            state, n = requests[rid], num_sched[rid]
            start = state.num_computed_tokens
            for item in state.mm_items:
                ph = item.placeholder
                lo, hi = max(start, ph.offset), min(start + n, ph.end)
                if lo < hi:
                    feats = self.outputs[item.mm_hash][lo - ph.offset: hi - ph.offset]  # [n, D']
                    if self.fault is not None and item.mm_hash not in self._encoded:
                        feats = self.fault.on_encoder_hit(feats)
                    rows = slice(offset + lo - start, offset + hi - start)
                    embeds[rows] = feats[:, :D]
                    if layers:
                        if deepstack is None:
                            deepstack = embeds.new_zeros(layers, embeds.shape[0], D)
                        deepstack[:, rows] = feats[:, D:].view(-1, layers, D).transpose(0, 1)
            offset += n
        return embeds, deepstack


def _data(item: MultiModalItem, device: torch.device) -> dict[str, torch.Tensor]:
    """An item's processed tensors (P1 holds every scheduled item's data: IPC cache or shm), its
    pixels on `device` (`item_on`)."""
    assert item.data is not None, f"item {item.mm_hash} reached the runner without its data"
    return item_on(item.data, device)
