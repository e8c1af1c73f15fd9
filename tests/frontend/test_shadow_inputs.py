"""P0's half of a shadow request (the cache verifier's re-run): its items are processed again from
their sources and cross whole, reading and writing neither the processor cache nor the IPC sender;
a normal request's report counts both layers."""

from __future__ import annotations

import pytest

from helpers.mm_prompts import one
from mmserve.cache_report import CacheReport
from mmserve.config import EngineConfig
from mmserve.frontend.input_processor import InputProcessor
from mmserve.transport.item_transport import ItemTransport
from mmserve.transport.undo import UndoLog
from mmserve.sampling_params import SamplingParams
from helpers.tiny_models import make_checkpoint

PARAMS = SamplingParams(temperature=0, max_tokens=2)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("shadow_inputs"))


@pytest.fixture(scope="module")
def pipeline(path):
    config = EngineConfig.from_kwargs(model=path)
    return InputProcessor(config, path, 256, None), ItemTransport(config)


def send(pipeline, rid: str, shadow: bool = False):
    inputs, transport = pipeline
    report = CacheReport()
    pending: list = []
    request = inputs.process(rid, one(3), PARAMS, pending, bypass_caches=shadow, report=report)
    message, _ = transport.to_wire(request, UndoLog(), report=report)
    inputs.accept(pending)
    return message, report


def test_a_shadow_processes_again_and_keeps_nothing(pipeline):
    inputs, transport = pipeline
    _, cold = send(pipeline, "cold")
    _, warm = send(pipeline, "warm")
    assert cold.counts == {"processor": (0, 1), "ipc": (0, 1)}
    assert warm.counts == {"processor": (1, 1), "ipc": (1, 1)}
    processed, lookups = inputs.items.num_processed, inputs.processor_cache.stats()
    sent = transport.sender.stats()
    message, report = send(pipeline, "shadow", shadow=True)
    assert inputs.items.num_processed == processed + 1  # from the source again
    assert message.bypass_caches and all(item.data is not None for item in message.mm_items)  # whole
    assert message.mm_items[0].mm_hash == report.item_hashes[0] == cold.item_hashes[0]
    assert report.counts == {}  # no layer was asked
    assert inputs.processor_cache.stats() == lookups and transport.sender.stats() == sent


def test_the_shm_transport_reports_its_layer_and_a_shadow_skips_it(path):
    config = EngineConfig.from_kwargs(model=path, mm_cache_type="shm", mm_shm_cache_gb=0.05)
    transport = ItemTransport(config)
    try:
        pipeline = (InputProcessor(config, path, 256, None), transport)
        _, cold = send(pipeline, "cold")
        _, warm = send(pipeline, "warm")
        assert cold.counts == {"processor": (0, 1), "shm": (0, 1)} and warm.counts == {"processor": (1, 1),
                                                                                         "shm": (1, 1)}
        written = transport.stats()["shm"]
        message, report = send(pipeline, "shadow", shadow=True)
        assert all(item.shm_handle is None and item.data is not None for item in message.mm_items)
        assert transport.stats()["shm"] == written and report.counts == {}
    finally:
        for rid in ("cold", "warm", "shadow"):
            transport.finish(rid)
        transport.close()
