"""The operator console over real loopback HTTP: a real ``interlock serve`` process with a
keys file, runs journaled through the API as an agent would, the pages read as a browser
would get them (the browser itself: tests/test_console_browser.py).

What is checked: no key sees nothing; a read key sees but cannot act; a form needs its
token; a bad corrected proposal is refused with the gate's violations and journals
nothing, a good one resumes; an abort is journaled with who and why; hostile strings are
escaped on every page; filters, counts, paging and search; replay and the what-if
replay; the live stream.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests._console import BAD, GOOD, HOSTILE, KEYS, TOO_MUCH, Gateway

pytestmark = pytest.mark.slow

STRICT = str(Path(__file__).with_name("console_app.py")) + ":strict"


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    where = tmp_path_factory.mktemp("console")
    gateway = Gateway(str(where / "journal.db"), where)
    try:
        gateway.escalated("esc-read", HOSTILE[2])
        gateway.escalated("esc-token")
        gateway.escalated("esc-resume", HOSTILE[3])
        gateway.escalated("esc-abort")
        gateway.escalated("javascript:x")
        gateway.completed("done-1", {"note": HOSTILE[1]})
        for n in range(55):
            gateway.completed(f"bulk-{n:03d}")
        yield gateway
    finally:
        gateway.close()


def token(page: str) -> str:
    found = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
    assert found, "the page has no form token"
    return found.group(1)


def test_no_key_sees_nothing(gw: Gateway) -> None:
    with gw.client(None) as anyone:
        for path in (
            "/console/runs",
            "/console/escalations",
            "/console/runs/esc-read",
            "/console/runs/esc-read/replay",
        ):
            page = anyone.get(path)
            assert page.status_code == 401, path
            assert 'action="/console/login"' in page.text
            assert "esc-read" not in page.text.replace("/console/runs/esc-read", ""), path
            assert "refund" not in page.text
        live = anyone.get("/console/runs/esc-read/live")
        assert live.status_code == 401
        acted = anyone.post("/console/runs/esc-read/abort", data={"note": "x"})
        assert acted.status_code == 401
    assert gw.run("esc-read")["outcome"] == "escalated"


def test_signing_in_takes_a_good_key_only_and_keeps_it_in_a_strict_cookie(gw: Gateway) -> None:
    with gw.client(None) as browser:
        refused = browser.post("/console/login", data={"key": "not-a-key", "next": "/console/runs"})
        assert refused.status_code == 401
        assert "that key was refused" in refused.text
        assert "set-cookie" not in refused.headers
        signed = browser.post(
            "/console/login", data={"key": KEYS["reader"], "next": "/console/escalations"}
        )
        assert signed.status_code == 303
        assert signed.headers["location"] == "/console/escalations"
        cookie = signed.headers["set-cookie"]
        for part in ("HttpOnly", "SameSite=Strict", "Path=/console"):
            assert part in cookie
        # an open redirect is not offered: next must stay in the console
        away = browser.post(
            "/console/login", data={"key": KEYS["reader"], "next": "https://evil.example/"}
        )
        assert away.headers["location"] == "/console/runs"
        page = browser.get("/console/escalations")
        assert page.status_code == 200
        assert "esc-read" in page.text
        assert "reader (reader)" in page.text


def test_a_read_key_sees_the_queue_but_cannot_act(gw: Gateway) -> None:
    before = gw.run("esc-read")["seq"]
    with gw.client("reader") as reader:
        queue = reader.get("/console/escalations")
        assert queue.status_code == 200
        assert "esc-read" in queue.text
        assert "/console/runs/esc-read/resume" not in queue.text
        assert "need a key with the operator role" in queue.text
        run = reader.get("/console/runs/esc-read")
        assert "Resuming and aborting need a key with the operator role" in run.text
        acted = reader.post(
            "/console/runs/esc-read/resume",
            data={"csrf": token(run.text), "to": "REFUND", "back": "run"},
        )
        assert acted.status_code == 403
        assert "operator" in acted.text
        assert 'role="alert"' in acted.text
    assert gw.run("esc-read")["seq"] == before


def test_a_form_without_its_token_is_refused_and_journals_nothing(gw: Gateway) -> None:
    before = gw.run("esc-token")["seq"]
    with gw.client("oncall") as operator:
        for form in ({"note": "x"}, {"note": "x", "csrf": "0" * 32}):
            acted = operator.post("/console/runs/esc-token/abort", data=form)
            assert acted.status_code == 403
            assert "token does not match" in acted.text
        # a JSON body (what a script would send to the API) is not a form
        page = operator.get("/console/runs/esc-token")
        acted = operator.post(
            "/console/runs/esc-token/abort", json={"csrf": token(page.text), "note": "x"}
        )
        assert acted.status_code == 415
    assert gw.run("esc-token")["seq"] == before
    assert gw.run("esc-token")["outcome"] == "escalated"


def test_a_bad_payload_is_refused_inline_then_a_good_one_resumes(gw: Gateway) -> None:
    before = gw.run("esc-resume")["seq"]
    with gw.client("oncall") as operator:
        page = operator.get("/console/runs/esc-resume")
        assert "/console/runs/esc-resume/resume" in page.text
        csrf = token(page.text)
        refused = operator.post(
            "/console/runs/esc-resume/resume",
            data={"csrf": csrf, "payload": TOO_MUCH, "note": "try", "back": "run"},
        )
        assert refused.status_code == 422
        assert "over the refund limit of 10000" in refused.text
        assert "<code>guard</code>" in refused.text
        assert "args.cents" in refused.text
        assert "refund at most 10000 cents" in refused.text
        # what the operator typed is kept in the form, escaped
        assert "&quot;cents&quot;: 99999" in refused.text
        assert gw.run("esc-resume")["seq"] == before
        not_json = operator.post(
            "/console/runs/esc-resume/resume",
            data={"csrf": csrf, "payload": "{refund", "back": "run"},
        )
        assert not_json.status_code == 422
        assert "not valid JSON" in not_json.text
        assert gw.run("esc-resume")["seq"] == before
        done = operator.post(
            "/console/runs/esc-resume/resume",
            data={"csrf": csrf, "payload": GOOD, "note": "refund 250", "back": "run"},
        )
        assert done.status_code == 303, done.text
        assert done.headers["location"].startswith("/console/runs/esc-resume?done=")
        shown = operator.get(done.headers["location"])
        assert "resumed with the corrected proposal by oncall" in shown.text
    run = gw.run("esc-resume")
    assert run["outcome"] == "running"
    resumed = [e for e in gw.events("esc-resume") if e["kind"] == "resumed"]
    assert len(resumed) == 1
    assert resumed[0]["data"]["by"] == "oncall"
    assert resumed[0]["data"]["note"] == "refund 250"


def test_an_abort_is_journaled_with_who_and_why(gw: Gateway) -> None:
    with gw.client("oncall") as operator:
        queue = operator.get("/console/escalations")
        assert "/console/runs/esc-abort/abort" in queue.text
        done = operator.post(
            "/console/runs/esc-abort/abort",
            data={"csrf": token(queue.text), "note": "duplicate ticket", "back": "queue"},
        )
        assert done.status_code == 303
        assert done.headers["location"].startswith("/console/escalations?done=")
        queue = operator.get("/console/escalations")
        assert "/console/runs/esc-abort/abort" not in queue.text
        # once more: the same abort is answered with the run as it is, nothing new
        again = operator.post(
            "/console/runs/esc-abort/abort",
            data={"csrf": token(queue.text), "note": "again", "back": "run"},
        )
        assert again.status_code == 303
    assert gw.run("esc-abort")["outcome"] == "failed"
    events = gw.events("esc-abort")
    mentions = [e for e in events if "oncall" in str(e["data"])]
    assert mentions
    assert "duplicate ticket" in str(mentions[-1]["data"])
    assert not any("again" in str(e["data"]) for e in events)


def test_hostile_strings_are_shown_as_text_on_every_page(gw: Gateway) -> None:
    with gw.client("oncall") as operator:
        for path in (
            "/console/runs",
            "/console/escalations",
            "/console/runs/esc-read",
            "/console/runs/done-1",
            "/console/runs/done-1/replay",
            "/console/runs/javascript:x",
            "/console/runs?q=%3Cscript%3E",
        ):
            page = operator.get(path)
            assert page.status_code == 200, path
            csp = page.headers["content-security-policy"]
            assert "script-src 'self'" in csp
            assert "unsafe-inline" not in csp
            for hostile in HOSTILE[:3]:
                assert hostile not in page.text, (path, hostile)
            assert "<script>" not in page.text
            assert 'href="javascript:' not in page.text
            assert page.text.count("<script") == 1  # the console's own file only
        run = operator.get("/console/runs/esc-read").text
        assert "&lt;script&gt;window.__pwned = 1&lt;/script&gt;" in run
        assert "&#x27;&gt;&lt;svg onload=window.__pwned=3&gt;" in run
        link = operator.get("/console/runs?q=javascript").text
        assert 'href="/console/runs/javascript%3Ax"' in link


def test_the_list_filters_counts_pages_and_searches(gw: Gateway) -> None:
    with gw.client("reader") as reader:
        page = reader.get("/console/runs").text
        assert re.search(r"all: 6[0-9]", page)
        assert "escalated: " in page
        assert "completed: 5" in page
        assert "page 1 of 2" in page
        second = reader.get("/console/runs?page=2").text
        assert "page 2 of 2" in second
        listed = set(re.findall(r'href="/console/runs/(bulk-\d+)"', page))
        assert listed.isdisjoint(re.findall(r'href="/console/runs/(bulk-\d+)"', second))
        escalated = reader.get("/console/runs?outcome=escalated").text
        rows = re.findall(r'<td class="id"><a href="/console/runs/([^"]+)"', escalated)
        assert rows
        assert not any(r.startswith(("bulk", "done")) for r in rows)
        prefix = reader.get("/console/runs?q=bulk-01").text
        rows = re.findall(r'<td class="id"><a href="/console/runs/([^"]+)"', prefix)
        assert sorted(rows) == [f"bulk-{n:03d}" for n in range(10, 20)]
        exact = reader.get("/console/runs?q=done-1")
        assert exact.status_code == 303
        assert exact.headers["location"] == "/console/runs/done-1"
        none = reader.get("/console/runs?q=nothing-like-this").text
        assert "No run matches these filters" in none
        future = reader.get("/console/runs?since=2999-01-01T00:00").text
        assert "No run matches" in future
        bad = reader.get("/console/runs?since=yesterday")
        assert bad.status_code == 400
        assert "2026-12-04T09:30" in bad.text
        bad_page = reader.get("/console/runs?page=two")
        assert bad_page.status_code == 400
        assert "whole number" in bad_page.text
        missing = reader.get("/console/runs/no-such-run")
        assert missing.status_code == 404
        assert "no run &#x27;no-such-run&#x27;" in missing.text


def test_a_run_page_shows_its_steps_machine_and_data(gw: Gateway) -> None:
    with gw.client("reader") as reader:
        page = reader.get("/console/runs/done-1").text
        for text in (
            "intent recorded",
            "committed",
            "transition",
            "completed",
            "Where it is in the machine",
            "REFUND → NOTIFY → COMPLETED",
            "&quot;said&quot;: &quot;refunded&quot;",
            "<svg",
        ):
            assert text in page, text
        escalated = reader.get("/console/runs/esc-read").text
        for text in (
            "rejected by the gate",
            "breaker tripped",
            "consecutive_failures",
            "The model&#x27;s proposals failed the gate too many times in a row.",
        ):
            assert text in escalated, text


def test_replay_reproduces_a_run(gw: Gateway) -> None:
    with gw.client("reader") as reader:
        page = reader.get("/console/runs/done-1/replay").text
        assert "Reproduced: all" in page


def test_the_what_if_replay_shows_the_first_divergence(tmp_path: Path) -> None:
    db = tmp_path / "journal.db"
    first = Gateway(str(db), tmp_path)
    try:
        first.completed("paid-250")
    finally:
        first.close()
    strict = Gateway(str(db), tmp_path, app=STRICT)
    try:
        with strict.client("reader") as reader:
            page = reader.get("/console/runs/paid-250/replay").text
        assert "Diverged at event #" in page
        assert "intent_recorded" in page  # what was recorded
        assert "proposal_rejected" in page
        assert "over the refund limit of 100" in page
    finally:
        strict.close()


def test_the_live_stream_sends_each_new_event(gw: Gateway) -> None:
    gw.start("live-1")
    seq = gw.run("live-1")["seq"]
    got: list[str] = []

    def follow() -> None:
        with (
            httpx.Client(
                base_url=gw.url, timeout=30, headers={"authorization": f"Bearer {KEYS['reader']}"}
            ) as reader,
            reader.stream("GET", f"/console/runs/live-1/live?after={seq}") as stream,
        ):
            assert stream.status_code == 200
            assert stream.headers["content-type"].startswith("text/event-stream")
            for line in stream.iter_lines():
                got.append(line)
                if line.startswith("data:") and "proposal_rejected" in line:
                    return

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    while not any(line.startswith(": live") for line in got) and thread.is_alive():
        thread.join(0.05)
    gw.propose("live-1", BAD)
    thread.join(30)
    assert not thread.is_alive(), got
    assert "event: journal" in got
    assert any('"kind": "proposal_rejected"' in line for line in got)


async def test_the_console_can_be_turned_off() -> None:
    from interlock.gateway import create_app
    from interlock.gateway._keys import KeyRing
    from interlock.runtime._runtime import open_supervisor
    from interlock.stores import MemoryStore
    from tests.console_app import app

    async with open_supervisor(list(app.machines.values()), MemoryStore()) as sup:
        for console, status in ((True, 200), (False, 404)):
            asgi = create_app(sup, keyring=KeyRing(), console=console).asgi
            transport = httpx.ASGITransport(app=asgi)  # type: ignore[arg-type]
            async with httpx.AsyncClient(
                transport=transport, base_url="http://127.0.0.1"
            ) as client:
                assert (await client.get("/console/runs")).status_code == status


def test_an_operator_works_the_demo_journal_from_the_console(tmp_path: Path) -> None:
    """The demo's journal (its hosted runs, its simulated model) served by `interlock
    console`: a run resumed from the page is driven on with the demo's own model, an
    aborted one ends; the unfinished runs are not driven by the console itself."""
    import subprocess
    import sys

    db = str(tmp_path / "demo.db")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "interlock",
            "demo",
            "--runs",
            "30",
            "--workflow",
            "refund",
            "--chaos-rate",
            "0.6",
            "--seed",
            "7",
            "--db",
            db,
            "--json",
        ],
        check=True,
        capture_output=True,
        cwd=tmp_path,
        timeout=300,
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERLOCK_API_KEY")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "interlock", "console", "--db", db, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("interlock console: http://127.0.0.1:"), line
        url = line.split()[2]
        assert url.endswith("/console")
        with httpx.Client(base_url=url.removesuffix("/console"), timeout=60) as browser:
            queue = browser.get("/console/escalations").text
            waiting = re.findall(r'action="/console/runs/([^"/]+)/resume"', queue)
            assert len(waiting) >= 2, "the seeded demo escalates several runs"
            first, second = waiting[:2]
            resumed = browser.post(
                f"/console/runs/{first}/resume",
                data={"csrf": token(queue), "by": "ana", "note": "retry", "back": "queue"},
            )
            assert resumed.status_code == 303, resumed.text
            aborted = browser.post(
                f"/console/runs/{second}/abort",
                data={"csrf": token(queue), "by": "ana", "note": "refund by hand"},
            )
            assert aborted.status_code == 303, aborted.text
            page = browser.get(f"/console/runs/{first}").text
            for _ in range(100):  # the resumed run is driven on by the demo's model
                if "Resumed by an operator" in page and "badge o-running" not in page:
                    break
                time.sleep(0.1)
                page = browser.get(f"/console/runs/{first}").text
            assert "Resumed by an operator" in page
            assert "by <strong>ana</strong>, in <code>" in page
            assert "</code>: retry" in page
            assert "badge o-running" not in page  # it ran on to an end (or escalated again)
            assert "badge o-failed" in browser.get(f"/console/runs/{second}").text
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_parallel_calls_of_one_turn_are_shown_side_by_side() -> None:
    from interlock.core._conversation import conversation, offered_tools
    from interlock.core._wire import ONE_CALL
    from interlock.gateway import _console_html as ui

    body = {
        "messages": [
            {"role": "system", "content": "refund the order"},
            {"role": "user", "content": "<b>refund</b> o-1 and o-2"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "refund", "arguments": '{"order_id": "o-1"}'},
                    },
                    {
                        "id": "c2",
                        "type": "function",
                        "function": {"name": "refund", "arguments": '{"order_id": "o-2"}'},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": '{"refunded": 250}'},
            {"role": "tool", "tool_call_id": "c2", "content": f"not run: {ONE_CALL}"},
        ],
        "tools": [{"type": "function", "function": {"name": "refund"}}],
    }
    turns = conversation(body, ONE_CALL)
    assistant = next(t for t in turns if t.role == "assistant")
    assert [(c.id, c.ran, c.result is not None) for c in assistant.calls] == [
        ("c1", True, True),
        ("c2", False, True),
    ]
    html = ui.render_conversation(turns, offered_tools(body))
    assert 'aria-label="2 calls in one turn, side by side"' in html
    assert html.count('role="listitem"') == 2
    assert "call 1 of 2" in html
    assert "call 2 of 2" in html
    assert "not run (one call per turn)" in html
    assert "&lt;b&gt;refund&lt;/b&gt;" in html
    assert "tools offered: refund" in html
    # the Responses API's calls are items of their own; Anthropic's are content blocks
    responses = {
        "input": [
            {"type": "function_call", "call_id": "a", "name": "x", "arguments": "{}"},
            {"type": "function_call", "call_id": "b", "name": "y", "arguments": "{}"},
        ]
    }
    (turn,) = conversation(responses, ONE_CALL)
    assert [c.name for c in turn.calls] == ["x", "y"]
    messages = {
        "system": "s",
        "messages": [
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "two"},
                    {"type": "tool_use", "id": "u1", "name": "x", "input": {}},
                    {"type": "tool_use", "id": "u2", "name": "y", "input": {}},
                ],
            }
        ],
    }
    turns = conversation(messages, ONE_CALL)
    assert [t.role for t in turns] == ["system", "assistant"]
    assert [c.id for c in turns[1].calls] == ["u1", "u2"]


_text = st.text(max_size=40) | st.sampled_from(
    [
        "REFUND",
        "NOTIFY",
        "COMPLETED",
        "",
        "0",
        "-1",
        "9" * 30,
        "\x00",
        "\ud7ff",
        GOOD,
        BAD,
        TOO_MUCH,
        "{",
        "null",
        "[]",
        '{"next": "COMPLETED"}',
        "2026-12-04T09:30",
        "<script>",
    ]
)
_paths = st.sampled_from(
    [
        "/console",
        "/console/",
        "/console/runs",
        "/console/escalations",
        "/console/live",
        "/console/login",
        "/console/logout",
        "/console/runs/esc-fuzz",
        "/console/runs/esc-fuzz/",
        "/console/runs/esc-fuzz/replay",
        "/console/runs/esc-fuzz/resume",
        "/console/runs/esc-fuzz/abort",
        "/console/runs/no-such",
        "/console/static/console.css",
        "/console/static/nope.js",
        "/console/runs/%00",
        "/console/runs/a%2Fb/replay",
        "/console/a/b/c/d",
    ]
)
_fields = st.dictionaries(
    st.sampled_from(
        [
            "q",
            "page",
            "machine",
            "state",
            "outcome",
            "reason",
            "since",
            "until",
            "to",
            "payload",
            "note",
            "by",
            "back",
            "next",
            "key",
            "after",
            "done",
        ]
    ),
    _text,
    max_size=6,
)


@settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    path=_paths,
    method=st.sampled_from(["GET", "POST", "HEAD", "PUT"]),
    fields=_fields,
    with_token=st.booleans(),
    who=st.sampled_from(["oncall", "reader", None]),
)
def test_no_input_makes_the_console_answer_500(
    gw: Gateway,
    path: str,
    method: str,
    fields: dict[str, str],
    with_token: bool,
    who: str | None,
) -> None:
    if "esc-fuzz" not in gw.started:
        gw.escalated("esc-fuzz")
        gw.started.add("esc-fuzz")
    if path.endswith("/live") and method in ("GET", "HEAD") and who is not None:
        return  # a live stream stays open: test_the_live_stream_sends_each_new_event
    with gw.client(who) as client:
        if with_token and who is not None:
            fields = {**fields, "csrf": token(client.get("/console/escalations").text)}
        if method in ("GET", "HEAD"):
            answer = client.request(method, path, params=fields)
        else:
            answer = client.request(method, path, data=fields)
    assert answer.status_code < 500, (path, method, fields, answer.text[-2000:])
    if method != "HEAD" and answer.status_code != 303:
        # a page, or the guard's own refusal before the console sees the request
        kind = answer.headers["content-type"]
        assert kind.startswith(("text/html", "text/css", "application/problem+json")), kind
    assert gw.proc.poll() is None
