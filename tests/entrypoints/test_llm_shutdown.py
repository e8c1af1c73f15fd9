"""An `LLM` gives its memory back: `shutdown()`, the end of a `with` block (an exception included)
and collection each free the runner's weights and KV cache (watched through weak references to
the tensors and modules); the LLM refuses work after; two LLMs run one after another in one process."""

from __future__ import annotations

import gc
import weakref

import pytest

from mmserve import LLM, SamplingParams
from helpers.tiny_models import make_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
ARGS = dict(device="cpu", kv_cache_memory_gb=0.01)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("shutdown"))


def held(llm: LLM) -> list[weakref.ref]:
    """Weak references to what the LLM's runner holds: a KV tensor, the model, a weight."""
    runner = llm.engine.core.executor.runner
    model = runner.model
    return [weakref.ref(runner.kv_caches[0][0]), weakref.ref(model), weakref.ref(next(model.parameters()))]


def test_shutdown_frees_the_weights_and_kv_cache_and_refuses_work_after(path):
    llm = LLM(model=path, **ARGS)
    runner = llm.engine.core.executor.runner
    refs = held(llm)
    assert llm.generate("hello", GREEDY)[0].outputs[0].token_ids
    llm.shutdown()
    assert all(ref() is None for ref in refs)  # the LLM and its runner are still referenced here
    assert not hasattr(runner, "model") and runner.kv_caches == []
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate("hello", GREEDY)
    llm.shutdown()  # idempotent


def test_two_llms_one_after_another_both_work(path):
    with LLM(model=path, **ARGS) as first:
        a = first.generate("hello", GREEDY)[0].outputs[0].token_ids
        refs = held(first)
    assert all(ref() is None for ref in refs)
    with LLM(model=path, **ARGS) as second:
        assert second.generate("hello", GREEDY)[0].outputs[0].token_ids == a


def test_an_exception_leaving_the_with_block_frees_it_though_its_traceback_lives(path):
    def failing() -> None:
        with LLM(model=path, **ARGS) as llm:
            refs.extend(held(llm))
            raise KeyError("the caller's fault")

    refs: list[weakref.ref] = []
    with pytest.raises(KeyError) as info:
        failing()
    assert info.value is not None  # the traceback, and with it the frame holding the LLM, is kept here
    assert all(ref() is None for ref in refs)


def test_collection_frees_it(path):
    llm = LLM(model=path, **ARGS)
    runner = llm.engine.core.executor.runner  # kept: only the LLM's finalizer can free what it holds
    refs = held(llm)
    del llm
    gc.collect()
    assert all(ref() is None for ref in refs)
    assert runner.kv_caches == []
