"""SGLang's sessions: a request continues an earlier one without resending its tokens.

``POST /open_session`` opens one (``{"capacity_of_str_len": N, "session_id": optional}``;
answers the session id), ``POST /close_session`` (``{"session_id"}``) closes it. A
``/generate`` request with ``session_params: {"id", "rid", "offset", "replace",
"drop_previous_output"}`` runs on the token ids of the session's request ``rid`` (its prompt
and output; ``drop_previous_output``: its prompt only), cut to the first ``offset`` tokens
when ``offset`` is given, followed by its own prompt (a leading BOS token dropped). Without
``rid`` it starts from nothing. ``replace: true`` forgets the requests that continued
``rid`` (all of the session's, without ``rid``) before this one runs. A request may continue
only a finished request of its session, and the session runs one request at a time.
The radix cache makes the continued prefix a cache hit, so nothing is recomputed.

Sessions live in the HTTP server's memory (token ids only, no KV of their own) until
closed; an engine restart does not lose them.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from radixserve_server.protocol import APIError

MAX_SESSIONS = 4096


@dataclass
class _Turn:
    ids: list[int]  # prompt and output
    prompt_len: int
    parent: str | None
    children: list[str] = field(default_factory=list)


class Session:
    def __init__(self, sid: str) -> None:
        self.sid = sid
        self.turns: dict[str, _Turn] = {}
        self.busy: str | None = None  # the rid now running

    # -- one request: resolve -> prompt -> start -> (finish) -> end
    def bind(self, params: dict[str, Any], running) -> _Binding:
        rid = params.get("rid")
        offset = params.get("offset")
        for name, value, kind in (("rid", rid, str), ("offset", offset, int)):
            if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
                raise APIError(400, f"session_params.{name} must be a {kind.__name__}", param=f"session_params.{name}")
        if self.busy is not None and self.busy not in running:
            self.busy = None  # its stream never started, so nothing ended it
        if self.busy is not None:
            raise APIError(400, f"session {self.sid!r} is running request {self.busy!r}; a session runs one "
                           "request at a time", param="session_params.id")
        if rid is not None and rid not in self.turns:
            raise APIError(400, f"session_params.rid: no finished request {rid!r} in session {self.sid!r}",
                           param="session_params.rid")
        return _Binding(self, rid, offset, bool(params.get("replace")), bool(params.get("drop_previous_output")))

    def _forget(self, rid: str) -> None:
        turn = self.turns.pop(rid, None)
        for child in turn.children if turn else ():
            self._forget(child)


@dataclass
class _Binding:
    session: Session
    rid: str | None
    offset: int | None
    replace: bool
    drop_previous_output: bool
    running: str | None = None
    prompt_len: int = 0
    ids: list[int] = field(default_factory=list)

    def prompt(self, new_ids: list[int], bos: int | None) -> list[int]:
        """The request's token ids: the continued history, then its own (less a leading BOS)."""
        if self.rid is None:
            base: list[int] = []
        else:
            turn = self.session.turns[self.rid]
            base = turn.ids[:turn.prompt_len] if self.drop_previous_output else list(turn.ids)
            if new_ids and bos is not None and new_ids[0] == bos:
                new_ids = new_ids[1:]
        if self.offset:
            base = base[:self.offset]
        ids = base + new_ids
        if not ids:
            raise APIError(400, "a session request needs tokens after its history", param="text")
        self.prompt_len = len(ids)
        return ids

    def start(self, spec) -> None:
        s = self.session
        if s.busy is not None:
            raise APIError(400, f"session {s.sid!r} is running request {s.busy!r}", param="session_params.id")
        if self.replace:
            for child in (s.turns[self.rid].children if self.rid is not None else list(s.turns)):
                s._forget(child)
            if self.rid is not None:
                s.turns[self.rid].children.clear()
        self.running = spec.rid
        self.ids = list(spec.input_ids)
        s.busy = spec.rid

    def finish(self, result) -> None:
        """Keep a finished request (prompt and output) for later requests to continue."""
        reason = result.finish_reason or {}
        if self.running is None or reason.get("type") == "abort":
            return
        s = self.session
        s.turns[self.running] = _Turn(self.ids + list(result.ids), self.prompt_len, self.rid)
        if self.rid is not None and self.rid in s.turns:
            s.turns[self.rid].children.append(self.running)

    def end(self) -> None:
        if self.session.busy == self.running:
            self.session.busy = None
        self.running = None


class Sessions:
    def __init__(self) -> None:
        self._open: dict[str, Session] = {}

    def open(self, sid: str | None = None) -> str:
        sid = sid or uuid.uuid4().hex
        if sid in self._open:
            raise APIError(400, f"session {sid!r} is already open", param="session_id")
        if len(self._open) >= MAX_SESSIONS:
            raise APIError(429, f"{MAX_SESSIONS} sessions are open; close one first")
        self._open[sid] = Session(sid)
        return sid

    def close(self, sid: str) -> None:
        if self._open.pop(sid, None) is None:
            raise APIError(400, f"no open session {sid!r}", param="session_id")

    def resolve(self, params: dict[str, Any], count: int, ns: list[int], running) -> _Binding:
        """A request's ``session_params``: one prompt, n = 1, an open session; ``running``
        holds the ids of the requests in flight."""
        if count != 1 or any(n != 1 for n in ns):
            raise APIError(400, "a session request takes one prompt with n = 1", param="session_params")
        sid = params.get("id")
        session = self._open.get(sid) if isinstance(sid, str) else None
        if session is None:
            raise APIError(400, f"session_params.id: no open session {sid!r} (open one with /open_session)",
                           param="session_params.id")
        return session.bind(params, running)
