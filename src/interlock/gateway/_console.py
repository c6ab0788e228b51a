"""The operator console: web pages over the gateway's service, at ``/console``.

A person sees every run (filtered, counted, paged, searched), reads a run's timeline
grouped into steps, its conversation and its place in the machine, works the escalation
queue (resume in a state or with a corrected proposal the gate checks first, abort with a
note) and replays a run, from a browser. Pages are rendered here (no JavaScript toolchain,
nothing fetched from elsewhere); a small script of the package's own refreshes them from
Server-Sent Events as the journal grows, and every action is a plain form without it.

Who may do what is the gateway's: the same keys and roles (a read role to look, the
operator role to act, each key's machines). A browser signs in once with its key, kept in
an ``HttpOnly``, ``SameSite=Strict`` cookie for ``/console``; a script may send
``Authorization: Bearer`` as to the API. Every form carries a token derived from the key
(a page of another site can neither read nor forge it), on top of the guard's refusal of
requests from other origins. A gateway without keys (loopback only) lets everyone in.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import math
import os
import secrets
import time
import urllib.parse
from collections import Counter
from datetime import UTC, datetime
from importlib import resources
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from ..core._conversation import conversation, offered_tools
from ..core._escalation import resume_targets
from ..core._events import Escalated, ModelCalled, Transitioned, whole_prompts
from ..core._exceptions import RunNotFound, StoreDamaged
from ..core._view import fold
from ..core._wire import ONE_CALL
from ..protocol import AbortIn, ResumeIn
from ..runtime._replay import replay_run
from . import _console_html as ui
from ._console_html import h
from ._keys import ANONYMOUS, KeyRing, Principal, Unauthorized
from ._service import GatewayError, GatewayService

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from ..stores import RunRecord
    from ._app import Receive, Scope, Send

__all__ = ["PAGE_SIZE", "ConsoleApp"]

log = logging.getLogger("interlock.console")

#: A link to a run's trace in the tracing backend, ``{trace_id}`` replaced by its id (e.g.
#: ``http://127.0.0.1:16686/trace/{trace_id}`` for Jaeger).
TRACE_URL_ENV = "INTERLOCK_TRACE_URL"
#: Runs per page of the list.
PAGE_SIZE = 50
#: Runs per page of the escalation queue (each with its forms).
QUEUE_PAGE_SIZE = 20
#: The cookie that holds a signed-in browser's key.
COOKIE = "interlock_console"
#: The largest form the console reads (a corrected proposal fits many times over).
MAX_FORM = 1 << 20
#: How long the runs index is reused after this process wrote the journal: a busy gateway
#: writes all the time, and reading a large index again on each page would cost every page
#: (0.5 s at 100,000 runs); an operator's own action refreshes it at once.
INDEX_TTL = 1.0
#: How long the runs index is reused when other processes write the journal too.
SHARED_INDEX_TTL = 2.0
_CURRENT = ' aria-current="true"'
_OUTCOMES = ("running", "escalated", "completed", "failed")
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
_STATIC = {"console.css": "text/css; charset=utf-8", "console.js": "text/javascript; charset=utf-8"}


class _Page(Exception):
    """An answer decided partway (a redirect, a refusal as a page)."""

    def __init__(self, status: int, body: str = "", headers: Sequence[tuple[str, str]] = ()):
        super().__init__(status)
        self.status = status
        self.body = body
        self.headers = list(headers)


class _Req:
    __slots__ = ("cookie", "form", "headers", "method", "path", "principal", "query", "token")

    def __init__(self, scope: Scope) -> None:
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.headers = {
            k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]
        }
        raw = scope.get("query_string", b"").decode("latin-1")
        self.query = {
            k: v[-1] for k, v in urllib.parse.parse_qs(raw, keep_blank_values=True).items()
        }
        self.cookie = ""
        for part in self.headers.get("cookie", "").split(";"):
            name, _, value = part.strip().partition("=")
            if name == COOKIE:
                self.cookie = urllib.parse.unquote(value)
        self.form: dict[str, str] = {}
        self.principal: Principal | None = None
        self.token = ""

    def arg(self, name: str) -> str:
        return self.query.get(name, "").strip()


class ConsoleApp:
    """The console's ASGI app, over the gateway's service and keys.

    Args:
      service: the gateway's service (its supervisor's store and machines).
      keyring: the gateway's keys; open: everyone is let in (a loopback server).
      prices: USD per million tokens by model, for the cost of each model call.
    """

    def __init__(
        self,
        service: GatewayService,
        keyring: KeyRing,
        prices: Mapping[str, tuple[float, float]] | None = None,
    ) -> None:
        self.service = service
        self.keyring = keyring
        self.prices = dict(prices or {})
        self._secret = secrets.token_bytes(32)
        self._index: tuple[float, list[RunRecord]] | None = None
        self._dirty = False
        self._index_lock = trio.Lock()
        self.changed = trio.Event()
        """Set (and replaced) whenever this process makes journal events durable."""
        self._static: dict[str, bytes] = {}
        self.streams: set[trio.CancelScope] = set()
        """The live streams open now: a draining gateway cancels them."""
        service.supervisor.on_written.append(self._written)

    def _written(self, events: Sequence[Any]) -> None:
        # NOTE: on the journal's write path, every batch: a flag, and an event only
        # while a live page listens
        self._dirty = True
        if self.streams:
            self.changed.set()
            self.changed = trio.Event()

    # -- the ASGI entry -------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = _Req(scope)
        try:
            if req.method == "POST":
                req.form = await _read_form(receive, req.headers.get("content-type", ""))
            status, body, headers = await self._route(req, send)
        except _Page as page:
            status, body, headers = page.status, page.body, page.headers
        except GatewayError as exc:
            status, body, headers = exc.status, self._error_page(req, exc.title, exc.detail), []
        except StoreDamaged as exc:
            status, headers = 500, []
            body = self._error_page(req, "Store damaged", f"{exc}; run 'interlock check'")
        except Exception as exc:  # a bug: this page fails, with what to report; no run does
            log.exception("the console failed answering %s %s", req.method, req.path)
            status, headers = 500, []
            body = self._error_page(
                req,
                "Internal error",
                f"a bug in interlock's console: {type(exc).__name__}: "
                f"{exc}; the journal is intact; report it",
            )
        if status == 0:  # streamed
            return
        data = body.encode() if isinstance(body, str) else body
        kind = next((v for k, v in headers if k == "content-type"), "text/html; charset=utf-8")
        out = [
            (b"content-type", kind.encode()),
            (b"content-length", str(len(data)).encode()),
            (b"content-security-policy", _CSP.encode()),
            (b"x-content-type-options", b"nosniff"),
            (b"referrer-policy", b"same-origin"),
            (b"x-frame-options", b"DENY"),
        ]
        if not any(k == "cache-control" for k, _ in headers):
            out.append((b"cache-control", b"no-store"))
        out.extend((k.encode(), v.encode("latin-1")) for k, v in headers if k != "content-type")
        await send({"type": "http.response.start", "status": status, "headers": out})
        await send({"type": "http.response.body", "body": b"" if req.method == "HEAD" else data})

    async def _route(self, req: _Req, send: Send) -> tuple[int, str | bytes, list[tuple[str, str]]]:
        path = req.path.rstrip("/") or "/"
        method = "GET" if req.method == "HEAD" else req.method
        parts = path.split("/")[2:]  # after "/console"
        if path == "/console":
            return _redirect("/console/runs")
        if parts[:1] == ["static"] and len(parts) == 2 and method == "GET":
            return self._file(parts[1])
        if parts == ["login"]:
            if method == "POST":
                return self._login(req)
            return 200, self._login_page(req.arg("next")), []
        self._authenticate(req)
        if parts == ["logout"] and method == "POST":
            self._check_csrf(req)
            return _redirect("/console/login", [("set-cookie", _cookie("", req, 0))])
        if parts == ["runs"] and method == "GET":
            return 200, await self._runs(req), []
        if parts == ["escalations"] and method == "GET":
            return 200, await self._queue(req), []
        if parts == ["live"] and method == "GET":
            return await self._live(req, send)
        if len(parts) >= 2 and parts[0] == "runs":
            run_id = urllib.parse.unquote(parts[1])
            rest = parts[2:]
            if not rest and method == "GET":
                return 200, await self._run(req, run_id), []
            if rest == ["replay"] and method == "GET":
                return 200, await self._run(req, run_id, replay=True), []
            if rest == ["live"] and method == "GET":
                return await self._run_live(req, run_id, send)
            if rest in (["resume"], ["abort"]) and method == "POST":
                return await self._act(req, run_id, rest[0])
        if method not in ("GET", "POST"):
            raise _Page(
                405,
                self._error_page(
                    req,
                    "Method not allowed",
                    f"{req.method} is not served here; the console takes GET and its forms POST",
                ),
                [("allow", "GET, POST")],
            )
        raise _Page(
            404,
            self._error_page(
                req,
                "Not found",
                f"there is no console page at {req.path[:200]}; start at /console/runs",
            ),
        )

    # -- keys -----------------------------------------------------------------------

    def _authenticate(self, req: _Req) -> None:
        if self.keyring.open:
            req.principal = ANONYMOUS
            req.token = hmac.new(self._secret, b"csrf", hashlib.sha256).hexdigest()[:32]
            return
        authorization = req.headers.get("authorization")
        key = ""
        if authorization is None and req.cookie:
            key = req.cookie
            authorization = f"Bearer {key}"
        elif authorization is not None:
            key = authorization.partition(" ")[2].strip()
        if authorization is None:
            self._sign_in_first(req, "")
        try:
            req.principal = self.keyring.authenticate(authorization)
        except Unauthorized as exc:
            self._sign_in_first(req, str(exc))
        req.token = _csrf(key)

    def _sign_in_first(self, req: _Req, problem: str) -> None:
        if req.path.endswith("/live") or req.method != "GET":
            raise _Page(
                401,
                self._error_page(
                    req,
                    "Sign in",
                    "this page needs a key: sign in "
                    "at /console/login" + (f" ({problem})" if problem else ""),
                ),
                [("set-cookie", _cookie("", req, 0))] if req.cookie else [],
            )
        target = req.path + (("?" + urllib.parse.urlencode(req.query)) if req.query else "")
        headers = [("set-cookie", _cookie("", req, 0))] if req.cookie else []
        raise _Page(401, self._login_page(target, problem), headers)

    def _check_csrf(self, req: _Req) -> None:
        if not req.token or not hmac.compare_digest(req.form.get("csrf", ""), req.token):
            raise _Page(
                403,
                self._error_page(
                    req,
                    "Form refused",
                    "the form's token does not "
                    "match your sign-in (a stale page, or a form from another site); "
                    "reload the page and try again",
                ),
            )

    def _login(self, req: _Req) -> tuple[int, str, list[tuple[str, str]]]:
        key = req.form.get("key", "").strip()
        target = req.form.get("next", "")
        if not target.startswith("/console/") or target.startswith("//"):
            target = "/console/runs"
        if self.keyring.open:
            return _redirect(target)
        try:
            principal = self.keyring.authenticate(f"Bearer {key}")
        except Unauthorized as exc:
            return 401, self._login_page(target, f"that key was refused: {exc}"), []
        del principal
        return _redirect(target, [("set-cookie", _cookie(key, req, 12 * 3600))])

    def _login_page(self, target: str, problem: str = "") -> str:
        if not target.startswith("/console/"):
            target = "/console/runs"
        error = f'<div class="notice error" role="alert">{h(problem)}</div>' if problem else ""
        body = (
            f"<h1>Sign in</h1>{error}<p>Paste the gateway key you were given (a read key "
            "to look, an operator key to resume and abort). It is kept in a cookie for this "
            "console only, for 12 hours.</p>"
            '<form class="act" method="post" action="/console/login">'
            f'<input type="hidden" name="next" value="{h(target)}">'
            '<label for="key">API key</label>'
            '<input id="key" name="key" type="password" autocomplete="current-password" '
            "required autofocus>"
            '<button type="submit">Sign in</button></form>'
        )
        return ui.page("Sign in", body)

    # -- pages ----------------------------------------------------------------------

    def _frame(self, req: _Req, title: str, body: str, nav: str = "", live: str = "") -> str:
        p = req.principal
        who = ""
        if p is not None and not self.keyring.open:
            roles = ", ".join(sorted(p.roles))
            who = f"{p.name} ({roles})"
        elif p is not None:
            who = "no keys: every role (loopback)"
        return ui.page(
            title,
            body,
            nav=nav,
            who=who,
            csrf=req.token if not self.keyring.open else "",
            live=live,
        )

    def _error_page(self, req: _Req, title: str, detail: str) -> str:
        body = f'<h1>{h(title)}</h1><div class="notice error" role="alert">{h(detail)}</div>'
        return self._frame(req, title, body) if req.principal else ui.page(title, body)

    async def _records(self, req: _Req) -> list[RunRecord]:
        """The runs index this principal may read, newest first (read once, reused until
        the journal changes)."""
        async with self._index_lock:
            cached = self._index
            now = time.monotonic()
            age = now - cached[0] if cached is not None else 0.0
            if (
                cached is None
                or (self._dirty and age > INDEX_TTL)
                or (self.service.shared and age > SHARED_INDEX_TTL)
            ):
                self._dirty = False
                records = await self.service.supervisor.store.list_runs()
                records.sort(key=lambda r: (r.started, r.run_id), reverse=True)
                self._index = cached = (now, records)
        records = cached[1]
        p = req.principal
        if p is not None and p.machines is not None:
            records = [r for r in records if r.machine in p.machines]
        return records

    async def _runs(self, req: _Req) -> str:
        records = await self._records(req)
        machine, state, outcome = req.arg("machine"), req.arg("state"), req.arg("outcome")
        reason, search = req.arg("reason"), req.arg("q")
        since, until = _time(req.arg("since"), "since"), _time(req.arg("until"), "until")
        page = _page_number(req)
        machines = sorted({r.machine for r in records})
        reasons = sorted({r.reason for r in records if r.reason})[:200]

        def keep(r: RunRecord, with_outcome: bool) -> bool:
            return (
                (not machine or r.machine == machine)
                and (not state or r.state == state)
                and (not with_outcome or not outcome or r.outcome == outcome)
                and (not reason or r.reason == reason)
                and (since is None or r.started >= since)
                and (until is None or r.started < until)
                and (not search or r.run_id.startswith(search))
            )

        base = [r for r in records if keep(r, False)]
        counts = Counter(r.outcome for r in base)
        chosen = [r for r in base if not outcome or r.outcome == outcome]
        if search and len(chosen) == 1 and chosen[0].run_id == search and page == 1:
            raise _Page(*_redirect(f"/console/runs/{urllib.parse.quote(search, safe='')}"))
        pages = max(1, math.ceil(len(chosen) / PAGE_SIZE))
        shown = chosen[(page - 1) * PAGE_SIZE : page * PAGE_SIZE]
        filters = dict(
            machine=machine,
            state=state,
            reason=reason,
            q=search,
            since=req.arg("since"),
            until=req.arg("until"),
        )
        tabs = "".join(
            f'<li><a href="/console/runs{ui.q(**filters, outcome=o)}"'
            f"{_CURRENT if o == outcome else ''}>{h(o or 'all')}: "
            f"{(sum(counts.values()) if not o else counts.get(o, 0)):,}</a></li>"
            for o in ("", *_OUTCOMES)
        )
        rows = "".join(
            f'<tr><td class="id">{ui.run_link(r.run_id)}</td><td>{h(r.machine)}</td>'
            f"<td><code>{h(r.state)}</code></td><td>{ui.badge(r.outcome)}</td>"
            f"<td>{h(ui.when(r.started))}</td><td>{h(ui.when(r.updated))}</td>"
            f"<td>{h(r.reason)}</td></tr>"
            for r in shown
        )
        empty = "" if shown else '<p role="status">No run matches these filters.</p>'
        pager = []
        if page > 1:
            pager.append(
                f'<a href="/console/runs{ui.q(**filters, outcome=outcome, page=page - 1)}"'
                ' rel="prev">← newer</a>'
            )
        pager.append(f"<span>page {page} of {pages} ({len(chosen):,} runs)</span>")
        if page < pages:
            pager.append(
                f'<a href="/console/runs{ui.q(**filters, outcome=outcome, page=page + 1)}"'
                ' rel="next">older →</a>'
            )
        body = (
            "<h1>Runs</h1>"
            f'<ul class="counts" aria-label="runs by outcome">{tabs}</ul>'
            f'<form class="filters" method="get" action="/console/runs" role="search">'
            f'<input type="hidden" name="outcome" value="{h(outcome)}">'
            f'<label>Run id or prefix<input name="q" value="{h(search)}" '
            'autocomplete="off"></label>'
            f"<label>Machine{_select('machine', machines, machine)}</label>"
            f'<label>State<input name="state" value="{h(state)}" size="10"></label>'
            f"<label>Reason{_select('reason', reasons, reason)}</label>"
            f'<label>Started from (UTC)<input type="datetime-local" name="since" '
            f'value="{h(req.arg("since"))}"></label>'
            f'<label>Started before (UTC)<input type="datetime-local" name="until" '
            f'value="{h(req.arg("until"))}"></label>'
            '<button type="submit">Filter</button> <a href="/console/runs">Clear</a></form>'
            f'<div class="scroll"><table class="runs"><caption class="skip">Runs, newest first'
            '</caption><thead><tr><th scope="col">run</th><th scope="col">machine</th>'
            '<th scope="col">state</th><th scope="col">outcome</th><th scope="col">started '
            '(UTC)</th><th scope="col">updated</th><th scope="col">reason</th></tr></thead>'
            f"<tbody>{rows}</tbody></table></div>{empty}"
            f'<nav class="pager" aria-label="pages">{"".join(pager)}</nav>'
        )
        return self._frame(req, "Runs", body, "runs", "/console/live")

    async def _queue(
        self,
        req: _Req,
        notice: str = "",
        kept: tuple[str, str, Mapping[str, str]] | None = None,
    ) -> str:
        """The escalation queue, oldest first, a page at a time, filtered by machine and
        reason; ``kept``: a run whose form is shown again with an error and its values."""
        records = await self._records(req)
        machine, reason = req.arg("machine"), req.arg("reason")
        waiting = [r for r in records if r.outcome == "escalated"]
        machines = sorted({r.machine for r in waiting})
        reasons = sorted({r.reason for r in waiting if r.reason})[:200]
        chosen = [
            r
            for r in reversed(waiting)  # the index is newest first
            if (not machine or r.machine == machine) and (not reason or r.reason == reason)
        ]
        chosen.sort(key=lambda r: (r.updated, r.run_id))
        number = _page_number(req)
        pages = max(1, math.ceil(len(chosen) / QUEUE_PAGE_SIZE))
        shown = chosen[(number - 1) * QUEUE_PAGE_SIZE : number * QUEUE_PAGE_SIZE]
        p = req.principal
        operator = p is not None and p.allows("operator")
        parts = [f"<h1>Escalation queue</h1>{notice or _done(req)}"]
        if not waiting:
            parts.append('<p role="status">No run is waiting for an operator.</p>')
        else:
            parts.append(
                f"<p>{len(chosen):,} run{'s' if len(chosen) != 1 else ''} waiting, oldest "
                "first.</p>"
                '<form class="filters" method="get" action="/console/escalations">'
                f"<label>Machine{_select('machine', machines, machine)}</label>"
                f"<label>Reason{_select('reason', reasons, reason)}</label>"
                '<button type="submit">Filter</button> '
                '<a href="/console/escalations">Clear</a></form>'
            )
        for r in shown:
            origin = await self.service._escalated_from(r.run_id, r.seq)
            served = self.service.supervisor.machines.get(r.machine)
            targets = resume_targets(served, origin) if served is not None and origin else []
            parts.append(
                f'<section class="queue-item" aria-labelledby="q-{h(r.run_id)}">'
                f'<h2 id="q-{h(r.run_id)}">{ui.run_link(r.run_id)}</h2>'
                f"<p><strong>{h(ui.why(r.reason, r.detail))}</strong></p>"
                f'<dl class="facts"><dt>machine</dt><dd>{h(r.machine)}</dd>'
                f"<dt>escalated from</dt><dd><code>{h(origin)}</code></dd>"
                f"<dt>reason</dt><dd><code>{h(r.reason)}</code></dd>"
                f"<dt>detail</dt><dd>{h(r.detail)}</dd>"
                f"<dt>since</dt><dd>{h(ui.when(r.updated))} UTC</dd></dl>"
            )
            if p is not None and p.allows("operator", r.machine):
                if kept is not None and kept[0] == r.run_id:
                    parts.append(
                        self._actions(req, r.run_id, origin, targets, "queue", kept[1], kept[2])
                    )
                else:
                    parts.append(self._actions(req, r.run_id, origin, targets))
            parts.append("</section>")
        if pages > 1:
            filters = {"machine": machine, "reason": reason}
            pager = []
            if number > 1:
                pager.append(
                    f'<a href="/console/escalations{ui.q(**filters, page=number - 1)}" '
                    'rel="prev">← older</a>'
                )
            pager.append(f"<span>page {number} of {pages}</span>")
            if number < pages:
                pager.append(
                    f'<a href="/console/escalations{ui.q(**filters, page=number + 1)}" '
                    'rel="next">newer →</a>'
                )
            parts.append(f'<nav class="pager" aria-label="pages">{"".join(pager)}</nav>')
        if waiting and not operator:
            parts.append(
                '<p class="notice info">Your key may read, not act: resuming and '
                "aborting need a key with the operator role.</p>"
            )
        return self._frame(req, "Escalation queue", "".join(parts), "escalations", "/console/live")

    def _actions(
        self,
        req: _Req,
        run_id: str,
        origin: str,
        targets: Sequence[str],
        back: str = "queue",
        error: str = "",
        values: Mapping[str, str] = {},
    ) -> str:
        quoted = h(urllib.parse.quote(run_id, safe=""))
        hidden = (
            f'<input type="hidden" name="csrf" value="{h(req.token)}">'
            f'<input type="hidden" name="back" value="{h(back)}">'
        )
        by = ""
        if self.keyring.open:
            by = (
                '<label>Your name (journaled as who did it)<input name="by" required '
                f'maxlength="200" value="{h(values.get("by", "operator"))}"></label>'
            )
        options = "".join(
            f'<option value="{h(t)}"{" selected" if t == (values.get("to") or origin) else ""}>'
            f"{h(t)}{' (where it escalated from)' if t == origin else ''}</option>"
            for t in targets
        )
        uid = hashlib.sha256(run_id.encode()).hexdigest()[:10]
        return (
            f'{error}<div class="actions">'
            f'<form class="act" method="post" action="/console/runs/{quoted}/resume">{hidden}'
            f"<h3>Resume</h3>{by}"
            f'<label for="to-{uid}">in state</label><select id="to-{uid}" name="to">{options}'
            "</select>"
            f'<label for="payload-{uid}">or with a corrected proposal (JSON; the gate checks '
            "it before anything is journaled; leave empty to resume in the state)</label>"
            f'<textarea id="payload-{uid}" name="payload" spellcheck="false" '
            f'placeholder=\'{{"tool": "...", "args": {{...}}}}\'>{h(values.get("payload", ""))}'
            "</textarea>"
            f'<label for="rnote-{uid}">note</label><input id="rnote-{uid}" name="note" '
            f'value="{h(values.get("note", "") if values.get("action") == "resume" else "")}">'
            '<button type="submit">Resume</button></form>'
            f'<form class="act" method="post" action="/console/runs/{quoted}/abort">{hidden}'
            f"<h3>Abort</h3>{by}"
            f'<label for="anote-{uid}">note (why)</label><input id="anote-{uid}" name="note" '
            f'value="{h(values.get("note", "") if values.get("action") == "abort" else "")}">'
            '<button type="submit" class="danger">Abort the run</button></form></div>'
        )

    async def _load_run(self, req: _Req, run_id: str) -> tuple[RunRecord, list[Any]]:
        store = self.service.supervisor.store
        try:
            record = await store.get_run(run_id)
        except RunNotFound:
            raise GatewayError(
                404,
                "No such run",
                f"there is no run {run_id!r} in this journal; search the runs list by id or prefix",
            ) from None
        if not _may_read(req.principal, record.machine):
            raise GatewayError(
                403,
                "Not yours to read",
                f"your key may not read runs of "
                f"machine {record.machine!r}; ask for a key that covers it",
            )
        return record, list(await store.load(run_id))

    async def _run(
        self, req: _Req, run_id: str, *, replay: bool = False, notice: str = "", form: str = ""
    ) -> str:
        record, events = await self._load_run(req, run_id)
        machine = self.service.supervisor.machines.get(record.machine)
        quoted = urllib.parse.quote(run_id, safe="")
        cost = 0.0
        tokens = [0, 0]
        for e in events:
            if isinstance(e, ModelCalled):
                tokens[0] += e.usage.prompt
                tokens[1] += e.usage.completion
                price = self.prices.get(e.model)
                if price:
                    cost += (e.usage.prompt * price[0] + e.usage.completion * price[1]) / 1e6
        facts = [
            ("machine", h(record.machine)),
            ("state", f"<code>{h(record.state)}</code>"),
            ("outcome", ui.badge(record.outcome)),
            ("reason", h(record.reason) or "—"),
            ("events", f"{record.seq:,}"),
            ("started", h(ui.when(record.started)) + " UTC"),
            ("updated", h(ui.when(record.updated)) + " UTC"),
            (
                "tokens",
                f"{tokens[0]:,} prompt + {tokens[1]:,} completion"
                + (f" (${cost:.6f})" if cost else ""),
            ),
        ]
        trace = _trace_of(events)
        if trace:
            template = os.environ.get(TRACE_URL_ENV, "")
            shown = f"<code>{h(trace)}</code>"
            if template and template.startswith(("http://", "https://")):
                link = template.replace("{trace_id}", urllib.parse.quote(trace, safe=""))
                shown = f'<a href="{h(link)}" rel="noreferrer">{shown}</a>'
            facts.append(("trace", shown))
        parts = [
            f"<h1>Run {h(run_id)}</h1>{notice or _done(req)}",
            '<dl class="facts">' + "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in facts) + "</dl>",
        ]
        if record.outcome == "escalated":
            last = next((e for e in reversed(events) if isinstance(e, Escalated)), None)
            origin = last.state if last is not None else ""
            parts.append('<h2 id="escalated">Waiting for an operator</h2>')
            parts.append(
                f"<p><strong>{h(ui.why(record.reason, record.detail))}</strong></p>"
                f"<p>{h(record.detail)}</p>"
            )
            if req.principal is not None and req.principal.allows("operator", record.machine):
                targets = resume_targets(machine, origin) if machine and origin else []
                parts.append(form or self._actions(req, run_id, origin, targets, back="run"))
            else:
                parts.append(
                    '<p class="notice info">Resuming and aborting need a key with the '
                    "operator role for this machine.</p>"
                )
        if machine is not None:
            taken = [(e.src, e.dst) for e in events if isinstance(e, Transitioned)]
            edges = {name: list(s.next) for name, s in machine.states.items()}
            parts.append("<h2>Where it is in the machine</h2>")
            parts.append(
                f'<div class="diagram">{ui.diagram(machine.name, machine.initial, edges, record.state, taken)}</div>'
            )
            path = " → ".join([machine.initial, *(dst for _, dst in taken)])
            parts.append(f"<p>Path: <code>{h(path)}</code></p>")
            try:
                run = fold(machine, events)
                parts.append(f"<h2>Data</h2>{ui.pre(run.data, 'run data')}")
            except Exception as exc:  # a changed machine may not fold an old run
                parts.append(
                    f'<p class="notice error">The run cannot be folded with the '
                    f"machine as served now: {h(exc)}</p>"
                )
        else:
            parts.append(
                f'<p class="notice info">This gateway does not serve machine '
                f"{h(record.machine)!s}: no diagram, no replay.</p>"
            )
        parts.append(self._conversation(events))
        parts.append("<h2>Timeline</h2>")
        try:
            prompts = {e.seq: prompt for e, prompt in whole_prompts(events)}
        except ValueError:  # reported in the conversation's place
            prompts = {}
        parts.append(ui.timeline(events, self.prices, prompts))
        parts.append('<h2 id="replay">Replay</h2>')
        if replay and machine is not None:
            parts.append(await self._replay(machine, events))
        elif machine is not None:
            parts.append(
                "<p>Replay decides the run again from its journal with the machine this "
                "gateway serves (nothing is executed: no model, no tool) and shows the first "
                "event it would decide differently: a check that the journal reproduces, or "
                "a what-if of a changed machine against recorded runs.</p>"
                f'<p><a href="/console/runs/{h(quoted)}/replay#replay">Replay this run</a></p>'
            )
        live = (
            ""
            if record.outcome in ("completed", "failed")
            else (f"/console/runs/{quoted}/live?after={record.seq}")
        )
        return self._frame(req, f"Run {run_id}", "".join(parts), "", live)

    def _conversation(self, events: Sequence[Any]) -> str:
        try:
            calls = list(whole_prompts(events))
        except ValueError as exc:
            return f'<h2>Conversation</h2><p class="notice error">{h(exc)}</p>'
        if not calls:
            return ""
        last, prompt = calls[-1]
        if not prompt.strip():  # an external run's proposals: no prompt was journaled
            return ""
        try:
            body: Any = json.loads(prompt)
        except ValueError:
            body = prompt
        turns = conversation(body, ONE_CALL)
        answer = last.response if isinstance(last.response, str) else last.raw
        return (
            f"<h2>Conversation</h2><p>As the model saw it at its last call (#{last.seq}, "
            f"{len(calls)} call{'s' if len(calls) != 1 else ''} in the run), then its answer.</p>"
            + ui.render_conversation(turns, offered_tools(body))
            + f'<div class="turn assistant"><strong>answer</strong>{ui.pre(answer)}</div>'
        )

    async def _replay(self, machine: Any, events: list[Any]) -> str:
        result = await trio.to_thread.run_sync(replay_run, machine, events)
        if result.divergence is None:
            return (
                f'<div class="notice ok" role="status">Reproduced: all {result.events:,} '
                f"events decided again as recorded, with machine {h(machine.name)} as "
                "served.</div>"
            )
        d = result.divergence
        return (
            f'<div class="notice error" role="status">Diverged at event #{d.seq} '
            f"({h(d.kind)}), after {result.events:,} events that matched, with machine "
            f"{h(machine.name)} as served.</div>"
            '<div class="side"><div><h3>Recorded</h3>'
            f"<pre>{h(d.expected)}</pre></div><div><h3>Decided now</h3><pre>{h(d.got)}</pre>"
            f'</div></div><p><a href="#seq-{d.seq}">The recorded event in the timeline</a></p>'
        )

    async def _act(
        self, req: _Req, run_id: str, action: str
    ) -> tuple[int, str, list[tuple[str, str]]]:
        self._check_csrf(req)
        p = req.principal
        assert p is not None
        by = p.name if not self.keyring.open else req.form.get("by", "").strip()
        note = req.form.get("note", "")
        back = req.form.get("back", "run")
        quoted = urllib.parse.quote(run_id, safe="")
        error = ""
        status = 200
        try:
            if not by:
                raise GatewayError(
                    422, "Who", "say who you are: the name is journaled with the action"
                )
            if action == "resume":
                payload = req.form.get("payload", "").strip() or None
                to = None if payload else (req.form.get("to", "").strip() or None)
                if payload is not None:
                    try:
                        json.loads(payload)
                    except ValueError as exc:
                        raise GatewayError(
                            422,
                            "Not JSON",
                            f"the corrected proposal is not "
                            f"valid JSON ({exc}); write one proposal like "
                            '{"tool": "refund", "args": {...}} or '
                            '{"next": "STATE"}',
                        ) from None
                await self.service.resume(
                    run_id, ResumeIn(by=by, note=note, payload=payload, to=to), p
                )
                done = "resumed" + (
                    " with the corrected proposal" if payload else f" in {to}" if to else ""
                )
            else:
                await self.service.abort(run_id, AbortIn(by=by, note=note), p)
                done = "aborted"
        except GatewayError as exc:
            status = exc.status
            error = (
                f'<div class="notice error" role="alert"><strong>Refused ({exc.status}):'
                f"</strong> {h(exc.detail)}"
                + (ui._violations(exc.violations) if exc.violations else "")
                + "</div>"
            )
        except msgspec.ValidationError as exc:
            status = 422
            error = f'<div class="notice error" role="alert">{h(exc)}</div>'
        self._index = None  # what the action wrote (a worker's store too) shows at once
        if not error:
            flag = urllib.parse.quote(f"Run {run_id} {done} by {by}.")
            where = "/console/escalations" if back == "queue" else f"/console/runs/{quoted}"
            return _redirect(f"{where}?done={flag}")
        values = {**req.form, "action": action}
        if back == "queue":
            item = next((r for r in await self._records(req) if r.run_id == run_id), None)
            if item is None or item.outcome != "escalated":
                return status, await self._queue(req, error), []
            return status, await self._queue(req, kept=(run_id, error, values)), []
        record, _ = await self._load_run(req, run_id)
        form = ""
        if record.outcome == "escalated" and p.allows("operator", record.machine):
            machine = self.service.supervisor.machines.get(record.machine)
            origin = await self.service._escalated_from(run_id, record.seq)
            targets = resume_targets(machine, origin) if machine and origin else []
            form = self._actions(req, run_id, origin, targets, "run", error, values)
            return status, await self._run(req, run_id, form=form), []
        return status, await self._run(req, run_id, notice=error), []

    # -- live -----------------------------------------------------------------------

    async def _live(self, req: _Req, send: Send) -> tuple[int, str, list[tuple[str, str]]]:
        await _start_stream(send)
        with trio.CancelScope() as scope, contextlib.suppress(trio.BrokenResourceError, OSError):
            self.streams.add(scope)
            while True:
                changed = self.changed
                with trio.move_on_after(SHARED_INDEX_TTL if self.service.shared else 15.0):
                    await changed.wait()
                if changed.is_set() or self.service.shared:
                    # NOTE: by then the page's refetch reads the index again (INDEX_TTL), and
                    # a busy journal refreshes the page at most once a second
                    await trio.sleep(INDEX_TTL)
                    await _chunk(send, b"event: changed\ndata: {}\n\n")
                else:
                    await _chunk(send, b": keep-alive\n\n")
        self.streams.discard(scope)
        await _end_stream(send)
        return 0, "", []

    async def _run_live(
        self, req: _Req, run_id: str, send: Send
    ) -> tuple[int, str, list[tuple[str, str]]]:
        try:
            after = max(0, int(req.arg("after") or 0))
        except ValueError:
            raise GatewayError(400, "Bad after", "after must be a seq (a whole number)") from None
        await self._load_run(req, run_id)  # exists, and may be read
        stream = await self.service.follow(run_id, after, None, heartbeat=15.0)
        await _start_stream(send)
        with trio.CancelScope() as scope, contextlib.suppress(trio.BrokenResourceError, OSError):
            self.streams.add(scope)
            async with contextlib.aclosing(stream):
                async for event in stream:
                    if event is None:
                        await _chunk(send, b": keep-alive\n\n")
                        continue
                    data = json.dumps({"seq": event.seq, "kind": event.kind})
                    await _chunk(
                        send, f"id: {event.seq}\nevent: journal\ndata: {data}\n\n".encode()
                    )
            await _chunk(send, b"event: end\ndata: {}\n\n")
        self.streams.discard(scope)
        await _end_stream(send)
        return 0, "", []

    # -- files ----------------------------------------------------------------------

    def _file(self, name: str) -> tuple[int, bytes, list[tuple[str, str]]]:
        kind = _STATIC.get(name)
        if kind is None:
            raise _Page(404, ui.page("Not found", f"<h1>Not found</h1><p>No file {h(name)}.</p>"))
        data = self._static.get(name)
        if data is None:
            data = self._static[name] = (
                resources.files("interlock.gateway").joinpath("console", name).read_bytes()
            )
        return 200, data, [("content-type", kind), ("cache-control", "public, max-age=300")]


def _trace_of(events: Sequence[Any]) -> str:
    """The OpenTelemetry trace id a run's ``run_started`` names ('' if none)."""
    first = events[0] if events else None
    trace = getattr(first, "trace", "")
    parts = trace.split("-") if isinstance(trace, str) else []
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else ""


