"""A webhook receiver of the tests' own, for the webhooks tests (api.webhooks)."""

from __future__ import annotations

import base64
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import openai

SECRET = "whsec_" + base64.b64encode(os.urandom(32)).decode()


class Receiver:
    """An HTTP server that records every POST (headers, body, whether it answered 200) and
    answers the first one with a 500."""

    def __init__(self) -> None:
        self.posts: list[tuple[dict[str, str], bytes, bool]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["content-length"]))
                headers = {k.lower(): v for k, v in self.headers.items()}
                ok = bool(receiver.posts)
                receiver.posts.append((headers, body, ok))
                self.send_response(200 if ok else 500)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hooks"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def events(self) -> list[Any]:
        """The events delivered (answered 200), each verified and read by OpenAI's SDK."""
        reader = openai.OpenAI(api_key="unused", webhook_secret=SECRET)
        return [reader.webhooks.unwrap(body, headers) for headers, body, ok in list(self.posts) if ok]

    def of(self, object_id: str) -> list[Any]:
        return [e for e in self.events() if e.data.id == object_id]
