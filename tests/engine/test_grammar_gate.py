"""Grammars compile off the engine step: a structured request waits in the gate while the others
step, a grammar past --max-grammar-compile-s refuses its request (a client error), and the step
itself never compiles."""

from __future__ import annotations

import threading
import time

import pytest

from mmserve import LLM, SamplingParams
from mmserve.ipc.messages import EngineCoreRequest
from mmserve.structured_outputs import StructuredOutputsParams

SCHEMA = StructuredOutputsParams.for_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                             "required": ["a"]})


def request(rid: str, structured: bool, max_tokens: int = 6) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                            structured_outputs=SCHEMA if structured else None)
    return EngineCoreRequest(rid, [1, 2, 3, 4], [], params, None, 0.0)


@pytest.fixture
def slow_compiles(path):
    """An engine whose grammar compiles take 0.5 s each (as a large schema's would), recording the
    threads they ran in."""
    llm = LLM(model=path, num_kv_blocks=64, max_grammar_compile_s=0.3)
    grammars = llm.engine.core.executor.runner.grammars
    grammars._get_compiler(None)  # the tokenizer's part, built once per runner, is not what is timed
    real, threads = grammars._compile, []

    def compile_slowly(compiler, spec):
        threads.append(threading.current_thread().name)
        time.sleep(0.5)
        return real(compiler, spec)

    grammars._compile = compile_slowly
    return llm, threads


def run(core, limit_s: float = 20.0) -> dict[str, list]:
    outputs: dict[str, list] = {}
    deadline = time.monotonic() + limit_s
    while core.has_unfinished_requests() and time.monotonic() < deadline:
        for out in core.step().outputs:
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def test_a_grammar_past_the_budget_refuses_its_request_and_others_step_meanwhile(slow_compiles):
    llm, threads = slow_compiles
    core = llm.engine.core
    core.add_request(request("schema", True))
    core.add_request(request("plain", False, max_tokens=3))
    started = time.monotonic()
    outputs = run(core)
    last = outputs["schema"][-1]
    assert last.finish_reason == "abort" and last.error_kind == "client"
    assert "--max-grammar-compile-s" in (last.error or "")
    assert sum(len(o.new_token_ids) for o in outputs["plain"]) == 3
    assert time.monotonic() - started < 5
    assert threads and all(name.startswith("grammar-compile") for name in threads)
    core.check_integrity()


def test_a_compiled_grammar_is_used_and_the_step_never_compiles(path):
    llm = LLM(model=path, num_kv_blocks=64)
    core = llm.engine.core
    grammars = core.executor.runner.grammars
    real, threads = grammars._compile, []

    def recording(compiler, spec):
        threads.append(threading.current_thread().name)
        return real(compiler, spec)

    grammars._compile = recording
    core.add_request(request("a", True, max_tokens=20))
    outputs = run(core)
    text = llm.engine.tokenizer.decode([t for o in outputs["a"] for t in o.new_token_ids])
    assert text.startswith('{"a":') and outputs["a"][-1].error is None
    assert threads and all(name.startswith("grammar-compile") for name in threads)
    core.add_request(request("b", True, max_tokens=4))  # cached now: no wait, no compile
    assert not core.grammar_gate.holds("b") and len(threads) == 1
    run(core)
