"""A real ``redis-server`` per test module (or per test, for the ones that kill it)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

import pytest

REDIS_SERVER = shutil.which("redis-server")
SKIP_REASON = ("redis-server is not on PATH: install the Debian package redis-server "
               "(.ci/run does) to run the redis tier against a real server")
START_TIMEOUT = 20.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1, without persistence, in ``workdir``."""

    def __init__(self, workdir, *config: str, port: int | None = None) -> None:
        self.workdir = str(workdir)
        self.config = config
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        os.makedirs(self.workdir, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        log = open(os.path.join(self.workdir, "redis.log"), "ab")
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.workdir, "--daemonize", "no", "--protected-mode", "no", *self.config],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT
        while True:  # ready once it accepts a connection and answers PING (or asks for the password)
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith((b"+PONG", b"-NOAUTH")):
                        return self
            except OSError:
                pass
            try:  # waits for the process to die, a few ms at most, between attempts
                code = self.proc.wait(timeout=0.02)
            except subprocess.TimeoutExpired:
                code = None
            if code is not None:
                raise RuntimeError(f"redis-server exited with {code} at start: {self.log()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not answer within {START_TIMEOUT} s: {self.log()}")

    def log(self) -> str:
        try:
            with open(os.path.join(self.workdir, "redis.log"), errors="replace") as f:
                return f.read()[-2000:]
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a paused server dies too
            self.proc.kill()
            self.proc.wait(timeout=10)

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def client(self):
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=5)


def start_server(workdir, *config: str, port: int | None = None) -> RedisServer:
    if REDIS_SERVER is None:
        pytest.skip(SKIP_REASON)
    return RedisServer(workdir, *config, port=port).start()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("redis"))
    yield server
    server.kill()


@pytest.fixture
def own_redis_server(tmp_path):
    """A server for one test, which may kill, pause or reconfigure it."""
    servers: list[RedisServer] = []

    def start(*config: str, port: int | None = None) -> RedisServer:
        server = start_server(tmp_path / f"redis{len(servers)}", *config, port=port)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.kill()
