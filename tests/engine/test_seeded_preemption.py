"""A seeded sampled request gives the same tokens whether or not it was preempted (regression:
its generator restarted from the seed when the runner rebuilt its state after preemption)."""

from __future__ import annotations

from mmserve import LLM, SamplingParams
from helpers.tiny_models import make_checkpoint, make_image

PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"


def test_seeded_sampling_survives_preemption(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("seeded"))
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": make_image(i)}} for i in range(4)]
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=100 + i, max_tokens=12, ignore_eos=True)
              for i in range(4)]
    roomy = LLM(model=path, block_size=4)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    prompt_blocks = sum(-(-len(o.prompt_token_ids) // 4) for o in roomy.generate(prompts, params))
    tight = LLM(model=path, block_size=4, num_kv_blocks=prompt_blocks, max_model_len=4 * prompt_blocks // 2)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert tight.engine.core.scheduler.num_preemptions > 0, "the test meant to force preemption"
    assert got == expected
