"""Defaults that fit the deployment (issue 41): the node's shared item store with several API
servers (lru when asked for, or when /dev/shm is too small, with a warning naming the fallback),
and the model family's tool-call parser."""

from __future__ import annotations

import json
import logging

from mmserve.config import EngineConfig
from mmserve.deployment_defaults import family_tool_parser, with_item_transport


def test_several_api_servers_share_the_node_store_by_default(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="mmserve.deployment_defaults")
    config = with_item_transport(EngineConfig.from_kwargs(api_server_count=2, mm_shm_cache_gb=0.001), str(tmp_path))
    assert config.multimodal.mm_cache_type == "shm" and config.multimodal.uses_shm
    assert config.multimodal.ipc_cache_bytes == 0
    assert "share the node's item store" in caplog.text


def test_one_api_server_and_an_explicit_choice_keep_lru(tmp_path):
    one = with_item_transport(EngineConfig.from_kwargs(mm_shm_cache_gb=0.001), str(tmp_path))
    asked = with_item_transport(EngineConfig.from_kwargs(api_server_count=2, mm_cache_type="lru",
                                                         mm_shm_cache_gb=0.001), str(tmp_path))
    assert one.multimodal.mm_cache_type == "lru" and asked.multimodal.mm_cache_type == "lru"
    assert EngineConfig.from_kwargs().multimodal.ipc_cache_bytes > 0  # unset is lru until a server decides


def test_too_small_a_shm_falls_back_to_lru_with_a_warning(tmp_path, caplog):
    huge = EngineConfig.from_kwargs(api_server_count=2, mm_shm_cache_gb=1 << 20)  # a PiB: no tmpfs is that big
    config = with_item_transport(huge, str(tmp_path))
    assert config.multimodal.mm_cache_type == "lru"
    assert "falling back to --mm-cache-type lru" in caplog.text
    caplog.clear()
    gone = with_item_transport(EngineConfig.from_kwargs(api_server_count=2), str(tmp_path / "absent"))
    assert gone.multimodal.mm_cache_type == "lru" and "no space" in caplog.text


def test_the_family_tool_parser_comes_from_the_architecture(tmp_path):
    def checkpoint(name: str, architectures: list[str]) -> str:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"architectures": architectures}))
        return str(tmp_path / name)

    assert family_tool_parser(checkpoint("q3", ["Qwen3VLForConditionalGeneration"])) == "hermes"
    assert family_tool_parser(checkpoint("q25", ["Qwen2_5_VLForConditionalGeneration"])) == "hermes"
    assert family_tool_parser(checkpoint("llava", ["LlavaForConditionalGeneration"])) is None
    assert family_tool_parser(str(tmp_path / "missing")) is None
