"""The prefix cache with a tiny model: repeated requests and second turns hit, and their greedy
tokens equal both the run without prefix caching and transformers; a repeated prompt copies the
first's last block (full or partial) and computes one token, or none when its first token is
cached; a different image with the same text
does not hit the image's blocks; preemption with the cache on stays exact.

Items get explicit `mm_hash` values here, so the tests do not depend on how P0 hashes images.
"""

from __future__ import annotations

import msgspec
import pytest
import torch
from transformers import LlavaForConditionalGeneration

from mmserve import LLM, SamplingParams
from mmserve.ipc.messages import EngineCoreRequest
from mmserve.ipc.pixel_codes import pixel_values
from mmserve.outputs import RequestOutput
from helpers.tiny_models import make_checkpoint, make_image

BS = 4
MAX_NEW = 8
PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("prefix_e2e"))


@pytest.fixture(scope="module")
def hf(path):
    return LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm_off(path):
    return LLM(model=path, block_size=BS, enable_prefix_caching=False)


def make_llm(path: str, **engine_args) -> LLM:
    return LLM(model=path, block_size=BS, **engine_args)


def request(llm: LLM, rid: str, image_seed: int, mm_hash: str, text: str = PROMPT,
            max_tokens: int = MAX_NEW) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompt = {"prompt": text, "multi_modal_data": {"image": make_image(image_seed)}}
    req = llm.engine.input_processor.process(rid, prompt, params)
    req.mm_items = [msgspec.structs.replace(item, mm_hash=mm_hash) for item in req.mm_items]
    return req


def extended(req: EngineCoreRequest, rid: str, more_ids: list[int]) -> EngineCoreRequest:
    """The same request (same items) with `more_ids` after its prompt: the next turn of a chat."""
    return msgspec.structs.replace(req, request_id=rid, prompt_token_ids=req.prompt_token_ids + more_ids)


def run(llm: LLM, *reqs: EngineCoreRequest) -> list[RequestOutput]:
    """Run already-processed requests together through the engine; outputs in order."""
    engine = llm.engine
    for r in reqs:
        engine.core.add_request(r)
        engine.output_processor.add_request(r, None)
    done: dict[str, RequestOutput] = {}
    while len(done) < len(reqs):
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    engine.core.check_integrity()
    assert engine.core.kv_cache.num_free_blocks == engine.core.kv_cache.pool.num_blocks
    return [done[r.request_id] for r in reqs]


def tokens(out: RequestOutput) -> list[int]:
    return out.outputs[0].token_ids


def hf_tokens(hf, req: EngineCoreRequest) -> list[int]:
    ids = torch.tensor([req.prompt_token_ids])
    pixels = torch.stack([pixel_values(item.data) for item in req.mm_items])
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels,
                          max_new_tokens=req.sampling_params.max_tokens, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def test_a_repeated_request_hits_its_image_blocks_and_stays_exact(path, hf, llm_off):
    llm = make_llm(path)
    first, second = run(llm, request(llm, "a1", 0, "img-0"))[0], run(llm, request(llm, "a2", 0, "img-0"))[0]
    req = request(llm_off, "ref", 0, "img-0")
    n, image_end = len(req.prompt_token_ids), req.mm_items[0].placeholder.end
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == n > image_end  # the image's blocks, the last block copied, the first token
    assert tokens(first) == tokens(second) == tokens(run(llm_off, req)[0]) == hf_tokens(hf, req)
    prefix = llm.engine.core.stats().caches["prefix"]
    assert (prefix.queries, prefix.hits) == (2 * n, second.num_cached_tokens) and prefix.entries > 0
    salted = msgspec.structs.replace(request(llm, "a3", 0, "img-0"), cache_salt="tenant-2")
    out = run(llm, salted)[0]
    assert out.num_cached_tokens == 0 and tokens(out) == tokens(first)  # another tenant: no hit


def test_a_second_turn_reuses_the_first_turns_prompt_and_output_blocks(path, hf, llm_off):
    llm = make_llm(path)
    turn1 = request(llm, "t1", 1, "img-1")
    out1 = run(llm, turn1)[0]
    more = llm.get_tokenizer()("USER: and then? ASSISTANT:", add_special_tokens=False)["input_ids"]
    turn2 = extended(turn1, "t2", tokens(out1) + more)
    out2 = run(llm, turn2)[0]
    computed1 = len(turn1.prompt_token_ids) + MAX_NEW - 1  # the last sampled token was never fed back
    assert out2.num_cached_tokens == computed1 // BS * BS > len(turn1.prompt_token_ids)
    ref = extended(request(llm_off, "t1-ref", 1, "img-1"), "t2-ref", tokens(out1) + more)
    assert tokens(out2) == tokens(run(llm_off, ref)[0]) == hf_tokens(hf, turn2)


def test_two_images_with_the_same_text_do_not_share_image_blocks(path, hf, llm_off):
    llm = make_llm(path)
    cat, dog = request(llm, "cat", 2, "img-cat"), request(llm, "dog", 3, "img-dog")
    assert cat.prompt_token_ids == dog.prompt_token_ids  # identical placeholder tokens
    out_cat, out_dog = run(llm, cat)[0], run(llm, dog)[0]
    image_start = dog.mm_items[0].placeholder.offset
    assert image_start % BS  # the image starts inside a block: its leading text is a partial block
    assert out_dog.num_cached_tokens == image_start  # the text before the image only, to the token
    assert tokens(out_dog) == tokens(run(llm_off, request(llm_off, "dog-ref", 3, "img-dog"))[0])
    assert tokens(out_dog) == hf_tokens(hf, dog) and tokens(out_dog) != tokens(out_cat)


