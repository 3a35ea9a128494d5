"""The console as a WSGI application: the pages, ``/api/status`` (the document itself, as ``gpucoord status
--json`` prints it) and ``/api/events``, a Server-Sent Events stream per open page.

The stream sends, as they come, each event of the feed (``event: fleet``, one JSON object) and the page's
``<main>`` rendered again whenever it changed (``event: view``, ``{"html": ...}``); the page's script swaps
it in, so a page follows the fleet without reload. Read-only: every method but GET and HEAD is 405.
"""
from __future__ import annotations

import asyncio
import importlib.resources
import json
import urllib.parse
from typing import Any, Callable, Coroutine, Iterable, Iterator

from coordinator.web import pages
from coordinator.web.events import Doc, Feed

StartResponse = Callable[..., Any]
READ_TIMEOUT_S = 10.0
KEEPALIVE_S = 10.0    # a comment on an idle stream: a closed page's stream ends at the next write
STATIC = {"console.js": "text/javascript; charset=utf-8", "console.css": "text/css; charset=utf-8"}


def _sse(kind: str, data: object) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class Console:
    """``read``: the status document, fresh (raises when it cannot be had)."""

    def __init__(self, read: Callable[[], Doc], feed: Feed | None = None) -> None:
        self.read = read
        self.feed = feed if feed is not None else Feed(read)

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "") or "/"
        if environ.get("REQUEST_METHOD", "GET") not in ("GET", "HEAD"):
            return self._plain(start_response, "405 Method Not Allowed", "the console is read-only\n")
        query = urllib.parse.parse_qs(environ.get("QUERY_STRING", ""))
        if path.startswith("/static/"):
            return self._static(start_response, path[len("/static/"):])
        if path == "/api/status":
            try:
                body = json.dumps(self.read(), indent=2).encode()
            except Exception as e:  # noqa: BLE001 - any failure of the read is the answer, as one line
                return self._plain(start_response, "503 Service Unavailable", f"status: {e}\n")
            return self._send(start_response, "200 OK", "application/json", body)
        if path == "/api/events":
            view = query.get("view", ["/"])[0]
            after = query.get("after", ["0"])[0]
            start_response("200 OK", [("Content-Type", "text/event-stream"), ("Cache-Control", "no-store")])
            return self._stream(view, int(after) if after.isdigit() else 0)
        try:
            doc, error = self.read(), ""
        except Exception as e:  # noqa: BLE001 - any failure of the read is shown on the page
            doc, error = None, str(e) or type(e).__name__
        events = self.feed.events()
        inner = pages.main(path, doc, error, events)
        if inner is None:
            return self._plain(start_response, "404 Not Found", f"no such page: {path}\n")
        return self._send(start_response, "200 OK", "text/html; charset=utf-8",
                          pages.layout(path, inner, events).encode())

    def _stream(self, view: str, after: int) -> Iterator[bytes]:
        with self.feed.watching():
            yield b"retry: 1000\n\n"
            version, sent = 0, None
            while True:
                newer = self.feed.wait_past(version, KEEPALIVE_S)
                if newer == version:
                    yield b": idle\n\n"
                    continue
                version = newer
                for event in self.feed.events(after):
                    after = event["seq"]
                    yield _sse("fleet", {**event, "html": pages.event_item(event)})
                inner = pages.main(view, self.feed.doc, self.feed.error, self.feed.events())
                if inner != sent:
                    sent = inner
                    yield _sse("view", {"html": inner or "<h1>Gone</h1>", "version": version})

    @staticmethod
    def _static(start_response: StartResponse, name: str) -> Iterable[bytes]:
        if name not in STATIC:
            return Console._plain(start_response, "404 Not Found", f"no such file: {name}\n")
        body = importlib.resources.files("coordinator.web").joinpath("static", name).read_bytes()
        return Console._send(start_response, "200 OK", STATIC[name], body)

    @staticmethod
    def _send(start_response: StartResponse, status: str, kind: str, body: bytes) -> list[bytes]:
        start_response(status, [("Content-Type", kind), ("Content-Length", str(len(body))),
                                ("Cache-Control", "no-store")])
        return [body]

    @staticmethod
    def _plain(start_response: StartResponse, status: str, text: str) -> list[bytes]:
        return Console._send(start_response, status, "text/plain; charset=utf-8", text.encode())


def console_app(doc: Callable[[], Coroutine[Any, Any, Doc]], loop: asyncio.AbstractEventLoop) -> Console:
    """The console of a coordinator whose event loop is ``loop``; ``doc``: its status document (a coroutine
    run on that loop from the HTTP server's threads)."""
    def read() -> Doc:
        return asyncio.run_coroutine_threadsafe(doc(), loop).result(READ_TIMEOUT_S)
    return Console(read)


__all__ = ["Console", "console_app"]
