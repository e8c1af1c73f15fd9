"""Video through the real server with the official client (Qwen3-VL, --mm-cache-type lru and shm):
usage counts the expected prompt tokens, a repeat hits the processor, IPC / shm and prefix layers,
a clip made of a video's first frames hits the encoder cache once per shared temporal group, a
file:// video and a uuid-only repeat work, and broken or over-limit videos are 4xx answers after
which the server keeps serving."""

from __future__ import annotations

import base64

import openai
import pytest

from mmserve import LLM, SamplingParams
from helpers.server_process import ServerProcess, labelled
from helpers.tiny_models import make_qwen_checkpoint
from helpers.tiny_videos import audio_only_file, encode_video, make_frames

MAX_TOKENS = 4
FRAMES = make_frames(40, 8, (128, 96))  # 8 frames at 4 fps, sampled at 4 fps: 4 groups
OPTIONS = {"media_io_kwargs": {"video": {"fps": 4}}}


def video_url(data: bytes, mime: str = "video/quicktime") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def video_messages(url: str | None, text: str = "What happens?", before: str = "", uuid: str | None = None):
    part = {"type": "video_url", "video_url": None if url is None else {"url": url}}
    if uuid is not None:
        part["uuid"] = uuid
    parts = ([{"type": "text", "text": before}] if before else []) + [part, {"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_qwen_checkpoint(tmp_path_factory.mktemp("qwen-video-server"), family="qwen3_vl")


@pytest.fixture(scope="module", params=["lru", "shm"])
def server(request, model_path, tmp_path_factory):
    media = tmp_path_factory.mktemp("media")
    (media / "clip.mov").write_bytes(encode_video(FRAMES, fps=4))
    s = ServerProcess(model_path, "--served-model-name", "m", "--max-model-len", "1024", "--mm-cache-type",
                      request.param, "--mm-shm-cache-gb", "0.05", "--max-video-frames", "16",
                      "--allowed-local-media-path", str(media))
    s.transport, s.media = ("ipc" if request.param == "lru" else "shm"), media
    s.client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="unused", max_retries=0)
    yield s
    s.client.close()
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client


def ask(client, messages, **extra):
    return client.chat.completions.create(model="m", messages=messages, max_tokens=MAX_TOKENS, temperature=0.0,
                                          extra_body={**OPTIONS, **extra})


def hits(server, layers):
    return {layer: labelled(server, "mmserve_cache_hits_total", layer) for layer in layers}


def test_usage_and_answer_equal_offline(server, client, model_path):
    data = encode_video(FRAMES, fps=4)
    reply = ask(client, video_messages(video_url(data)))
    llm = LLM(model=model_path, max_model_len=1024)
    prompt = llm.engine.input_processor.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}])
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"video": (FRAMES, 4.0)}, **OPTIONS},
                       SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))[0]
    assert reply.usage.prompt_tokens == len(out.prompt_token_ids)
    assert reply.choices[0].message.content == out.outputs[0].text


def test_a_repeat_hits_every_layer(server, client):
    url = video_url(encode_video(make_frames(41, 8, (128, 96)), fps=4))
    layers = ("processor", server.transport, "prefix")
    ask(client, video_messages(url))
    mid = hits(server, layers)
    again = ask(client, video_messages(url))
    after = hits(server, layers)
    assert after["processor"] == mid["processor"] + 1  # the whole video: not decoded, not processed
    assert after[server.transport] == mid[server.transport] + 4  # each of its 4 groups crossed as a key
    assert after["prefix"] > mid["prefix"] and again.usage.prompt_tokens_details.cached_tokens > 0


def test_a_clip_of_first_frames_hits_the_encoder_per_group(server, client):
    frames = make_frames(42, 8, (128, 96))
    ask(client, video_messages(video_url(encode_video(frames, fps=4))))
    before = labelled(server, "mmserve_cache_hits_total", "encoder")
    ask(client, video_messages(video_url(encode_video(frames[:4], fps=4)), before="Something else first."))
    assert labelled(server, "mmserve_cache_hits_total", "encoder") == before + 2


def test_file_url_and_uuid_alone(server, client):
    first = ask(client, video_messages(f"file://{server.media}/clip.mov", uuid="clip-1"))
    again = ask(client, video_messages(None, uuid="clip-1"))
    assert again.choices[0].message.content == first.choices[0].message.content


def test_broken_videos_are_400s_and_the_server_keeps_serving(server, client):
    good = encode_video(make_frames(43, 6, (64, 48)), fps=3, codec="h264")
    cases = {
        "garbage": video_messages(video_url(b"\x00\x01junk" * 64, "video/mp4")),
        "truncated": video_messages(video_url(good[: len(good) // 2], "video/mp4")),
        "no_video_stream": video_messages(video_url(audio_only_file(), "video/wav")),
        "too_many_frames": video_messages(video_url(encode_video(make_frames(44, 20, (64, 48)), fps=4))),
        "two_videos": [{"role": "user", "content": video_messages(video_url(good, "video/mp4"))[0]["content"] * 2}],
        "unknown_uuid": video_messages(None, uuid="never-sent"),
        "bad_option": video_messages(video_url(good, "video/mp4")),
        "outside_local_root": video_messages("file:///etc/hostname"),
        "image_mime": video_messages(video_url(good, "image/png")),
    }
    for case, messages in cases.items():
        extra = {"mm_processor_kwargs": {"num_frames": 0}} if case == "bad_option" else {}
        with pytest.raises(openai.BadRequestError) as e:
            ask(client, messages, **extra)
        assert e.value.status_code == 400, case
    assert ask(client, video_messages(video_url(good, "video/mp4"))).choices[0].message.content is not None
    assert server.get("/health")[0] == 200

