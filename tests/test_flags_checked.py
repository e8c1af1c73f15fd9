"""Every flag is checked when `mmserve serve` starts, before any model loads: a wrong type, a
NaN or an infinity is one `mmserve: error:` line naming the field (regressions: `--kv-events-config`
with `{"hwm": "x"}` was an 11-frame traceback, `{"topic": 5}` was refused by the engine core only
after the model loaded, the string "false" turned events on, `--responses-store-mb nan` failed
after the engine loaded and `inf` was an OverflowError)."""

from __future__ import annotations

import json

import pytest

from mmserve.cli import main
from mmserve.config import EngineConfig
from mmserve.kv_events_config import KVEventsConfig


@pytest.mark.parametrize("events, field", [
    ({"enable_kv_cache_events": "false", "publisher": "zmq"}, "enable_kv_cache_events"),
    ({"enable_kv_cache_events": 1, "publisher": "zmq"}, "enable_kv_cache_events"),
    ({"hwm": "x"}, "hwm"), ({"endpoint": 5}, "endpoint"), ({"topic": 5}, "topic"), ({"hwm": 1e30}, "hwm"),
    ({"buffer_steps": 1.5}, "buffer_steps"), ({"max_queue_size": True}, "max_queue_size"),
    ({"buffer_bytes": 0}, "buffer_bytes"), ({"replay_endpoint": 7}, "replay_endpoint"),
    ({"replay_endpoint": "http://x"}, "replay_endpoint"), ({"event_encoding": None}, "event_encoding"),
])
def test_kv_events_config_fields_are_typed(capsys, events, field):
    assert main(["serve", "--port", "0", "--kv-events-config", json.dumps(events)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mmserve: error: kv_events_config.") and field in err[0], err


@pytest.mark.parametrize("flag, value", [
    ("--responses-store-mb", "nan"), ("--responses-store-mb", "inf"), ("--request-read-timeout-s", "nan"),
    ("--max-request-body-mb", "inf"), ("--kv-cache-memory-gb", "nan"), ("--kv-cache-memory-gb", "inf"),
    ("--mm-processor-cache-gb", "inf"), ("--mm-shm-cache-gb", "nan"), ("--max-video-duration-s", "inf"),
    ("--cache-verify-rate", "nan"), ("--stalled-stream-abort-s", "inf"), ("--max-grammar-compile-s", "nan"),
])
def test_numeric_flags_are_finite(capsys, flag, value):
    assert main(["serve", "--port", "0", flag, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    name = flag[2:].replace("-", "_")
    assert len(err) == 1 and err[0].startswith("mmserve: error: ") and name in err[0], err


def test_a_good_config_still_passes():
    config = KVEventsConfig.from_dict({"enable_kv_cache_events": True, "publisher": "zmq", "hwm": 10,
                                       "replay_endpoint": "tcp://*:5558"})
    assert config.publishes
    assert EngineConfig.from_kwargs(kv_cache_memory_gb=0.5, kv_events_config={"enable_kv_cache_events": False})


@pytest.mark.parametrize("flags, words", [
    (["--chat-template", "/no/such/template.jinja"], "neither a file nor a Jinja template"),
    (["--chat-template", "{% for m in messages %}"], "syntax error at line 1"),
    (["--default-chat-template-kwargs", '{"tokenize": true}'], "--default-chat-template-kwargs cannot set tokenize"),
])
def test_chat_template_flags_are_checked_before_anything_loads(capsys, flags, words):
    assert main(["serve", "--port", "0", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mmserve: error: ") and words in err[0], err


@pytest.mark.parametrize("value", ["[1]", "{not json"])
def test_default_chat_template_kwargs_must_be_a_json_object(capsys, value):
    with pytest.raises(SystemExit) as exit:
        main(["serve", "--port", "0", "--default-chat-template-kwargs", value])
    assert exit.value.code == 2
    assert "--default-chat-template-kwargs" in capsys.readouterr().err


def test_chat_template_content_format_takes_vllms_choices(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--port", "0", "--chat-template-content-format", "jinja"])
    assert "--chat-template-content-format" in capsys.readouterr().err
