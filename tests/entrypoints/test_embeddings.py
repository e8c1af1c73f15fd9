"""Embeddings offline (`LLM(runner="pooling").embed`): each prompt's last token's final-normed
hidden state, against transformers' (the LM head's input) on the same weights, with an image and
without; L2-normalized unless asked not to be. An identical prompt embedded again is answered by
the first-token cache with the same vector and no forward, whether its last token ends a block or
starts one; a prompt sharing the image but not the text reads the image's cached blocks and
agrees with a fresh computation to float32 rounding. The wrong runner or Matryoshka dimensions
are refused."""

from __future__ import annotations

import pytest
import torch

from helpers.hf_reference import hf_greedy, hf_qwen_greedy
from helpers.tiny_models import make_checkpoint, make_image, make_qwen_checkpoint
from mmserve import LLM, PoolingParams, SamplingParams

pytestmark = pytest.mark.slow  # runs transformers and the engine (deselect with -m 'not slow')

PADS = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE = make_image(0, (64, 48))
QWEN = [{"prompt": "<|im_start|>user\nhello there<|im_end|>\n"},  # 11 tokens: ends inside its block
        {"prompt": f"<|im_start|>user\n{PADS}What is this?<|im_end|>\n",  # 17: its last token starts a block
         "multi_modal_data": {"image": IMAGE}}]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> str:
    return make_qwen_checkpoint(tmp_path_factory.mktemp("qwen"), family="qwen2_5_vl", min_pixels=28 * 28 * 4,
                                max_pixels=32 * 32 * 16)


@pytest.fixture(scope="module")
def engine(qwen):
    with LLM(model=qwen, device="cpu", runner="pooling") as llm:
        yield llm


def _theirs(reference, path: str, items: list[dict]) -> list[torch.Tensor]:
    """transformers' final-normed hidden state of each prompt's last token (the LM head's input)."""
    seen: list[torch.Tensor] = []

    def prepare(model: torch.nn.Module) -> None:
        model.get_output_embeddings().register_forward_hook(lambda _m, args, _o: seen.append(args[0][0, -1].clone()))
    reference(path, items, 1, prepare=prepare)
    return seen


def _vector(out) -> torch.Tensor:
    return torch.tensor(out.outputs.embedding)


def test_an_embedding_is_the_last_tokens_hidden_state_as_transformers_computes_it(engine, qwen):
    raw = engine.embed(QWEN, PoolingParams(normalize=False))
    unit = engine.embed(QWEN)  # answered from the first-token cache: the same vectors, normalized
    for mine, normed, theirs in zip(raw, unit, _theirs(hf_qwen_greedy, qwen, QWEN)):
        torch.testing.assert_close(_vector(mine), theirs.float(), rtol=1e-5, atol=2e-5)
        torch.testing.assert_close(_vector(normed), torch.nn.functional.normalize(theirs.float(), dim=-1),
                                   rtol=1e-5, atol=1e-6)
        assert len(mine.outputs.embedding) == 128 and mine.prompt_token_ids == normed.prompt_token_ids
    engine.engine.core.check_integrity()


def test_llava_text_prompts_too(tmp_path):
    path = make_checkpoint(tmp_path / "llava")
    items = [{"prompt": "USER: hello there ASSISTANT:"}, {"prompt": "USER: a longer question about the sea"}]
    with LLM(model=path, device="cpu", runner="pooling", pooler_config={"normalize": False}) as llm:
        outs = llm.embed(items)
    for mine, theirs in zip(outs, _theirs(hf_greedy, path, items)):
        torch.testing.assert_close(_vector(mine), theirs.float(), rtol=1e-5, atol=2e-5)


def test_an_identical_prompt_is_answered_with_the_same_vector_and_no_forward(engine):
    engine.reset_prefix_cache()
    first = engine.embed(QWEN)
    cache = engine.engine.core.scheduler.first_tokens
    hits, queries = cache.num_hits, cache.num_queries
    again = engine.embed(QWEN)
    assert [a.outputs.embedding == b.outputs.embedding for a, b in zip(first, again)] == [True, True]
    assert [o.num_cached_tokens for o in again] == [len(o.prompt_token_ids) for o in again]  # nothing computed
    assert (cache.num_hits - hits, cache.num_queries - queries) == (2, 2)
    core = engine.engine.core
    core.check_integrity()
    assert core.kv_cache.num_free_blocks == core.kv_cache.pool.num_blocks


def test_a_prompt_sharing_only_the_image_reads_its_blocks_and_agrees_with_a_fresh_one(engine, qwen):
    common = f"<|im_start|>user\n{PADS}Look at this picture carefully and then tell me"
    engine.embed([{"prompt": common + " what it shows<|im_end|>\n", "multi_modal_data": {"image": IMAGE}}])
    other = [{"prompt": common + " where it was taken<|im_end|>\n", "multi_modal_data": {"image": IMAGE}}]
    shared = engine.embed(other, PoolingParams(normalize=False))[0]
    assert shared.num_cached_tokens >= 16
    with LLM(model=qwen, device="cpu", runner="pooling", enable_prefix_caching=False) as fresh:
        alone = fresh.embed(other, PoolingParams(normalize=False))[0]
    assert alone.num_cached_tokens == 0
    torch.testing.assert_close(_vector(shared), _vector(alone), rtol=1e-5, atol=2e-5)


def test_each_runner_refuses_the_others_calls(engine, qwen):
    params = SamplingParams(max_tokens=4, temperature=0.0)
    with pytest.raises(ValueError, match="LLM.embed"):
        engine.generate(QWEN, params)
    with LLM(model=qwen, device="cpu") as text:
        with pytest.raises(ValueError, match="runner='pooling'"):
            text.embed(QWEN)
        assert all(len(o.outputs[0].token_ids) == 4 for o in text.generate(QWEN, params))


def test_what_is_not_supported_is_refused():
    with pytest.raises(ValueError, match="Matryoshka"):
        PoolingParams(dimensions=64)
    from mmserve.config import EngineConfig

    with pytest.raises(ValueError, match="pooling_type 'MEAN'"):
        EngineConfig.from_kwargs(runner="pooling", pooler_config={"pooling_type": "MEAN"})
    with pytest.raises(ValueError, match="runner must be one of"):
        EngineConfig.from_kwargs(runner="embed")


def test_two_tensor_parallel_ranks_give_the_vectors_one_does(engine, qwen):
    """Rank 0 sends the hidden state back (the decoder's output is whole on every rank after its
    all-reduce); equal to one rank's up to the reductions' order, and a repeat exactly."""
    one = engine.embed(QWEN)
    with LLM(model=qwen, device="cpu", runner="pooling", tensor_parallel_size=2) as llm:
        two, again = llm.embed(QWEN), llm.embed(QWEN)
    for a, b, c in zip(one, two, again):
        torch.testing.assert_close(_vector(b), _vector(a), rtol=1e-5, atol=1e-6)
        assert b.outputs.embedding == c.outputs.embedding
