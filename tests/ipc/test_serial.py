"""The wire codec: every message type round-trips; tensors keep dtype, shape, values, and
travel out of band without copies; nothing is pickled."""

from __future__ import annotations

import pathlib
import re
import warnings
from typing import Any

import msgspec
import pytest
import torch

import mmserve
import mmserve.ipc.launcher_messages as launcher_messages
import mmserve.ipc.messages as messages
import mmserve.ipc.worker_messages as worker_messages
from mmserve.ipc.items import ShmHandle
from mmserve.ipc.launcher_messages import (CoordinatorInput, DecisionsAsk, RankStats, ResponseAnswer, ResponseGet,
                                           ResponsePut, RouteAnswer, RouteAsk, RouteLanded, RouteSent, StoreAnswer,
                                           StoreDiscard, StoreDropUnused, StoreFinish, StoreInput, StoreLookup,
                                           StoreReserve, StoreSeal, StoreStatsAsk)
from mmserve.ipc.messages import (AbortRequests, CachesReset, CacheStats, EngineCoreEvent, EngineCoreFailed,
                                  EngineCoreInput, EngineCoreOutput, EngineCoreOutputs, EngineCoreReady,
                                  EngineCoreRequest, ResetCaches, SchedulerStats, TokenLogprobs)
from mmserve.ipc.worker_messages import (CachedRequestData, ExecuteModel, InitializeKVCache, ModelRunnerOutput,
                                         NewRequestData, SchedulerOutput, ShmBroadcastInfo, ShutdownWorker, WorkerDone,
                                         WorkerEvent, WorkerFailed, WorkerInput, WorkerReady, WorkerStepOutput)
from mmserve.ipc.serial import MsgpackDecoder, MsgpackEncoder
from mmserve.ipc.items import MultiModalItem, PlaceholderRange
from mmserve.sampling_params import SamplingParams
from mmserve.structured_outputs import StructuredOutputsParams

SRC = pathlib.Path(mmserve.__file__).parent


def item(mm_hash: str = "img0", **data: torch.Tensor) -> MultiModalItem:
    data = data or {"pixel_values": torch.randn(3, 336, 336)}
    return MultiModalItem("image", mm_hash, data, PlaceholderRange(5, 576))


def samples() -> list[Any]:
    """One instance of every Struct in messages.py, worker_messages.py and launcher_messages.py (nested ones
    inside their parent)."""
    params = SamplingParams(temperature=0.0, max_tokens=7, stop=["x"], stop_token_ids=[2], seed=3, n=2, logprobs=3,
                            logit_bias={5: -1.5}, structured_outputs=StructuredOutputsParams(json_object=True))
    stats = SchedulerStats(1, 2, 3, 4, 5, {"prefix": CacheStats(10, 4, 1, 0, 3, 0)})
    return [
        EngineCoreRequest("r0", [1, 2, 3], [item("a"), item("b", pixel_values=torch.rand(3, 42, 42))],
                          params, 2, 12.5),
        EngineCoreRequest("r1", [4], [], SamplingParams(), None, 0.0),
        AbortRequests(["r0", "r1"]),
        EngineCoreReady(4096, 1000),
        EngineCoreFailed("no weights"),
        EngineCoreOutputs([EngineCoreOutput("r0", [5, 6], "stop", 2), EngineCoreOutput("r1", [], "abort", None, "bad")],
                          stats),
        EngineCoreOutputs([]),
        SchedulerOutput([NewRequestData("r0", [1, 2], [item()], params, [0, 1], 0)],
                        [CachedRequestData("r1", [7], 30)], {"r0": 2, "r1": 1}, {"r0": [0]}, ["img9"], ["r2"]),
        ModelRunnerOutput({"r0": [9], "r1": []}),
        # P1 executor <-> tensor-parallel workers: inputs [9:12], events [12:16]
        InitializeKVCache(64),
        ExecuteModel(SchedulerOutput([NewRequestData("r0", [1], [item()], params, [0], 0)], [], {"r0": 1}, {}, [], [])),
        ShutdownWorker(),
        WorkerReady(1, 4096),
        WorkerDone(1),
        WorkerStepOutput(0, ModelRunnerOutput({"r0": [9]})),
        WorkerFailed(1, "boom"),
        ShmBroadcastInfo("mmserve_1_" + "0" * 32, 4, 1 << 22, 2, ["ipc:///tmp/x/broadcast-0.sock"]),
        ModelRunnerOutput({"r0": [9]}, {"r0": [TokenLogprobs(9, -0.5, 1, [9, 4], [-0.5, -1.25])]}),
        # engine cores and API servers -> the data-parallel coordinator [18:23], and its answer
        RankStats(1, stats),
        RouteAsk(EngineCoreRequest("r2", [1], [], SamplingParams(), None, 0.0, client_index=1), [0, 1], 1),
        RouteSent("r2"),
        RouteLanded(0),
        DecisionsAsk("d1"),
        RouteAnswer("r2", 1, "pinned", {"pinned": 1}),
        # API servers -> the node's item store [24:30], and its answers
        StoreLookup(1, "k", "r0", peek=True),
        StoreReserve(2, "k", 4096, "r0"),
        StoreSeal(4, "k", ok=False),
        StoreDiscard(["k", "j"]),
        StoreFinish("r0"),
        StoreStatsAsk(3),
        StoreAnswer(2, ShmHandle("k", 128, 7, 4096, bytes(16)), fresh=True),
        StoreAnswer(3, stats=[1, 2, 3]),
        ResponsePut(5, "scope:resp_1", b'[{"role":"user"}]'),
        ResponseGet(6, "scope:resp_1"),
        ResponseAnswer(6, b"[]"),
        ResponseAnswer(7, error="KeyError: x"),
        # cache resets [36:40]: P0 -> P1 and its answer (with an output's P1 times), the node store's
        ResetCaches(3, prefix=True, encoder=False, mm=True, ipc_epoch=2, client_index=1),
        EngineCoreOutputs([EngineCoreOutput("r0", [5], timestamp=2.5, queued_at=1.0, scheduled_at=1.5)], None, {},
                          [CachesReset(3, 96, 2, 1)], reset_items=True),
        StoreDropUnused(8),
        StoreAnswer(8, dropped=5),
    ]


