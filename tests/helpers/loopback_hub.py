"""A Hugging Face Hub on 127.0.0.1: the few endpoints huggingface_hub's downloads call.

Point `HF_ENDPOINT` at `LoopbackHub.url` and the real client (`snapshot_download`,
`hf_hub_download`, transformers' `from_pretrained`) talks to it. What huggingface_hub 1.x/2.x asks:

- `GET /api/models/{repo}[/revision/{rev}]`: the model info; `sha` is the revision's commit.
- `GET /api/models/{repo}/tree/{rev}?recursive=...`: the file listing (`type`, `path`, `size`, `oid`,
  and `lfs` {`oid`, `size`} for weights), one page (no `Link: next`).
- `HEAD` / `GET /{repo}/resolve/{rev}/{path}`: a file, with `X-Repo-Commit`, `ETag` (the git blob id)
  and, for LFS files, `X-Linked-Etag` (sha256) and `X-Linked-Size`.

Errors carry the Hub's `X-Error-Code` (`RepoNotFound`, `RevisionNotFound`, `EntryNotFound`,
`GatedRepo`), which huggingface_hub turns into its typed errors. A gated repo's files need
`Authorization: Bearer <token>`. `requests` records every (method, path) served.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

_LFS_SUFFIXES = (".safetensors", ".bin", ".pth", ".gguf", ".tiktoken")


@dataclass
class Repo:
    """One model repo: revisions (branch or tag -> files) and who may read it."""

    revisions: dict[str, dict[str, bytes]]
    token: str | None = None  # set: a gated repo, whose files need this token
    commits: dict[str, str] = field(default_factory=dict)  # revision name -> commit sha

    def __post_init__(self) -> None:
        for name, files in self.revisions.items():
            digest = hashlib.sha1(name.encode())
            for path in sorted(files):
                digest.update(path.encode() + b"\0" + files[path])
            self.commits[name] = digest.hexdigest()

    def files_at(self, revision: str) -> tuple[str, dict[str, bytes]] | None:
        """(commit, files) of a branch, tag or commit sha; None if the repo has no such revision."""
        for name, commit in self.commits.items():
            if revision in (name, commit):
                return commit, self.revisions[name]
        return None


def read_folder(folder: str | Path) -> dict[str, bytes]:
    """Every file under `folder` as repo path -> bytes (a checkpoint made by tiny_models)."""
    root = Path(folder)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class LoopbackHub:
    """The server; a context manager (`with LoopbackHub() as hub: hub.add(...)`)."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def add(self, repo_id: str, revisions: dict[str, dict[str, bytes]], token: str | None = None) -> Repo:
        self.repos[repo_id] = repo = Repo(revisions, token)
        return repo

    def __enter__(self) -> LoopbackHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop answering (a Hub that cannot be reached); again is a no-op."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._server.server_close()

    # ---- the answers ------------------------------------------------------------------------------

    def answer(self, method: str, path: str, auth: str | None) -> tuple[int, dict[str, str], bytes]:
        self.requests.append((method, path))
        parts = [unquote(p) for p in urlsplit(path).path.strip("/").split("/")]
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            return self._api(f"{parts[2]}/{parts[3]}", parts[4:])
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._file(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]), auth, method == "GET")
        return _error(404, "RepoNotFound", "not a Hub route")

    def _api(self, repo_id: str, rest: list[str]) -> tuple[int, dict[str, str], bytes]:
        repo = self.repos.get(repo_id)
        if repo is None:
            return _error(404, "RepoNotFound", f"Repository {repo_id} not found")
        kind, revision = (rest[0], "/".join(rest[1:])) if rest else ("revision", "main")
        found = repo.files_at(revision)
        if found is None:
            return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        commit, files = found
        if kind == "tree":
            listing = [_tree_entry(path, data) for path, data in sorted(files.items())]
            return _json(listing)
        info: dict[str, Any] = {"id": repo_id, "sha": commit, "private": False,
                                "gated": "auto" if repo.token else False,
                                "siblings": [{"rfilename": path} for path in sorted(files)]}
        return _json(info)

    def _file(self, repo_id: str, revision: str, path: str, auth: str | None,
              body: bool) -> tuple[int, dict[str, str], bytes]:
        repo = self.repos.get(repo_id)
        if repo is None:
            return _error(404, "RepoNotFound", f"Repository {repo_id} not found")
        found = repo.files_at(revision)
        if found is None:
            return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        commit, files = found
        if repo.token is not None and auth != f"Bearer {repo.token}":
            return _error(401, "GatedRepo", f"Access to model {repo_id} is restricted.")
        if path not in files:
            status, headers, text = _error(404, "EntryNotFound", f"{path} does not exist")
            return status, {**headers, "X-Repo-Commit": commit}, text
        data = files[path]
        headers = {"X-Repo-Commit": commit, "ETag": f'"{git_blob_id(data)}"',
                   "Content-Type": "application/octet-stream"}
        if path.endswith(_LFS_SUFFIXES):
            headers.update({"X-Linked-Etag": f'"{hashlib.sha256(data).hexdigest()}"',
                            "X-Linked-Size": str(len(data))})
        headers["Content-Length"] = str(len(data))
        return 200, headers, data if body else b""


def _tree_entry(path: str, data: bytes) -> dict[str, Any]:
    entry: dict[str, Any] = {"type": "file", "path": path, "size": len(data), "oid": git_blob_id(data)}
    if path.endswith(_LFS_SUFFIXES):
        entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
    return entry


def _json(value: Any) -> tuple[int, dict[str, str], bytes]:
    return 200, {"Content-Type": "application/json"}, json.dumps(value).encode()


def _error(status: int, code: str, message: str) -> tuple[int, dict[str, str], bytes]:
    body = json.dumps({"error": message}).encode()
    return status, {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"}, body


def _handler(hub: LoopbackHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the real Hub: every answer has its Content-Length

        def do_GET(self) -> None:
            self._reply("GET")

        def do_HEAD(self) -> None:
            self._reply("HEAD")

        def _reply(self, method: str) -> None:
            status, headers, body = hub.answer(method, self.path, self.headers.get("Authorization"))
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            if "Content-Length" not in headers:
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if method == "GET":
                self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler
