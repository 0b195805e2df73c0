"""A server shared by many users: keys kept secret, admin routes behind their own key, state
changes by POST only, and connections that cannot be held open by a half-sent request.

One server runs with its API key from ``RADIXSERVE_API_KEY`` (not on its command line), the
admin key from ``--admin-api-key-file``, a Redis URL with a password in
``--hicache-storage-url``, short header and body timeouts and a small connection limit.
"""

from __future__ import annotations

import os
import socket
import time

import httpx
import pytest
from cli_guard import run_without_loading
from radixserve.config import ConfigError
from radixserve_server.http_args import ADMIN_PATHS, resolve_key
from serverproc import start_server

KEY = "user-key-9f2c"
ADMIN_KEY = "admin-key-41d7"
PASSWORD = "redis-pw-77ae"
HEADER_TIMEOUT = BODY_TIMEOUT = 2.0
MAX_CONNECTIONS = 6
POST_ONLY = sorted(ADMIN_PATHS | {"/open_session", "/close_session"})


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    admin_file = tmp_path_factory.mktemp("keys") / "admin.key"
    admin_file.write_text(ADMIN_KEY + "\n")
    sp = start_server("--admin-api-key-file", str(admin_file),
                      "--hicache-storage-url", f"redis://radix:{PASSWORD}@127.0.0.1:1/0",
                      "--http-header-timeout", str(HEADER_TIMEOUT), "--http-body-timeout", str(BODY_TIMEOUT),
                      "--max-connections", str(MAX_CONNECTIONS), env={"RADIXSERVE_API_KEY": KEY})
    sp.api_key = KEY
    yield sp
    assert sp.stop() == 0, sp.log()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# ---------------------------------------------------------------- secrets
def test_server_info_and_logs_hide_every_secret(keyed):
    with keyed.client() as c:
        r = c.get("/get_server_info")
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["server_args"]["hicache_storage_url"] == "redis://***@127.0.0.1:1/0"
    assert info["http_args"]["api_key"] == "***" and info["http_args"]["admin_api_key"] == "***"
    for secret in (PASSWORD, KEY, ADMIN_KEY, "radix:"):
        assert secret not in r.text, secret
    with open(keyed.log_path, errors="replace") as fh:
        log = fh.read()
    assert PASSWORD not in log and KEY not in log and ADMIN_KEY not in log
    with open(f"/proc/{keyed.proc.pid}/cmdline", "rb") as fh:  # what ps shows
        cmdline = fh.read().decode()
    assert KEY not in cmdline and ADMIN_KEY not in cmdline


def test_the_key_from_the_environment_is_enforced(keyed):
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 1}}
    assert httpx.post(keyed.url + "/generate", json=body, timeout=60).status_code == 401
    assert httpx.post(keyed.url + "/generate", json=body, headers=auth(KEY), timeout=60).status_code == 200


def test_admin_routes_take_the_admin_key_only(keyed):
    assert httpx.post(keyed.url + "/flush_cache", headers=auth(KEY), timeout=60).status_code == 401
    r = httpx.post(keyed.url + "/flush_cache", headers=auth(ADMIN_KEY), timeout=60)
    assert r.status_code == 200 and r.json()["success"], r.text
    r = httpx.post(keyed.url + "/abort_request", json={"abort_all": True}, headers=auth(KEY), timeout=60)
    assert r.status_code == 401 and "--admin-api-key" in r.json()["error"]["message"]
    assert httpx.post(keyed.url + "/abort_request", json={"abort_all": True}, headers=auth(ADMIN_KEY),
                      timeout=60).status_code == 200
    # the admin key is not a user key
    assert httpx.get(keyed.url + "/v1/models", headers=auth(ADMIN_KEY), timeout=60).status_code == 401


def test_health_generate_takes_the_key(keyed):
    assert httpx.get(keyed.url + "/health_generate", timeout=60).status_code == 401
    assert httpx.get(keyed.url + "/health_generate", headers=auth(KEY), timeout=60).status_code == 200
    assert httpx.get(keyed.url + "/health", timeout=60).status_code == 200  # probes stay open