def nested_types(obj: Any) -> set[type]:
    if isinstance(obj, msgspec.Struct):
        return {type(obj)}.union(*(nested_types(getattr(obj, f)) for f in obj.__struct_fields__))
    if isinstance(obj, (list, tuple)):
        return set().union(*(nested_types(x) for x in obj))
    if isinstance(obj, dict):
        return set().union(*(nested_types(x) for x in obj.values()))
    return set()


def assert_same(a: Any, b: Any) -> None:
    """Deep equality where tensors must match in dtype, shape and values."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        assert torch.equal(a, b)
    elif isinstance(a, msgspec.Struct):
        for f in a.__struct_fields__:
            assert_same(getattr(a, f), getattr(b, f))
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert a == b


def round_trip(obj: Any, type: Any = Any, readonly: bool = False) -> Any:
    frames = MsgpackEncoder().encode(obj)
    if readonly:
        frames = [bytes(f) for f in frames]
    else:
        frames = [bytearray(f) for f in frames]  # what zmq hands over: writable frames
    return MsgpackDecoder(type).decode(frames)


def test_samples_cover_every_message_type():
    defined = {v for module in (messages, worker_messages, launcher_messages) for v in vars(module).values()
               if isinstance(v, type) and issubclass(v, msgspec.Struct) and v.__module__ == module.__name__}
    assert defined <= nested_types(samples()), "add a sample of the new message type above"


@pytest.mark.parametrize("index", range(len(samples())))
def test_every_message_round_trips(index):
    obj = samples()[index]
    assert_same(round_trip(obj, type(obj)), obj)


def test_tagged_unions_pick_the_right_type():
    for obj in samples()[:3]:
        assert_same(round_trip(obj, EngineCoreInput), obj)
    for obj in samples()[3:7]:
        assert_same(round_trip(obj, EngineCoreEvent), obj)
    for obj in samples()[9:12]:
        assert_same(round_trip(obj, WorkerInput), obj)
    for obj in samples()[12:16]:
        assert_same(round_trip(obj, WorkerEvent), obj)
    for obj in samples()[18:23]:
        assert_same(round_trip(obj, CoordinatorInput), obj)
    for obj in samples()[24:30]:
        assert_same(round_trip(obj, StoreInput), obj)
    reset, answer, drop = samples()[36:39]
    assert_same(round_trip(reset, EngineCoreInput), reset)
    assert_same(round_trip(answer, EngineCoreEvent), answer)
    assert_same(round_trip(drop, StoreInput), drop)


TENSORS = {
    "float32_image": torch.randn(3, 336, 336),
    "bfloat16": torch.randn(4, 100).to(torch.bfloat16),
    "float16": torch.randn(300).half(),
    "int64": torch.arange(100),
    "bool": torch.rand(500) > 0.5,
    "uint8": torch.randint(0, 255, (3, 4, 50), dtype=torch.uint8),
    "zero_dim": torch.tensor(3.25),
    "zero_dim_bf16": torch.tensor(-1.5, dtype=torch.bfloat16),
    "empty": torch.empty(0, 3),
    "empty_big_dims": torch.empty(1024, 0, dtype=torch.int32),
    "transposed": torch.randn(64, 32).t(),
    "sliced": torch.randn(10, 100)[:, ::3],
    "expanded": torch.randn(1, 100).expand(50, 100),
    "tiny_inline": torch.tensor([1, 2, 3], dtype=torch.int16),
}


@pytest.mark.parametrize("name", TENSORS)
@pytest.mark.parametrize("readonly", [False, True])
def test_tensors_round_trip_inside_dict_any(name, readonly):
    tensor = TENSORS[name]
    obj = item(**{"x": tensor, "y": tensor})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's "buffer is not writable" warning
        out = round_trip(obj, MultiModalItem, readonly=readonly)
    assert_same(out, obj)
    assert out.data["x"].is_contiguous()
    out.data["x"].zero_()  # writable, and not shared with the sender or the other copy
    assert torch.equal(out.data["y"], tensor)


def test_big_tensors_are_out_of_band_and_small_ones_inline():
    big, small = torch.randn(3, 336, 336), torch.randn(4)
    frames = MsgpackEncoder().encode(item(pixel_values=big, extra=small))
    assert len(frames) == 2
    assert len(frames[0]) < 200  # header only
    assert memoryview(frames[1]).nbytes == big.numel() * 4
    frames = MsgpackEncoder(inline_threshold_bytes=1 << 30).encode(item(pixel_values=big))
    assert len(frames) == 1


def test_encode_and_decode_do_not_copy_big_tensors():
    big = torch.randn(3, 64, 64)
    frames = MsgpackEncoder().encode({"t": big})
    assert torch.frombuffer(frames[1], dtype=torch.uint8).data_ptr() == big.data_ptr()
    received = [bytearray(f) for f in frames]
    out = MsgpackDecoder().decode(received)["t"]
    assert out.data_ptr() == torch.frombuffer(received[1], dtype=torch.uint8).data_ptr()
    del received, frames
    assert torch.equal(out, big)  # the tensor keeps its frame alive


def test_typed_tensor_fields_and_plain_containers():
    class Holder(msgspec.Struct):
        t: torch.Tensor
        maybe: torch.Tensor | None = None

    obj = Holder(torch.randn(20, 20))
    assert_same(round_trip(obj, Holder), obj)
    assert_same(round_trip([{"a": [torch.ones(2)]}, (1, "x")]), [{"a": [torch.ones(2)]}, [1, "x"]])


def test_unsupported_values_are_type_errors_not_pickled():
    with pytest.raises(TypeError, match="cannot send"):
        MsgpackEncoder().encode({"x": object()})
    with pytest.raises(TypeError, match="cannot send"):
        MsgpackEncoder().encode({"x": torch.randn(4, 4).to_sparse()})


def test_corrupt_frames_are_clear_errors():
    frames = MsgpackEncoder().encode({"t": torch.randn(100)})
    with pytest.raises(ValueError, match="frame 1 missing"):
        MsgpackDecoder().decode(frames[:1])
    with pytest.raises(ValueError, match="needs 400 bytes"):
        MsgpackDecoder().decode([frames[0], bytearray(8)])
    with pytest.raises(ValueError, match="at least one frame"):
        MsgpackDecoder().decode([])


def test_no_pickle_on_the_wire():
    files = [*(SRC / "ipc").glob("*.py"), *(SRC / "item_store").glob("*.py"), *(SRC / "transport").glob("*.py"),
             SRC / "engine" / "core_proc.py", SRC / "frontend" / "engine_client" / "core_client.py"]
    imports = re.compile(r"^\s*(import|from)\s+[\w.]*(pickle|dill)", re.MULTILINE)
    for path in files:
        assert not imports.search(path.read_text()), f"{path} imports a pickler"
