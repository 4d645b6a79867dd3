"""A tiny Hugging Face Hub over HTTP on 127.0.0.1, serving repositories the tests build: the
endpoints huggingface_hub calls to list a model repository's files and to download them.

- `GET /api/models/{repo}[/revision/{rev}][?blobs=True]`: the repository's commit (`sha`) and
  files (`siblings`), with `blobs=True` each file's size and git blob id (`blobId`) and, for
  an LFS file (`*.gguf`, `*.safetensors`, as on the Hub), `lfs: {sha256, size}`; 404 with
  `X-Error-Code: RepoNotFound` for an unknown repository.
- `HEAD|GET /{repo}/resolve/{rev}/{path}`: the file, with the headers huggingface_hub needs
  (`X-Repo-Commit`, `ETag`: the sha256 of an LFS file, the git blob id of another, as the
  Hub sends them; `Content-Length`), `Range: bytes=N-` honoured (206); 404 with
  `X-Error-Code: EntryNotFound` for an unknown file.
Every request is recorded (`requests`: (method, path)); anything else is a 500 so that a test
sees a call it did not expect. A file named in `cut` breaks off halfway the first time its
whole body is asked for (the connection closes), as a flaky network would. A file in `corrupt`
is sent as the bytes given there (the same size; metadata and ETag still describe the true
file), as a bad disk, proxy or mirror would send it.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_INFO = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/?]+))?(?:\?.*)?")
_RESOLVE = re.compile(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>[^?]+)(?:\?.*)?")


class Hub:
    """`repos`: repository id → {file path: bytes}. Use as a context manager."""

    def __init__(self, repos: dict[str, dict[str, bytes]], cut: frozenset[str] = frozenset(),
                 corrupt: dict[str, bytes] | None = None) -> None:
        self.repos = repos
        self.cut = set(cut)
        self.corrupt = dict(corrupt or {})
        self.commits = {repo: hashlib.sha1(json.dumps(sorted(
            (p, hashlib.sha256(b).hexdigest()) for p, b in files.items())).encode()).hexdigest()
            for repo, files in repos.items()}
        self.requests: list[tuple[str, str]] = []
        self.resumed_at: list[int] = []  # the offsets of `Range: bytes=N-` requests
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def downloads(self, path: str) -> int:
        """How many times a file's bytes were sent."""
        return sum(1 for m, p in self.requests if m == "GET" and "/resolve/" in p
                   and p.split("?")[0].endswith("/" + path))

    def __enter__(self) -> Hub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                hub.requests.append(("GET", self.path))
                hub._answer(self, body=True)

            def do_HEAD(self) -> None:
                hub.requests.append(("HEAD", self.path))
                hub._answer(self, body=False)

        return Handler

    def _answer(self, req: BaseHTTPRequestHandler, body: bool) -> None:
        if (m := _INFO.fullmatch(req.path)) and body:
            return self._info(req, m["repo"])
        if m := _RESOLVE.fullmatch(req.path):
            return self._file(req, m["repo"], m["rev"], m["path"], body)
        self._send(req, 500, {}, f"unexpected request {req.path}".encode(), body)

    def _info(self, req, repo: str) -> None:
        if repo not in self.repos:
            return self._send(req, 404, {"X-Error-Code": "RepoNotFound"}, b"{}", True)
        blobs = "blobs=true" in req.path.lower()
        data = {"id": repo, "sha": self.commits[repo], "private": False,
                "siblings": [_sibling(p, b, blobs) for p, b in sorted(self.repos[repo].items())]}
        self._send(req, 200, {"Content-Type": "application/json"}, json.dumps(data).encode(), True)

    def _file(self, req, repo: str, rev: str, path: str, body: bool) -> None:
        if repo not in self.repos or rev not in ("main", self.commits[repo]):
            return self._send(req, 404, {"X-Error-Code": "RepoNotFound"}, b"", body)
        commit = {"X-Repo-Commit": self.commits[repo]}
        data = self.repos[repo].get(path)
        if data is None:
            return self._send(req, 404, {**commit, "X-Error-Code": "EntryNotFound"}, b"", body)
        headers = {**commit, "ETag": f'"{etag(path, data)}"', "Accept-Ranges": "bytes"}
        data = self.corrupt.get(path, data)
        start = re.fullmatch(r"bytes=(\d+)-", req.headers.get("Range", ""))
        if start and body:
            offset = int(start[1])
            self.resumed_at.append(offset)
            headers["Content-Range"] = f"bytes {offset}-{len(data) - 1}/{len(data)}"
            return self._send(req, 206, headers, data[offset:], body)
        if body and path in self.cut:
            self.cut.discard(path)
            return self._send(req, 200, headers, data, body, cut_at=len(data) // 2)
        self._send(req, 200, headers, data, body)

    @staticmethod
    def _send(req, status: int, headers: dict, data: bytes, body: bool,
              cut_at: int | None = None) -> None:
        req.send_response(status)
        for k, v in headers.items():
            req.send_header(k, v)
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        if body:
            req.wfile.write(data[:cut_at])
        if cut_at is not None:
            req.close_connection = True


def is_lfs(path: str) -> bool:
    return path.endswith((".gguf", ".safetensors"))


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def etag(path: str, data: bytes) -> str:
    return hashlib.sha256(data).hexdigest() if is_lfs(path) else git_blob_id(data)


def _sibling(path: str, data: bytes, blobs: bool) -> dict:
    if not blobs:
        return {"rfilename": path}
    out = {"rfilename": path, "size": len(data), "blobId": git_blob_id(data)}
    if is_lfs(path):
        out["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
                      "pointerSize": 134}
    return out
