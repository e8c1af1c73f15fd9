"""Model names resolved as users type them (models/hub.py), with the real huggingface_hub client.

A loopback hub (`helpers/loopback_hub.py`) serves a tiny checkpoint with two revisions; every
resolution runs in a fresh interpreter whose environment (HF_ENDPOINT, HF_HUB_CACHE, HF_TOKEN,
HF_HUB_OFFLINE) is read by huggingface_hub at import, as a user's shell sets it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.loopback_hub import LoopbackHub, read_folder
from helpers.tiny_models import make_checkpoint
from mmserve.config import ModelConfig
from mmserve.models.hub import is_repo_id, locate

_RESOLVE = """
import json, sys
from mmserve.config import ModelConfig
from mmserve.models.hub import locate
try:
    print(locate(ModelConfig(model=sys.argv[1], revision=sys.argv[2] or None, tokenizer_revision=sys.argv[3] or None,
                             download_dir=sys.argv[4] or None, hf_overrides=json.loads(sys.argv[5]))))
except ValueError as e:
    print("error:", e)
"""

_ON_NODE = """
import dataclasses, sys
from mmserve.config import EngineConfig
from mmserve.models.hub import on_this_node
config = EngineConfig.from_kwargs(model=sys.argv[1], revision=sys.argv[2])
config = dataclasses.replace(config, model=dataclasses.replace(config.model, model_dir=sys.argv[3]))
print(on_this_node(config).model.checkpoint_dir)
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, dict[str, bytes]]:
    """Two revisions of one checkpoint: main, and v2 whose generation config and template differ;
    both publish files a server must not fetch (.bin weights, a picture)."""
    main = read_folder(make_checkpoint(tmp_path_factory.mktemp("ckpt")))
    main.update({"pytorch_model.bin": b"pickled weights", "assets/logo.png": b"\x89PNG", "README.md": b"# tiny"})
    v2 = dict(main)
    v2["generation_config.json"] = json.dumps({"eos_token_id": [2, 7], "temperature": 0.25}).encode()
    v2["chat_template.jinja"] = b"v2 {{ messages[0]['content'] }}"
    return {"main": main, "v2": v2}


@pytest.fixture
def hub(files):
    with LoopbackHub() as hub:
        hub.add("org/tiny", files)
        llama = dict(files["main"])
        llama["config.json"] = json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}).encode()
        hub.add("org/text-only", {"main": llama})
        hub.add("org/gated", {"main": files["main"]}, token="hf_secret")
        yield hub