def _page_number(req: _Req) -> int:
    try:
        return max(1, int(req.arg("page") or 1))
    except ValueError:
        raise GatewayError(
            400, "Bad page", f"page must be a whole number, got {req.arg('page')!r}"
        ) from None


def _done(req: _Req) -> str:
    """The note of what was just done, after an action's redirect (text, escaped)."""
    said = req.arg("done")
    if not said.startswith("Run ") or len(said) > 400:
        return ""
    return f'<div class="notice ok" role="status">{h(said)}</div>'


def _may_read(principal: Principal | None, machine: str) -> bool:
    return principal is not None and (
        principal.allows("reader", machine) or principal.allows("agent", machine)
    )


def _csrf(key: str) -> str:
    return hashlib.sha256(b"interlock-console-form:" + key.encode()).hexdigest()[:32]


def _cookie(value: str, req: _Req, age: int) -> str:
    secure = "; Secure" if req.headers.get("x-forwarded-proto") == "https" else ""
    return (
        f"{COOKIE}={urllib.parse.quote(value, safe='')}; Path=/console; HttpOnly; "
        f"SameSite=Strict; Max-Age={age}{secure}"
    )


def _redirect(
    where: str, headers: Sequence[tuple[str, str]] = ()
) -> tuple[int, str, list[tuple[str, str]]]:
    return 303, "", [("location", where), *headers]


