"""Fixtures that run real server processes on free ports."""

from __future__ import annotations

import os
import sys

import pytest

# the repository's shared test helpers (tiny checkpoints, cli_guard) live in tests/
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from serverproc import API_KEY, start_server


@pytest.fixture(scope="session")
def server():
    """One server for the read-mostly tests: API key, CORS for one origin, a small body limit,
    the hermes tool-call parser (tool_choice auto; requests without tools are unaffected)."""
    sp = start_server("--cors-origins", "http://allowed.example", "--max-payload-size", "200000",
                      "--tool-call-parser", "hermes", api_key=API_KEY, module=True)
    yield sp
    code = sp.stop()
    assert code == 0, f"server exited with {code}:\n{sp.log()}"


@pytest.fixture()
def idle_after(server):
    """Run the test, then check the server's engine went back to idle with nothing leaked."""
    yield server
    server.wait_idle()
