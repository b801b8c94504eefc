"""A local HTTP server that speaks the part of the Hugging Face Hub's API that `huggingface_hub` downloads through:
repository listings with LFS metadata, and `resolve` URLs with HEAD, GET and byte ranges. Point `HF_ENDPOINT` (or
the `endpoint=` argument) at `FakeHub.url`. It listens on 127.0.0.1 only."""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class HubFile:
    data: bytes | Path  # the bytes served, or a file to stream them from
    sha256: str | None = None  # what the listing claims; None: the true sha256
    lfs: bool = True

    def size(self) -> int:
        return self.data.stat().st_size if isinstance(self.data, Path) else len(self.data)

    def read(self, start: int, end: int) -> bytes:
        if isinstance(self.data, Path):
            with self.data.open("rb") as f:
                f.seek(start)
                return f.read(end - start)
        return self.data[start:end]

    def true_sha256(self) -> str:
        h = hashlib.sha256()
        for i in range(0, self.size(), 1 << 24):
            h.update(self.read(i, min(self.size(), i + (1 << 24))))
        return h.hexdigest()


@dataclass
class FakeHub:
    repos: dict[str, dict[str, HubFile]] = field(default_factory=dict)
    cut_after: int | None = None  # the first download of a file stops after this many bytes (then it is reset)
    hold_after: int | None = None  # the first download stalls after this many bytes until `release` is set
    release: threading.Event = field(default_factory=threading.Event)
    holding: threading.Event = field(default_factory=threading.Event)  # set once a download is stalled
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # (method, path, Range header)
    # Statuses answered, one per request and in order, to the GETs that resume a file (a Range past byte 0),
    # before the file is served again: a 401, a 5xx or a 429 mid-download.
    resume_statuses: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                hub._answer(self, head=False)

            def do_HEAD(self) -> None:
                hub._answer(self, head=True)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _listing(self, repo: str) -> dict:
        siblings = []
        for name, f in self.repos[repo].items():
            entry = {"rfilename": name, "size": f.size()}
            if f.lfs:
                entry["lfs"] = {"sha256": f.sha256 or f.true_sha256(), "size": f.size(), "pointerSize": 134}
            siblings.append(entry)
        return {"id": repo, "modelId": repo, "sha": COMMIT, "private": False, "siblings": siblings}

    def _answer(self, request: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlparse(request.path).path)
        self.requests.append((request.command, path, request.headers.get("Range")))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo = "/".join(parts[2:4])
            if repo not in self.repos:
                return self._send(request, 404, b'{"error":"Repository not found"}', {"X-Error-Code": "RepoNotFound"})
            return self._send(request, 200, json.dumps(self._listing(repo)).encode(), {}, head)
        if len(parts) >= 5 and parts[2] == "resolve":
            repo, name = "/".join(parts[:2]), "/".join(parts[4:])
            f = self.repos.get(repo, {}).get(name)
            if f is None:
                return self._send(request, 404, b"Entry not found", {"X-Error-Code": "EntryNotFound"})
            return self._file(request, f, head)
        self._send(request, 404, b"not found", {})

    def _file(self, request: BaseHTTPRequestHandler, f: HubFile, head: bool) -> None:
        size = f.size()
        etag = f'"{f.true_sha256()}"'
        headers = {"X-Repo-Commit": COMMIT, "ETag": etag, "Accept-Ranges": "bytes"}
        if f.lfs:
            headers["X-Linked-Etag"] = etag
            headers["X-Linked-Size"] = str(size)
        start = 0
        spec = request.headers.get("Range")
        if spec and spec.startswith("bytes=") and not head:
            start = int(spec[6:].split("-")[0] or 0)
        if start and self.resume_statuses:
            status = self.resume_statuses.pop(0)
            extra = {"Retry-After": "0"} if status == 429 else {}
            return self._send(request, status, b'{"error":"refused by the test hub"}', extra)
        end = size
        if not head and self.cut_after is not None and start < self.cut_after:
            end, self.cut_after = self.cut_after, None  # the connection drops after this many bytes
            headers["Content-Length"] = str(size - start)  # promised the whole rest
        status = 206 if start else 200
        if start:
            headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
        request.send_response(status)
        headers.setdefault("Content-Length", str(size - start))
        for k, v in headers.items():
            request.send_header(k, v)
        request.end_headers()
        if head:
            return
        hold, self.hold_after = self.hold_after, None
        for i in range(start, end, 1 << 20):
            if hold is not None and i >= start + hold:
                request.wfile.flush()
                self.holding.set()
                self.release.wait(timeout=120)
                request.close_connection = True
                return
            request.wfile.write(f.read(i, min(end, i + (1 << 20))))
        if end < size:
            request.wfile.flush()
            request.close_connection = True
            request.connection.shutdown(2)

    @staticmethod
    def _send(request: BaseHTTPRequestHandler, status: int, body: bytes, headers: dict, head: bool = False) -> None:
        request.send_response(status)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(body)))
        for k, v in headers.items():
            request.send_header(k, v)
        request.end_headers()
        if not head:
            request.wfile.write(body)