def start(env: dict[str, str], model: str, revision: str = "", tokenizer_revision: str = "",
          download_dir: str = "", overrides: dict | None = None) -> subprocess.Popen[str]:
    """`locate` in a fresh interpreter (see `resolve`)."""
    return subprocess.Popen([sys.executable, "-c", _RESOLVE, model, revision, tokenizer_revision, download_dir,
                             json.dumps(overrides or {})],
                            env={**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1", **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def resolve(env: dict[str, str], model: str, revision: str = "", tokenizer_revision: str = "",
            download_dir: str = "", overrides: dict | None = None) -> str:
    """`locate` in a fresh interpreter: the snapshot path, or "error: <message>"."""
    return answer(start(env, model, revision, tokenizer_revision, download_dir, overrides))


def answer(proc: subprocess.Popen[str]) -> str:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return out.strip().splitlines()[-1]


def hub_env(hub: LoopbackHub, cache: Path) -> dict[str, str]:
    return {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(cache), "HF_TOKEN": "", "HF_HUB_OFFLINE": "0"}


def test_a_repo_id_downloads_the_checkpoint_files_of_its_revision(hub, files, tmp_path):
    env = hub_env(hub, tmp_path / "cache")
    main, v2 = resolve(env, "org/tiny"), resolve(env, "org/tiny", "v2")
    assert main != v2
    for path, revision in ((main, "main"), (v2, "v2")):
        assert Path(path).parent == tmp_path / "cache" / "models--org--tiny" / "snapshots"  # huggingface_hub's layout
        assert Path(path).name == hub.repos["org/tiny"].commits[revision]
        assert sorted(os.listdir(path)) == sorted(n for n in files[revision] if n.endswith((".json", ".safetensors",
                                                                                            ".jinja")))
        assert Path(path, "generation_config.json").read_bytes() == files[revision]["generation_config.json"]
    fetched = {p.rsplit("/", 1)[-1] for method, p in hub.requests if method == "GET" and "/resolve/" in p}
    assert not fetched & {"pytorch_model.bin", "logo.png", "README.md"}


def test_concurrent_starts_share_one_intact_cache(hub, files, tmp_path):
    env = hub_env(hub, tmp_path / "cache")
    paths = {answer(proc) for proc in [start(env, "org/tiny") for _ in range(3)]}  # huggingface_hub's locks
    assert len(paths) == 1
    path = Path(paths.pop())
    assert all((path / name).read_bytes() == files["main"][name] for name in os.listdir(path))


def test_the_cache_answers_offline_and_download_dir_is_a_cache_too(hub, tmp_path):
    env = hub_env(hub, tmp_path / "cache")
    online = resolve(env, "org/tiny"), resolve(env, "org/tiny", "v2")
    elsewhere = resolve(env, "org/tiny", download_dir=str(tmp_path / "dl"))
    assert elsewhere.startswith(str(tmp_path / "dl" / "models--org--tiny" / "snapshots"))
    hub.stop()  # the Hub is gone: only the cache can answer
    offline = {**env, "HF_HUB_OFFLINE": "1"}
    assert (resolve(offline, "org/tiny"), resolve(offline, "org/tiny", "v2")) == online
    missing = resolve(offline, "org/other")
    assert missing.startswith("error: org/other is not in the Hugging Face cache") and "HF_HUB_OFFLINE=1" in missing


def test_an_unreachable_hub_with_nothing_cached_is_one_line(hub, tmp_path):
    """Said after one refused HEAD (it took ~25 s of huggingface_hub's retries before `hub_reachable`)."""
    hub.stop()
    unreachable = resolve(hub_env(hub, tmp_path / "cache"), "org/tiny")
    assert unreachable.startswith("error: org/tiny: the Hugging Face Hub") and "cannot be reached" in unreachable


def test_an_unreachable_hub_without_hf_hub_offline_serves_the_cache_and_says_so(hub, tmp_path):
    """An air-gapped machine that forgot HF_HUB_OFFLINE: the cached snapshots of both revisions at
    once, after one HEAD to the Hub; the other lookups never reach it."""
    env = hub_env(hub, tmp_path / "cache")
    online = resolve(env, "org/tiny"), resolve(env, "org/tiny", "v2")
    hub.stop()
    for proc, path in ((start(env, "org/tiny"), online[0]), (start(env, "org/tiny", "v2"), online[1])):
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and out.strip().splitlines()[-1] == path, err
        assert f"the Hugging Face Hub ({hub.url}) cannot be reached: org/tiny is read from the cache" in err


def test_hf_overrides_are_checked_before_the_weights_and_read_through_links(hub, tmp_path):
    """The architecture check runs on the merged config.json (a wrong override: refused before any
    weight is fetched); a good one reads the snapshot through a directory of links."""
    env = {**hub_env(hub, tmp_path / "cache"), "MMSERVE_CACHE": str(tmp_path / "mmserve")}
    refused = resolve(env, "org/tiny", overrides={"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    assert refused.startswith("error: org/tiny is a LlamaForCausalLM checkpoint, which mmserve does not serve")
    assert not [p for _, p in hub.requests if p.endswith(".safetensors")]
    path = Path(resolve(env, "org/tiny", overrides={"text_config": {"max_position_embeddings": 4096}}))
    assert path.parent == tmp_path / "mmserve" / "hf-overrides"
    assert json.loads((path / "config.json").read_text())["text_config"]["max_position_embeddings"] == 4096
    assert (path / "model.safetensors").resolve().parent.name == "blobs"  # the snapshot's own file


def test_errors_name_the_repo_and_what_to_do(hub, tmp_path):
    env = hub_env(hub, tmp_path / "cache")
    assert resolve(env, "org/nope") == ("error: org/nope is not a model repo on the Hugging Face Hub (nor a "
                                        "directory here); check the name, or set HF_TOKEN if it is private")
    assert resolve(env, "org/tiny", "v9").startswith("error: org/tiny has no revision 'v9'")
    gated = resolve(env, "org/gated")
    assert gated.startswith("error: org/gated is a gated repo and no HF_TOKEN is set") and "HF_TOKEN" in gated
    assert "has no access" in resolve({**env, "HF_TOKEN": "hf_wrong"}, "org/gated")
    assert resolve({**env, "HF_TOKEN": "hf_secret"}, "org/gated").endswith(hub.repos["org/gated"].commits["main"])
    text_only = resolve(env, "org/text-only")
    assert text_only.startswith("error: org/text-only is a LlamaForCausalLM checkpoint, which mmserve does not serve")
    assert not [p for _, p in hub.requests if "text-only" in p and p.endswith(".safetensors")]  # refused before


def test_serves_hf_token_flag_is_the_token_the_hub_is_asked_with(hub, tmp_path):
    """vLLM's `--hf-token TOKEN`: the gated repo is asked for with it (a wrong one: "has no access",
    where no token at all says "no HF_TOKEN is set"); stopped there, before anything loads."""
    env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1", **hub_env(hub, tmp_path / "cache")}
    serve = [sys.executable, "-m", "mmserve.cli", "serve", "org/gated", "--port", "0"]
    for flags, words in ([], "no HF_TOKEN is set"), (["--hf-token", "hf_wrong"], "your HF_TOKEN has no access"):
        done = subprocess.run([*serve, *flags], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and words in done.stderr, done.stderr


def test_tokenizer_revision_takes_the_tokenizer_files_of_another_revision(hub, files, tmp_path):
    env = {**hub_env(hub, tmp_path / "cache"), "MMSERVE_CACHE": str(tmp_path / "mm")}
    path = Path(resolve(env, "org/tiny", "main", "v2"))
    assert path.parent.parent == tmp_path / "mm" / "overlays"
    assert (path / "chat_template.jinja").read_bytes() == files["v2"]["chat_template.jinja"]
    assert (path / "generation_config.json").read_bytes() == files["main"]["generation_config.json"]
    assert (path / "model.safetensors").read_bytes() == files["main"]["model.safetensors"]
    assert resolve(env, "org/tiny", "main", "v2") == str(path)  # made once


def test_a_ray_rank_on_another_node_resolves_the_name_where_p0s_directory_is_not(hub, tmp_path):
    """P0 resolved `org/tiny` at v2 into its own cache; a rank whose node lacks that folder downloads
    the same revision into its node's cache (here: another HF_HUB_CACHE); one that has it keeps it."""
    p0 = resolve(hub_env(hub, tmp_path / "p0"), "org/tiny", "v2")
    node = hub_env(hub, tmp_path / "node")

    def on_node(model_dir: str) -> str:
        run = subprocess.run([sys.executable, "-c", _ON_NODE, "org/tiny", "v2", model_dir], capture_output=True,
                             text=True, env={**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1", **node}, timeout=60)
        assert run.returncode == 0, run.stderr
        return run.stdout.strip().splitlines()[-1]

    here = on_node(str(tmp_path / "elsewhere" / Path(p0).name))
    assert Path(here).parent == tmp_path / "node" / "models--org--tiny" / "snapshots"
    assert Path(here).name == Path(p0).name == hub.repos["org/tiny"].commits["v2"]
    assert on_node(p0) == p0


def test_names_that_are_not_repo_ids_or_directories_fail_in_process(tmp_path):
    for name in ("./org/tiny", "org/", "a/b/c", "org/na..me", str(tmp_path / "missing")):
        assert not is_repo_id(name), name
    assert is_repo_id("Qwen/Qwen2.5-VL-7B-Instruct") and is_repo_id("llava-hf/llava-1.5-7b-hf")
    with pytest.raises(ValueError, match="neither a directory nor a Hugging Face repo id"):
        locate(ModelConfig(model=str(tmp_path / "missing")))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel checkpoint, which mmserve does not serve"):
        locate(ModelConfig(model=str(tmp_path)))


def test_mmserve_serve_reports_a_bad_repo_in_one_line(hub, tmp_path):
    run = subprocess.run([sys.executable, "-m", "mmserve.cli", "serve", "org/nope"], capture_output=True, text=True,
                         env={**os.environ, **hub_env(hub, tmp_path / "cache")}, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == ["mmserve: error: org/nope is not a model repo on the Hugging Face Hub "
                                               "(nor a directory here); check the name, or set HF_TOKEN if it is "
                                               "private"]
