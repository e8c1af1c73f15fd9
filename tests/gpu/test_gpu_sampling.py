"""On a CUDA GPU, the paths that only run there: a JSON grammar's masks applied to GPU logits
(xgrammar's Triton kernel), penalties, logit bias, min_tokens, allowed_token_ids, bad_words and
log probabilities give the float32 tokens the CPU engine gives; a 16-bit KV cache under a float32
model replays from CUDA graphs with the tokens it gives eagerly; seeded sampling gives the same
tokens again; prompt log probabilities equal the CPU's.
`make test-gpu`; skipped (instantly) where CUDA is absent."""

from __future__ import annotations

import json

import jsonschema
import pytest

from mmserve import LLM, SamplingParams
from mmserve.structured_outputs import StructuredOutputsParams
from helpers.gpu_cases import checkpoint, prompts

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_float32")]
DEVICE = "cuda"
CLICK = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer", "minimum": 0},
                                          "button": {"enum": ["left", "right"]}}, "required": ["x", "y", "button"]}


def sampler_rows() -> list[SamplingParams]:
    """One row per path of the sampler, all greedy: their tokens depend on the logits alone."""
    return [
        SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams.for_schema(CLICK)),
        SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3, frequency_penalty=0.4,
                       presence_penalty=0.2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=10, min_tokens=8, logit_bias={5: 2.0, 9: -50.0}, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(json_object=True)),
        SamplingParams(temperature=0.0, max_tokens=12),
        SamplingParams(temperature=0.0, max_tokens=12, allowed_token_ids=list(range(40, 400, 3)), ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, bad_words=["the", "a cat"], ignore_eos=True),
    ]


def run(llm: LLM, params: list[SamplingParams]) -> list:
    items = prompts("builtin:tiny-llava")
    items = [items[i % len(items)] for i in range(len(params))]  # a prompt per row, again from the first
    outs = llm.generate(items, params)
    core = llm.engine.core
    core.check_integrity()
    assert core.kv_cache.num_free_blocks == core.kv_cache.pool.num_blocks
    return [o.outputs[0] for o in outs]


def test_the_samplers_paths_on_the_gpu_equal_the_cpus(tmp_path):
    path = checkpoint("builtin:tiny-llava", tmp_path)
    cpu = LLM(model=path, device="cpu", dtype="float32")
    expected = run(cpu, sampler_rows())
    cpu.shutdown()
    gpu = LLM(model=path, device=DEVICE, dtype="float32", max_model_len=512)
    got = run(gpu, sampler_rows())
    assert gpu.engine.core.executor.runner.device.type == DEVICE
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    jsonschema.validate(json.loads(got[0].text), CLICK)
    assert isinstance(json.loads(got[3].text), dict)
    assert 9 not in got[2].token_ids and len(got[2].token_ids) >= 8
    for position, reference in zip(got[2].logprobs or [], expected[2].logprobs or [], strict=True):
        token = next(t for t, lp in position.items() if lp.rank == 1)  # greedy: the sampled token ranks first
        assert abs(position[token].logprob - reference[token].logprob) < 1e-4


@pytest.mark.parametrize("name, kv_cache_dtype", [("builtin:tiny-llava", "float16"), ("qwen3_vl", "bfloat16")])
def test_a_16_bit_kv_cache_replays_from_graphs_as_it_runs_eagerly(tmp_path, name, kv_cache_dtype):
    """A float32 model over a half-precision cache: the Triton kernels cast on store and on load,
    in the captured graphs as in eager steps."""
    path, items = checkpoint(name, tmp_path), prompts(name)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    runs = []
    for eager in (True, False):
        llm = LLM(model=path, device=DEVICE, dtype="float32", kv_cache_dtype=kv_cache_dtype, max_model_len=512,
                  enforce_eager=eager)
        runs.append([o.outputs[0].token_ids for o in llm.generate(items, greedy)])
        llm.engine.core.check_integrity()
        graphs = llm.engine.core.executor.runner.decode_graphs
        llm.shutdown()
    assert runs[1] == runs[0]
    assert graphs is not None and graphs.replays > 0


def test_seeded_sampling_gives_the_same_tokens_again(tmp_path):
    path = checkpoint("builtin:tiny-llava", tmp_path)
    seeded = [SamplingParams(temperature=1.0, top_p=0.9, seed=s, max_tokens=12, ignore_eos=True) for s in range(3)] + \
        [SamplingParams(temperature=0.8, top_k=20, min_p=0.05, seed=7, max_tokens=12, ignore_eos=True),
         SamplingParams(temperature=0.0, max_tokens=12)]
    llm = LLM(model=path, device=DEVICE, dtype="float32", max_model_len=512)
    first = [c.token_ids for c in run(llm, seeded)]
    again = [c.token_ids for c in run(llm, seeded)]  # through every cache this time
    assert again == first


def test_prompt_log_probabilities_on_the_gpu_equal_the_cpus(tmp_path):
    """`prompt_logprobs`: the prompt's hidden rows through the LM head on the GPU (async-scheduled)
    score each prompt token as the CPU engine does (float32, within 1e-4; the same top token)."""
    path, items = checkpoint("builtin:tiny-llava", tmp_path), prompts("builtin:tiny-llava")
    asking = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=3)
    cpu = LLM(model=path, device="cpu", dtype="float32")
    expected = cpu.generate(items, asking)
    cpu.shutdown()
    gpu = LLM(model=path, device=DEVICE, dtype="float32", max_model_len=512, async_scheduling=True)
    got = gpu.generate(items, asking)
    gpu.shutdown()
    for out, want in zip(got, expected, strict=True):
        assert out.prompt_token_ids == want.prompt_token_ids and out.outputs[0].token_ids == want.outputs[0].token_ids
        scored = zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True)
        for token, g, w in scored:
            assert abs(g[token].logprob - w[token].logprob) < 1e-4 and _top(g) == _top(w)


def _top(entry: dict) -> int:
    return min(entry, key=lambda t: entry[t].rank)
