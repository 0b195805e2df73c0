"""The prefill server's bootstrap endpoint, and what a decode server asks it.

A request routed for disaggregation reaches both servers at once with the same
``bootstrap_room`` (SGLang's router picks a random 63-bit room) and the prefill server's
``bootstrap_host`` / ``bootstrap_port``. The decode server sets pages aside for the prompt and
registers them here (``POST /register``: each of its ranks' transfer engine address and KV
pool layout, the slots of the prompt's tokens, the same on every rank); the prefill server
computes the prompt, its ranks write their KV heads into those slots, and it marks the room
done with the first token and a checksum per piece of the KV, which the
decode server reads with ``GET /status?room=R&wait=S`` (a long poll: the answer comes when the
room's state changes or after ``S`` seconds). HTTP with JSON bodies, one thread per
connection (Python's ``ThreadingHTTPServer``); the scheduler only reads and writes the
:class:`Room` table under its lock.

Errors a decode server gets: 400 for a malformed body or a room registered twice (a reused
room), 404 for an unknown path; ``status`` of a room the prefill server has not heard of is
``unknown`` (its copy of the request may still be on the way), and the decode server gives
up after its transfer timeout.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from radixserve.disaggregation.transfer import TransferError

logger = logging.getLogger(__name__)

WAITING, DONE, FAILED, UNKNOWN = "waiting", "done", "failed", "unknown"


@dataclass
class Room:
    room: int
    registration: dict[str, Any] | None = None  # the decode side's ranks (address, layout) and slots
    state: str = WAITING
    result: dict[str, Any] = field(default_factory=dict)  # done: first token, checksum; failed: message
    finished_at: float | None = None


class BootstrapServer:
    """The room table and its HTTP endpoint (prefill servers)."""

    def __init__(self, host: str, port: int, info: dict[str, Any], keep_seconds: float = 60.0) -> None:
        self.info = info  # answered by GET /health (role, tensor parallel size, every rank's pool layout)
        self.keep_seconds = keep_seconds  # how long a finished room stays readable
        self.rooms: dict[int, Room] = {}
        self.lock = threading.Condition()
        self.on_register = None  # called (no arguments) when a decode server registers: wakes the scheduler
        handler = type("Handler", (_Handler,), {"bootstrap": self})
        try:
            self.httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as e:
            raise TransferError(f"--disaggregation-bootstrap-port {port}: cannot listen on {host}:{port}: {e}") from e
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="disagg-bootstrap", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the scheduler's side
    def room(self, room: int) -> Room:
        """The room's record (created if new); call under ``lock``."""
        rec = self.rooms.get(room)
        if rec is None:
            rec = self.rooms[room] = Room(room)
        return rec

    def finish(self, room: int, state: str, **result: Any) -> None:
        with self.lock:
            rec = self.room(room)
            rec.state, rec.result, rec.finished_at = state, result, time.monotonic()
            self.lock.notify_all()
            self._forget_old()

    def _forget_old(self) -> None:
        now = time.monotonic()
        for key in [k for k, r in self.rooms.items() if r.finished_at is not None
                    and now - r.finished_at > self.keep_seconds]:
            del self.rooms[key]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # ------------------------------------------------------------ the endpoint's side
    def register(self, body: dict[str, Any]) -> tuple[int, dict]:
        try:
            room = int(body["room"])
            reg = {"ranks": [{"address": str(r["address"]), "layout": dict(r["layout"])} for r in body["ranks"]],
                   "slots": [int(s) for s in body["slots"]]}
            if not reg["ranks"]:
                raise ValueError("no ranks")
        except (KeyError, TypeError, ValueError) as e:
            return 400, {"error": f"bad registration: {type(e).__name__}: {e}"}
        with self.lock:
            rec = self.room(room)
            if rec.registration is not None or rec.state != WAITING:
                return 400, {"error": f"bootstrap room {room} is already registered (a room serves one request)"}
            rec.registration = reg
            self.lock.notify_all()
        if self.on_register is not None:
            self.on_register()
        return 200, {"ok": True}

    def cancel(self, body: dict[str, Any]) -> tuple[int, dict]:
        """The decode server gave up on a room: never send its KV (a write already in flight
        may still land; the decode server keeps those pages aside for a while)."""
        try:
            room = int(body["room"])
        except (KeyError, TypeError, ValueError) as e:
            return 400, {"error": f"bad cancel: {type(e).__name__}: {e}"}
        with self.lock:
            rec = self.room(room)
            if rec.state == WAITING:
                rec.state, rec.result = FAILED, {"message": "cancelled by the decode server"}
                rec.finished_at = time.monotonic()
                self.lock.notify_all()
        if self.on_register is not None:
            self.on_register()
        return 200, {"ok": True}

    def status(self, room: int, wait: float) -> dict[str, Any]:
        deadline = time.monotonic() + max(0.0, min(wait, 30.0))
        with self.lock:
            while True:
                rec = self.rooms.get(room)
                state = UNKNOWN if rec is None else rec.state
                if state in (DONE, FAILED):
                    return {"state": state, **rec.result}
                left = deadline - time.monotonic()
                if left <= 0:
                    return {"state": state}
                self.lock.wait(left)


class _Handler(BaseHTTPRequestHandler):
    bootstrap: BootstrapServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        logger.debug("bootstrap: " + format, *args)

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - the base class's name
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        if url.path == "/health":
            self._send(200, self.bootstrap.info)
        elif url.path == "/status":
            try:
                room, wait = int(query["room"][0]), float(query.get("wait", ["0"])[0])
            except (KeyError, ValueError):
                self._send(400, {"error": "status needs ?room=<integer>[&wait=<seconds>]"})
                return
            self._send(200, self.bootstrap.status(room, wait))
        else:
            self._send(404, {"error": f"no such path {url.path}"})

    def do_POST(self) -> None:  # noqa: N802
        action = {"/register": self.bootstrap.register, "/cancel": self.bootstrap.cancel}.get(self.path)
        if action is None:
            self._send(404, {"error": f"no such path {self.path}"})
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
        except (ValueError, json.JSONDecodeError) as e:
            self._send(400, {"error": f"not JSON: {e}"})
            return
        self._send(*action(body if isinstance(body, dict) else {}))


def _call(url: str, body: dict | None, timeout: float) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read()).get("error", str(e))
        except ValueError:
            message = str(e)
        raise TransferError(f"bootstrap {url}: {e.code} {message}") from e
    except (OSError, ValueError) as e:
        raise TransferError(f"bootstrap {url}: {e}") from e


def endpoint(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def register(host: str, port: int, body: dict, timeout: float) -> None:
    """Register a request's KV destination with a prefill server (TransferError if refused)."""
    _call(f"{endpoint(host, port)}/register", body, timeout)


def cancel(host: str, port: int, room: int, timeout: float) -> None:
    """Tell a prefill server not to send a room's KV any more."""
    _call(f"{endpoint(host, port)}/cancel", {"room": room}, timeout)


def status(host: str, port: int, room: int, wait: float, timeout: float) -> dict:
    """A room's state (long poll up to ``wait`` seconds)."""
    return _call(f"{endpoint(host, port)}/status?room={room}&wait={wait}", None, timeout + wait)