def _select(name: str, options: Sequence[str], chosen: str) -> str:
    items = "".join(
        f'<option value="{h(o)}"{" selected" if o == chosen else ""}>'
        f"{h(o if len(o) <= 60 else o[:57] + '...')}</option>"
        for o in options
    )
    return f'<select name="{name}"><option value="">any</option>{items}</select>'


def _time(text: str, name: str) -> float | None:
    if not text:
        return None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise GatewayError(
            400,
            "Bad time",
            f"{name} must be a date and time like 2026-12-04T09:30 (UTC), got {text[:40]!r}",
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


async def _read_form(receive: Receive, kind: str) -> dict[str, str]:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        body = message.get("body", b"")
        size += len(body)
        if size > MAX_FORM:
            raise _Page(
                413, ui.page("Too large", "<h1>Too large</h1><p>The form is over 1 MiB.</p>")
            )
        chunks.append(body)
        if not message.get("more_body", False):
            break
    if kind.split(";", 1)[0].strip().lower() != "application/x-www-form-urlencoded":
        raise _Page(
            415,
            ui.page(
                "Form expected",
                "<h1>Form expected</h1><p>The console's "
                "actions take an HTML form (application/x-www-form-"
                "urlencoded); use the page's buttons.</p>",
            ),
        )
    try:
        text = b"".join(chunks).decode("utf-8")
        pairs = urllib.parse.parse_qsl(text, keep_blank_values=True, strict_parsing=False)
    except (UnicodeDecodeError, ValueError):
        raise _Page(
            400, ui.page("Bad form", "<h1>Bad form</h1><p>The form could not be read as UTF-8.</p>")
        ) from None
    return dict(pairs)


async def _start_stream(send: Send) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"text/event-stream"),
                (b"cache-control", b"no-store"),
                (b"x-accel-buffering", b"no"),
            ],
        }
    )
    await _chunk(send, b": live\n\n")


async def _end_stream(send: Send) -> None:
    with contextlib.suppress(trio.BrokenResourceError, OSError):
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _chunk(send: Send, data: bytes) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": True})