@pytest.mark.parametrize("path", POST_ONLY)
def test_state_changing_routes_refuse_get(keyed, path):
    key = ADMIN_KEY if path in ADMIN_PATHS else KEY
    r = httpx.get(keyed.url + path, headers=auth(key), timeout=60)
    assert r.status_code == 405, r.text
    assert r.json()["error"]["message"] == f"{path} does not take GET"


# ------------------------------------------------------------ connections
def wait_closed(sock: socket.socket, limit: float) -> float:
    """Seconds until the server closed ``sock`` (it reads EOF or a reset), at most ``limit``."""
    start = time.monotonic()
    sock.settimeout(limit)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"the server kept the connection open for {limit} s") from None
    return time.monotonic() - start


@pytest.mark.parametrize("sent, timeout", [
    (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n", HEADER_TIMEOUT),
    (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 200\r\n"
     b"Authorization: Bearer " + KEY.encode() + b"\r\n\r\n{\"text\": \"Hi\", ", BODY_TIMEOUT),
], ids=["half-headers", "half-body"])
def test_a_half_sent_request_is_closed_after_its_timeout(keyed, sent, timeout):
    with socket.create_connection(("127.0.0.1", keyed.port)) as sock:
        sock.sendall(sent)
        waited = wait_closed(sock, timeout + 20)
    assert timeout - 0.5 <= waited <= timeout + 15, waited
    with keyed.client() as c:  # and the server serves on
        assert c.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 1}}).status_code == 200


def test_trickled_headers_do_not_extend_the_deadline(keyed):
    with socket.create_connection(("127.0.0.1", keyed.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        start = time.monotonic()
        sock.settimeout(0.5)
        closed = False
        while time.monotonic() - start < HEADER_TIMEOUT + 15 and not closed:
            try:
                sock.sendall(b"X-Slow: 1\r\n")
                closed = sock.recv(1) == b""
            except TimeoutError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                closed = True
        assert closed and time.monotonic() - start <= HEADER_TIMEOUT + 15


def test_connections_over_the_limit_get_503(keyed):
    socks = [socket.create_connection(("127.0.0.1", keyed.port)) for _ in range(MAX_CONNECTIONS)]
    try:
        for s in socks:
            s.sendall(b"GET /health HTTP/1.1\r\n")  # half a request each: they hold their connections
        deadline = time.monotonic() + HEADER_TIMEOUT  # until the server has accepted all of them
        while (status := httpx.get(keyed.url + "/health", timeout=10).status_code) != 503:
            assert status == 200 and time.monotonic() < deadline, status
    finally:
        for s in socks:
            s.close()
    deadline = time.monotonic() + 30
    while httpx.get(keyed.url + "/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the closed connections were never let go"


# ------------------------------------------------------------ no server
def test_key_precedence_flag_then_file_then_environment(tmp_path, monkeypatch):
    path = tmp_path / "key"
    path.write_text("from-file\nsecond line\n")
    monkeypatch.setenv("RADIXSERVE_API_KEY", "from-env")
    assert resolve_key("from-flag", None, "RADIXSERVE_API_KEY", "--api-key") == "from-flag"
    assert resolve_key(None, str(path), "RADIXSERVE_API_KEY", "--api-key") == "from-file"
    assert resolve_key(None, None, "RADIXSERVE_API_KEY", "--api-key") == "from-env"
    monkeypatch.delenv("RADIXSERVE_API_KEY")
    assert resolve_key(None, None, "RADIXSERVE_API_KEY", "--api-key") is None
    with pytest.raises(ConfigError, match="--api-key or --api-key-file, not both"):
        resolve_key("k", str(path), "RADIXSERVE_API_KEY", "--api-key")


@pytest.mark.parametrize("argv, message", [
    (["--api-key-file", "/no/such/key"], "--api-key-file: cannot read /no/such/key"),
    (["--admin-api-key-file", os.devnull], "--admin-api-key-file: /dev/null holds no key"),
    (["--http-header-timeout", "-1"], "--http-header-timeout must be >= 0"),
    (["--max-connections", "-5"], "--max-connections must be >= 0"),
])
def test_bad_key_and_limit_flags(argv, message):
    r = run_without_loading("serve", *argv)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr, r.stderr
