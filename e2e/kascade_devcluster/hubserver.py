"""A local Hugging Face Hub: the HTTP endpoints `huggingface_hub.snapshot_download` uses, serving real
checkpoint directories, so `hf://` model sources are tested without network (point `HF_ENDPOINT` at
`HubServer.url`).

Endpoints (as the Hub answers them, read from huggingface_hub's client):
- `GET /api/models/OWNER/NAME/revision/REV` -> `{"id", "sha", "siblings"}` (resolves a branch to a commit)
- `GET /api/models/OWNER/NAME/tree/SHA?recursive=...` -> the file list (path, size, oid)
- `HEAD|GET /OWNER/NAME/resolve/SHA/FILE` -> the file, with `X-Repo-Commit`, `ETag`, `Content-Length`
Errors like the Hub: an unknown repo or revision is 404 with `X-Error-Code: RepoNotFound` /
`RevisionNotFound`; a repo with a token set answers 401 (`Invalid credentials in Authorization
header`) to a wrong bearer token and `RepoNotFound` without one. `requests` counts what was asked.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class HubRepo:
    files: dict[str, bytes]
    sha: str
    token: str | None = None  # private: this bearer token is required


@dataclass
class HubServer:
    repos: dict[str, HubRepo] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None

    def add(self, repo: str, directory: Path, token: str | None = None) -> HubRepo:
        files = {p.relative_to(directory).as_posix(): p.read_bytes()
                 for p in sorted(directory.rglob("*")) if p.is_file()}
        sha = hashlib.sha1(b"".join(k.encode() + hashlib.sha1(v).digest() for k, v in files.items())).hexdigest()
        self.repos[repo] = HubRepo(files, sha, token)
        return self.repos[repo]

    _advertise: str = "127.0.0.1"

    @property
    def url(self) -> str:
        """Where clients reach it: the address `start` was told to advertise (loopback by default)."""
        return f"http://{self._advertise}:{self.port}"

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return int(self._server.server_address[1])

    def start(self, host: str = "127.0.0.1", advertise: str | None = None) -> HubServer:
        """Serve on `host` (e.g. 0.0.0.0 for pods of a kind cluster), advertised in `url` as `advertise` (the
        address clients dial; default: `host`)."""
        hub = self
        self._advertise = advertise or host

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _send(self, code: int, payload: bytes, headers: dict[str, str], body: bool) -> None:
                self.send_response(code)
                for k, v in {"Content-Length": str(len(payload)), **headers}.items():
                    self.send_header(k, v)
                self.end_headers()
                if body:
                    self.wfile.write(payload)

            def _error(self, code: int, error_code: str | None, message: str, body: bool) -> None:
                headers = {"Content-Type": "application/json", "X-Error-Message": message}
                if error_code:
                    headers["X-Error-Code"] = error_code
                self._send(code, json.dumps({"error": message}).encode(), headers, body)

            def _serve(self, body: bool) -> None:
                path = unquote(urlsplit(self.path).path)
                hub.requests.append(f"{self.command} {path}")
                api = path.startswith("/api/models/")
                parts = path.removeprefix("/api/models/" if api else "/").split("/")
                repo = hub.repos.get("/".join(parts[:2]))
                if repo is None:
                    return self._error(404, "RepoNotFound", "Repository not found", body)
                auth = self.headers.get("authorization", "")
                if repo.token is not None and auth != f"Bearer {repo.token}":
                    if auth:
                        return self._error(401, None, "Invalid credentials in Authorization header", body)
                    return self._error(404, "RepoNotFound", "Repository not found", body)
                kind, rev, rest = (parts[2:3] or [""])[0], (parts[3:4] or [""])[0], "/".join(parts[4:])
                if rev not in ("main", repo.sha):
                    return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", body)
                if api and kind == "revision":
                    doc = {"id": "/".join(parts[:2]), "sha": repo.sha, "private": repo.token is not None,
                           "siblings": [{"rfilename": f} for f in repo.files]}
                    return self._send(200, json.dumps(doc).encode(), {"Content-Type": "application/json"}, body)
                if api and kind == "tree":
                    tree = [{"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                            for f, b in repo.files.items()]
                    return self._send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, body)
                if not api and kind == "resolve" and rest in repo.files:
                    data = repo.files[rest]
                    return self._send(200, data, {"X-Repo-Commit": repo.sha,
                                                  "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                                                  "Content-Type": "application/octet-stream"}, body)
                return self._error(404, "EntryNotFound", f"{path} does not exist", body)

        self._server = ThreadingHTTPServer((host, 0), Handler)
        threading.Thread(target=self._server.serve_forever, name="hubserver", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
