"""Where a request is resolved: on the event loop only when it is alone and has no video (a
thread hand-off there costs ~0.5 ms of TTFT; a video's decode would hold /health for seconds)."""

from __future__ import annotations

from mmserve.frontend.request.admission import resolves_on_loop

IMAGE = {"prompt": "USER: <image>\nWhat? ASSISTANT:", "multi_modal_data": {"image": "data:image/png;base64,"}}
VIDEO = {"prompt": "<|vision_start|><|video_pad|><|vision_end|>", "multi_modal_data": {"video": "file:///v.mov"}}


def test_a_request_alone_resolves_on_the_loop():
    assert resolves_on_loop("USER: hi ASSISTANT:", 1)
    assert resolves_on_loop(IMAGE, 1)


def test_a_request_beside_others_or_with_a_video_resolves_in_a_thread():
    assert not resolves_on_loop(IMAGE, 2)
    assert not resolves_on_loop(VIDEO, 1)
    assert not resolves_on_loop({**VIDEO, "multi_modal_data": {"image": [], "video": []}}, 1)
