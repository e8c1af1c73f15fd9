"""Where a model name becomes a checkpoint directory: the one place, run once per start.

`resolve_engine_model(config)` runs in the first process (`mmserve serve`'s, the launcher's, the
offline `LLM`'s) before any API server, engine core or worker starts; they get the config with
`model.model_dir` set and never look a name up again — except a Ray rank on another node, where
that directory is not: it resolves the same name there (`on_this_node`). A name is, in this order:

- `builtin:<model>`: the built-in checkpoint, made on first use (`builtin.py`);
- an existing directory: used as is;
- a Hugging Face repo id (`org/name`): `huggingface_hub` downloads the files a checkpoint needs
  (`CHECKPOINT_FILES`: safetensors weights and their index, JSON configs, tokenizer files, chat
  templates; never `.bin`/`.pth`/GGUF/images) at `--revision` into its cache (`--download-dir`,
  else HF_HUB_CACHE / HF_HOME, which huggingface_hub reads itself, as it reads HF_TOKEN,
  HF_ENDPOINT and HF_HUB_OFFLINE) and returns the snapshot folder; its file locks keep concurrent
  starts on one machine from corrupting the cache. config.json comes first, alone, so that an
  architecture mmserve does not serve is refused before the weights are fetched. The Hub is asked
  once first whether it answers at all (`hub_reachable`): where it does not (no network, an
  air-gapped cluster without HF_HUB_OFFLINE) the cache alone answers, at once, instead of after
  huggingface_hub's retries of every call (~25 s each).

Every failure is a ValueError whose message is one line naming the model and what to do.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import re
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from mmserve.models.builtin import BUILTIN_MODELS, BUILTIN_PREFIX, cache_root, resolve_model
from mmserve.models.hf_config import check_architecture
from mmserve.models.hf_overrides import merged, overridden_dir
from mmserve.models.link_dirs import linked_directory

if TYPE_CHECKING:
    from mmserve.config import EngineConfig, ModelConfig

TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "*.tiktoken", "chat_template.json",
                   "chat_template.jinja", "*.jinja"]
CHECKPOINT_FILES = ["*.safetensors", "*.safetensors.index.json", "*.json", *TOKENIZER_FILES]
# huggingface_hub's own rule for a repo id: two names of [\w.-], neither with "--" or ".."
_REPO_ID = re.compile(r"^[\w.-]{1,96}/[\w.-]{1,96}$")

logger = logging.getLogger(__name__)


def resolve_engine_model(config: EngineConfig) -> EngineConfig:
    """`config` with `model.model_dir` set (downloading a repo id now); a config that already has
    one is returned as is, so every later process finds the name resolved."""
    if config.model.model_dir is not None:
        return config
    path = locate(config.model)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, model_dir=path))


def on_this_node(config: EngineConfig) -> EngineConfig:
    """`config` with its checkpoint directory as this machine has it: a directory resolved on another
    node (P0's, for a Ray rank placed elsewhere) that is not here is resolved again here, from the
    same name, revision and download dir (the repo's snapshot, or the built-in model written here)."""
    model_dir = config.model.model_dir
    if model_dir is not None and os.path.isdir(model_dir):
        return config
    return resolve_engine_model(dataclasses.replace(config, model=dataclasses.replace(config.model, model_dir=None)))


def locate(model: ModelConfig) -> str:
    """The local checkpoint directory of `model.model` (see the module docstring), read through
    `model.hf_overrides` when it has any (`hf_overrides.py`)."""
    name, overrides = model.model, model.hf_overrides
    if model.model_dir is not None:
        return model.model_dir
    if name.startswith(BUILTIN_PREFIX):
        path = resolve_model(name)
    elif os.path.isdir(name):
        _check_config(name, name, overrides)
        path = name
    elif not is_repo_id(name):
        raise ValueError(f"model {name!r} is neither a directory nor a Hugging Face repo id (org/name); give a "
                         f"checkpoint directory, a repo id such as Qwen/Qwen2.5-VL-7B-Instruct, or "
                         f"{BUILTIN_PREFIX}{BUILTIN_MODELS[0]}")
    else:
        path = download(name, model.revision, model.tokenizer_revision, model.download_dir, overrides)
    return overridden_dir(path, overrides) if overrides else path


def prefetch(name: str, server_args: Sequence[str]) -> str:
    """Resolve `name` as `mmserve serve name *server_args` will (its --revision, --tokenizer-revision and
    --download-dir), so that a benchmark's launched server finds it in the cache."""
    from mmserve.config import ModelConfig

    parser = argparse.ArgumentParser(add_help=False)
    for flag in ("--revision", "--tokenizer-revision", "--download-dir"):
        parser.add_argument(flag)
    flags, _ = parser.parse_known_args(list(server_args))
    return locate(ModelConfig(model=name, revision=flags.revision, tokenizer_revision=flags.tokenizer_revision,
                              download_dir=flags.download_dir))


def is_repo_id(name: str) -> bool:
    """Whether `name` reads as a Hugging Face repo id (`org/name`), not a path."""
    return bool(_REPO_ID.match(name)) and ".." not in name and "--" not in name and not name.startswith(".")


def download(repo_id: str, revision: str | None = None, tokenizer_revision: str | None = None,
             cache_dir: str | None = None, overrides: dict[str, Any] | None = None) -> str:
    """The snapshot folder of `repo_id` at `revision` with the files a checkpoint needs, downloaded
    (with huggingface_hub's progress bars) unless the cache holds them; a ValueError otherwise (its
    config.json, with `overrides`, checked before the weights are fetched)."""
    from huggingface_hub import constants, hf_hub_download, snapshot_download

    local = not constants.is_offline_mode() and not hub_reachable()
    if local:
        logger.warning("the Hugging Face Hub (%s) cannot be reached: %s is read from the cache", constants.ENDPOINT,
                       repo_id)
    with hub_errors(repo_id, revision, cache_dir):
        config = hf_hub_download(repo_id, "config.json", revision=revision, cache_dir=cache_dir,
                                 local_files_only=local)
        _check_config(os.path.dirname(config), repo_id, overrides)
        path = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=CHECKPOINT_FILES,
                                 local_files_only=local)
    if not any(name.endswith(".safetensors") for name in os.listdir(path)):
        raise ValueError(f"{repo_id} publishes no .safetensors weights (mmserve loads safetensors only)")
    if tokenizer_revision is None or tokenizer_revision == revision:
        return path
    with hub_errors(repo_id, tokenizer_revision, cache_dir):
        tokenizer = snapshot_download(repo_id, revision=tokenizer_revision, cache_dir=cache_dir,
                                      allow_patterns=TOKENIZER_FILES, local_files_only=local)
    return overlay(path, tokenizer, repo_id)


def hub_reachable() -> bool:
    """Whether the Hub's endpoint answers at all (any HTTP status) to one HEAD, with no retry,
    within huggingface_hub's timeout for metadata requests (HF_HUB_ETAG_TIMEOUT, 10 s by default)."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except Exception:  # refused, no route, no name, timed out, a proxy's failure: no answer
        return False
    return True


def overlay(model_dir: str, tokenizer_dir: str, repo_id: str) -> str:
    """A directory of links: every file of `model_dir`, the tokenizer files of `tokenizer_dir` over
    them (under mmserve's cache, named by both snapshots' commits: `link_dirs.linked_directory`)."""
    name = f"{os.path.basename(model_dir)}+{os.path.basename(tokenizer_dir)}"
    return linked_directory(cache_root() / "overlays" / repo_id.replace("/", "--") / name, [model_dir, tokenizer_dir])


def _check_config(path: str, name: str, overrides: dict[str, Any] | None = None) -> None:
    """ValueError unless `path` holds a config.json (with `overrides` merged) of a family mmserve serves."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise ValueError(f"{name} has no config.json: not a Hugging Face checkpoint directory")
    with open(file) as f:
        raw: dict[str, Any] = json.load(f)
    check_architecture(merged(raw, overrides or {}), name)


@contextlib.contextmanager
def hub_errors(repo_id: str, revision: str | None, cache_dir: str | None) -> Iterator[None]:
    """Turns huggingface_hub's errors into a one-line ValueError naming the repo and what to do."""
    from huggingface_hub import constants, errors, get_token

    at = f"{repo_id}@{revision}" if revision else repo_id
    cache = cache_dir or constants.HF_HUB_CACHE
    try:
        yield
    except errors.RevisionNotFoundError:
        raise ValueError(f"{repo_id} has no revision {revision!r} on the Hugging Face Hub; give a branch, tag or "
                         "commit of the repo (--revision)") from None
    except errors.GatedRepoError:
        what = "your HF_TOKEN has no access to it" if get_token() else "no HF_TOKEN is set"
        raise ValueError(f"{repo_id} is a gated repo and {what}: accept its terms on "
                         f"https://huggingface.co/{repo_id}, then set HF_TOKEN (or run `hf auth login`)") from None
    except errors.RepositoryNotFoundError:
        raise ValueError(f"{repo_id} is not a model repo on the Hugging Face Hub (nor a directory here); check the "
                         "name, or set HF_TOKEN if it is private") from None
    except errors.IncompleteSnapshotError:
        raise ValueError(f"{at}: the Hugging Face cache ({cache}) holds only part of it and the Hub cannot be "
                         "reached; download it once online (unset HF_HUB_OFFLINE)") from None
    except errors.LocalEntryNotFoundError:
        if constants.is_offline_mode():
            raise ValueError(f"{at} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE=1 forbids "
                             "downloading it; download it once online, or unset HF_HUB_OFFLINE") from None
        raise ValueError(f"{at}: the Hugging Face Hub ({constants.ENDPOINT}) cannot be reached and the cache "
                         f"({cache}) does not hold it; check the network (or HF_ENDPOINT)") from None
    except errors.EntryNotFoundError:
        raise ValueError(f"{at} has no config.json: not a Transformers checkpoint") from None
    except errors.HfHubHTTPError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{at}: the Hugging Face Hub answered: {first}") from None