def test_preemption_with_prefix_caching_stays_exact(path, hf, llm_off):
    seeds = [4, 5, 4, 6, 5]  # repeats: later requests hit earlier ones' blocks while others are preempted
    reqs_off = [request(llm_off, f"p{i}-ref", s, f"img-{s}") for i, s in enumerate(seeds)]
    n = len(reqs_off[0].prompt_token_ids)
    # three distinct prompts, two repeats that share all but their last block: every prompt fits
    # (8 + 8 + 1 + 8 + 1 blocks), but they cannot all grow while decoding
    blocks = 3 * -(-n // BS) + 4
    llm = make_llm(path, num_kv_blocks=blocks, max_model_len=n + MAX_NEW + 1)
    got = run(llm, *[request(llm, f"p{i}", s, f"img-{s}") for i, s in enumerate(seeds)])
    assert llm.engine.core.scheduler.num_preemptions > 0, "the test meant to force preemption"
    assert sum(o.num_cached_tokens for o in got) > 0
    expected = [tokens(o) for o in run(llm_off, *reqs_off)]
    assert [tokens(o) for o in got] == expected
    assert expected[:2] == [hf_tokens(hf, r) for r in reqs_off[:2]]
    assert llm.engine.core.stats().caches["prefix"].evictions > 0


def test_the_offline_api_reports_cached_tokens_and_off_reports_none(path, llm_off):
    llm = make_llm(path)
    text = "USER: " + "tell me about the quick brown fox " * 3 + "ASSISTANT:"
    params = SamplingParams(temperature=0.0, max_tokens=4)
    first, second = llm.generate([text], params)[0], llm.generate([text], params)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens > 0
    assert tokens(first) == tokens(second)
    again = llm_off.generate([text, text], params)
    assert [o.num_cached_tokens for o in again] == [0, 0] and tokens(again[1]) == tokens(first)
    prefix = llm_off.engine.core.stats().caches["prefix"]
    assert (prefix.hits, prefix.entries) == (0, 0)


@pytest.mark.parametrize("suffix", ["", " Be brief.", " Be brief, please, now.", " Tell me."])  # 4, 3, 2, 1 in it
def test_a_repeated_prompt_copies_the_last_block_and_computes_one_token(path, hf, llm_off, suffix):
    """Prompts ending at several offsets in their last block (full or partial): the repeat copies
    it, computes only the last token, and decodes exactly as the first (whose blocks it reads
    while the first still runs, and after it ended); without last (and partial) blocks it
    recomputes them."""
    text = PROMPT.replace(" ASSISTANT:", suffix + " ASSISTANT:")
    llm = make_llm(path, enable_first_token_caching=False)
    whole = make_llm(path, enable_last_block_caching=False, enable_partial_block_caching=False)
    req = request(llm_off, "ref", 7, "img-7", text)
    n = len(req.prompt_token_ids)
    expected = tokens(run(llm_off, req)[0])
    assert expected == hf_tokens(hf, req)
    first = run(llm, request(llm, "f", 7, "img-7", text))[0]
    again = run(llm, request(llm, "g", 7, "img-7", text), request(llm, "h", 7, "img-7", text))
    assert [o.num_cached_tokens for o in again] == [n - 1] * 2
    assert tokens(first) == tokens(again[0]) == tokens(again[1]) == expected
    outs = [run(whole, request(whole, rid, 7, "img-7", text))[0] for rid in ("w1", "w2")]
    assert outs[1].num_cached_tokens == (n - 1) // BS * BS and [tokens(o) for o in outs] == [expected] * 2


@pytest.mark.parametrize("suffix", ["", " Be brief, please, now."])  # 4 and 2 tokens in the last block
def test_a_repeated_greedy_prompt_takes_its_first_token_and_computes_none(path, hf, llm_off, suffix):
    """A repeat while the first still decodes and after it ended: every prompt token cached, the
    first token taken, then decoding exactly as the first and transformers; a repeat asking for log
    probabilities, or sampling, computes its last token."""
    text = PROMPT.replace(" ASSISTANT:", suffix + " ASSISTANT:")
    llm = make_llm(path)
    ref = request(llm_off, "ref", 7, "img-7", text)
    n, expected = len(ref.prompt_token_ids), hf_tokens(hf, ref)
    engine = llm.engine
    done: dict[str, RequestOutput] = {}
    for rid in ("f", "g"):  # the first's prompt, then the repeat while the first decodes
        req = request(llm, rid, 7, "img-7", text)
        engine.core.add_request(req)
        engine.output_processor.add_request(req, None)
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    while len(done) < 2:
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    during, after = done["g"], run(llm, request(llm, "h", 7, "img-7", text))[0]
    assert tokens(done["f"]) == expected
    assert [during.num_cached_tokens, after.num_cached_tokens] == [n, n]
    assert tokens(during) == tokens(after) == expected
    layer = engine.core.stats().caches["first_token"]
    assert (layer.queries, layer.hits, layer.entries) == (2, 2, 1)
    asking = msgspec.structs.replace(request(llm, "l", 7, "img-7", text), sampling_params=SamplingParams(
        temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1))
    sampled = msgspec.structs.replace(request(llm, "s", 7, "img-7", text), sampling_params=SamplingParams(
        temperature=0.8, seed=3, max_tokens=MAX_NEW, ignore_eos=True))
    outs = run(llm, asking, sampled)
    assert [o.num_cached_tokens for o in outs] == [n - 1] * 2 and tokens(outs[0]) == expected
    assert engine.core.scheduler.first_tokens.num_hits == 2
