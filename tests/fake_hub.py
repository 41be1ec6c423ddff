"""A loopback HTTP server standing in for the Hugging Face Hub: just the calls huggingface_hub makes to create a
repository and upload a folder of small files (regular uploads, no LFS). It binds to 127.0.0.1 only and records
every request so a test can see what arrived."""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeHub:
    def __init__(self, token: str = "hf_fake_token", deny_writes: bool = False):
        self.token = token
        self.deny_writes = deny_writes
        self.repos: dict[str, dict] = {}  # repo id -> {"private": bool, "files": {path: bytes}, "commits": [...]}
        self.requests: list[tuple[str, str]] = []
        self.unexpected: list[tuple[str, str]] = []
        self.validated_yaml: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def _send(self, status, payload):
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _body(self):
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _authorised(self):
                return self.headers.get("Authorization") == f"Bearer {hub.token}"

            def do_POST(self):  # noqa: N802 (http.server naming)
                hub.requests.append(("POST", self.path))
                body = self._body()
                if not self._authorised():
                    return self._send(401, {"error": "Invalid credentials"})
                path = self.path.split("?")[0]
                if path == "/api/repos/create":
                    if hub.deny_writes:
                        return self._send(403, {"error": "You don't have the rights to create a model"})
                    data = json.loads(body)
                    repo = f"{data['organization']}/{data['name']}" if data.get("organization") else data["name"]
                    private = bool(data.get("private")) or data.get("visibility") == "private"
                    hub.repos.setdefault(repo, {"private": private, "files": {}, "commits": []})
                    return self._send(200, {"url": f"http://{self.headers['Host']}/{repo}", "name": repo})
                if path == "/api/validate-yaml":  # huggingface_hub checks a README.md's metadata before uploading
                    hub.validated_yaml.append(json.loads(body).get("content", ""))
                    return self._send(200, {"errors": [], "warnings": []})
                parts = path.split("/")  # /api/models/{owner}/{name}/{preupload|commit}/{revision}
                if len(parts) >= 7 and parts[1:3] == ["api", "models"]:
                    repo, action = f"{parts[3]}/{parts[4]}", parts[5]
                    if repo not in hub.repos:
                        return self._send(404, {"error": "Repository not found"})
                    if action == "preupload":
                        files = json.loads(body)["files"]
                        return self._send(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                                           "shouldIgnore": False} for f in files]})
                    if action == "commit":
                        return self._commit(repo, body)
                hub.unexpected.append(("POST", self.path))
                return self._send(404, {"error": f"fake hub does not implement POST {path}"})

            def _commit(self, repo, body):
                summary = None
                for line in body.decode().splitlines():
                    item = json.loads(line)
                    if item["key"] == "header":
                        summary = item["value"].get("summary")
                    elif item["key"] == "file":
                        value = item["value"]
                        hub.repos[repo]["files"][value["path"]] = base64.b64decode(value["content"])
                    else:
                        hub.unexpected.append(("commit-op", item["key"]))
                hub.repos[repo]["commits"].append(summary)
                oid = f"{len(hub.repos[repo]['commits']):040x}"
                return self._send(200, {"commitUrl": f"http://{self.headers['Host']}/{repo}/commit/{oid}",
                                        "commitOid": oid, "success": True})

            def do_GET(self):  # noqa: N802
                hub.requests.append(("GET", self.path))
                if not self.path.startswith("/api/agent-harnesses"):  # a probe huggingface_hub makes; 404 is fine
                    hub.unexpected.append(("GET", self.path))
                return self._send(404, {"error": "not implemented"})

            do_HEAD = do_GET  # noqa: N815

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
