"""A tiny in-process fake of the vLLM OpenAI server routes ``VllmClient`` uses, recording every request.

``FakeVllm(name)`` serves on ``127.0.0.1:<free port>`` in a thread (``http.server``): ``/v1/completions`` (random
tokens in ``[3, 13)`` from a generator seeded by the request's ``seed``, logprob -1.0 each, ``<eos>`` = 2 last with
probability 1/2), ``/collective_rpc`` (``reload_and_repack`` sets the version; ``weight_version`` returns it; any
other method answers 400 like a server without it), ``/pause``, ``/resume``, ``/is_paused``,
``/reset_prefix_cache``, ``/health``. ``fail_rpc = True`` makes ``/collective_rpc`` answer 500.
"""

from __future__ import annotations

import json
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["FakeVllm"]


class FakeVllm:
    def __init__(self, name: str):
        self.name = name
        self.requests: list[tuple[str, str, Any]] = []
        """``(http method, path, body or rpc method)`` in arrival order."""
        self.version = 0
        self.paused = False
        self.fail_rpc = False
        self.loads: list[int] = []
        """Versions of the ``reload_and_repack`` calls answered."""
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _reply(self, status: int, obj: Any) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client cancelled the request (run end)
                    pass

            def do_GET(self) -> None:  # noqa: N802
                fake._record("GET", self.path, None)
                if self.path == "/health":
                    self._reply(200, {})
                elif self.path == "/is_paused":
                    self._reply(200, {"is_paused": fake.paused})
                else:
                    self._reply(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                path = self.path.split("?", 1)[0]
                fake._record("POST", self.path, body)
                if path == "/v1/completions":
                    self._reply(200, fake._complete(body))
                elif path == "/collective_rpc":
                    if fake.fail_rpc:
                        self._reply(500, {"error": {"message": f"{fake.name}: worker crashed"}})
                        return
                    method, args = body["method"], body.get("args", [])
                    if method == "reload_and_repack":
                        fake.version = int(args[1])
                        fake.loads.append(fake.version)
                        self._reply(200, {"results": [{"version": fake.version, "path": args[0], "reload_s": 0.0}]})
                    elif method == "weight_version":
                        self._reply(200, {"results": [fake.version]})
                    else:
                        self._reply(400, {"error": {"message": f"unknown method {method}"}})
                elif path == "/pause":
                    fake.paused = True
                    self._reply(200, {})
                elif path == "/resume":
                    fake.paused = False
                    self._reply(200, {})
                elif path == "/reset_prefix_cache":
                    self._reply(200, {"success": True})
                else:
                    self._reply(404, {"error": {"message": f"no route {path}"}})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name=f"fake-{name}", daemon=True)
        self._thread.start()

    def _record(self, method: str, path: str, body: Any) -> None:
        with self._lock:
            what = body["method"] if path == "/collective_rpc" and isinstance(body, dict) else body
            self.requests.append((method, path.split("?", 1)[0], what))

    def _complete(self, body: dict) -> dict:
        rng = random.Random(body.get("seed", 0))
        choices = []
        for i in range(int(body["n"])):
            toks = [rng.randrange(3, 13) for _ in range(int(body["max_tokens"]))]
            if rng.random() < 0.5:
                toks[-1] = 2
            choices.append({"index": i, "token_ids": toks, "finish_reason": "length",
                            "logprobs": {"token_logprobs": [-1.0] * len(toks), "tokens": [f"token_id:{t}" for t in toks]}})
        return {"choices": choices, "usage": {"prompt_tokens_details": {"cached_tokens": 0}}}

    def paths(self, method: str | None = None) -> list[str]:
        """Paths requested (POST ``/collective_rpc`` as ``rpc:<method>``), optionally of one HTTP method."""
        with self._lock:
            return [p if p != "/collective_rpc" else f"rpc:{w}" for m, p, w in self.requests
                    if method is None or m == method]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
