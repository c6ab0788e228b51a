"""The operator console in a real browser: Debian's Chromium, driven by Playwright, against
a real ``interlock serve`` on SQLite and on PostgreSQL.

An operator signs in, lists and filters the runs, opens one, resumes an escalated run
with a bad corrected proposal (the gate's refusal is shown in the page) then a good one,
aborts another from the queue and replays a run; a read key signs in and finds no action;
a page follows a live run without reloading; and no hostile string a run journaled runs
script (no dialog, no global set, no element injected). Each page is saved as a
screenshot at a laptop's and a phone's width, under ``build/console-screenshots`` (or
``INTERLOCK_SCREENSHOTS``), to be looked at when a page changes.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._console import GOOD, HOSTILE, KEYS, TOO_MUCH, Gateway

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SHOTS = Path(
    os.environ.get("INTERLOCK_SCREENSHOTS")
    or Path(__file__).resolve().parent.parent / "build" / "console-screenshots"
)
WIDTHS = {"laptop": (1280, 800), "phone": (390, 844)}
PG_DSN = os.environ.get("INTERLOCK_PG_DSN")


def _browser_or_skip() -> Any:
    """Playwright's sync API, or a skip that names what is missing (a failure in CI)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        reason = "playwright is not installed: pip install -e '.[test]'"
    else:
        if Path(CHROMIUM).exists():
            return sync_playwright
        reason = "no Chromium: apt-get install -y chromium (as .ci/run does)"
    if os.environ.get("CI") or os.environ.get("INTERLOCK_PG_DSN"):
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    sync_playwright = _browser_or_skip()
    with sync_playwright() as p:
        chromium = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(params=["sqlite", "postgres"])
def gw(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Gateway]:
    if request.param == "sqlite":
        db = str(tmp_path / "journal.db")
        schema = None
    else:
        if not PG_DSN:
            pytest.skip("INTERLOCK_PG_DSN is not set: no PostgreSQL to test the console on")
        schema = f"interlock_console_{secrets.token_hex(5)}"
        db = f"{PG_DSN}{'&' if '?' in PG_DSN else '?'}schema={schema}"
    gateway = Gateway(db, tmp_path)
    gateway.backend = request.param  # type: ignore[attr-defined]
    try:
        yield gateway
    finally:
        gateway.close()
        if schema is not None:
            import psycopg

            with psycopg.connect(PG_DSN, autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


class Watch:
    """What a page did that it must not: dialogs opened, errors thrown."""

    def __init__(self, page: Any) -> None:
        self.dialogs: list[str] = []
        self.errors: list[str] = []
        page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        page.on("pageerror", lambda e: self.errors.append(str(e)))

    def check(self, page: Any) -> None:
        assert self.dialogs == []
        assert self.errors == []
        assert page.evaluate("window.__pwned") is None
        assert page.evaluate("document.querySelectorAll('img, svg[onload], iframe').length") == 0
        scripts = page.evaluate("[...document.scripts].map(s => s.getAttribute('src'))")
        assert scripts == ["/console/static/console.js"]
        # every control has a name a screen reader reads out
        unlabeled = page.evaluate(
            """[...document.querySelectorAll(
                 'input:not([type=hidden]), select, textarea, button')]
               .filter(e => !(e.labels && e.labels.length) && !e.getAttribute('aria-label')
                            && !(e.tagName === 'BUTTON' && e.textContent.trim()))
               .map(e => e.outerHTML)"""
        )
        assert unlabeled == []


def shoot(browser: Any, gw: Gateway, key: str, name: str, path: str) -> None:
    """Save the page at ``path`` at both widths, signed in with ``key``, and check it
    there (on SQLite: the pages are the same on PostgreSQL, whose run checks the flow)."""
    if gw.backend != "sqlite":  # type: ignore[attr-defined]
        return
    SHOTS.mkdir(parents=True, exist_ok=True)
    for label, (width, height) in WIDTHS.items():
        context = browser.new_context(
            viewport={"width": width, "height": height},
            extra_http_headers={"authorization": f"Bearer {key}"},
        )
        try:
            page = context.new_page()
            watch = Watch(page)
            page.goto(gw.url + path)
            file = SHOTS / f"{gw.backend}-{name}-{label}.png"  # type: ignore[attr-defined]
            page.screenshot(path=str(file), full_page=True)
            assert file.stat().st_size > 5_000
            # readable on a phone: nothing wider than the screen but the scrolling boxes
            wide = page.evaluate("document.documentElement.scrollWidth > window.innerWidth + 1")
            assert not wide, f"{name} scrolls sideways at {width} px"
            watch.check(page)
        finally:
            context.close()


def live_status(page: Any) -> None:
    """Wait until the page's event stream is open (its status line says Live). Not
    wait_for_function: its polling evaluates a string, which the console's CSP refuses."""
    page.locator("#live-status", has_text=re.compile(r"^Live$")).wait_for(timeout=20_000)


def sign_in(page: Any, gw: Gateway, who: str) -> None:
    page.goto(gw.url + "/console/runs")
    assert page.get_by_role("heading", name="Sign in").is_visible()
    page.get_by_label("API key").fill(KEYS[who])
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url("**/console/runs")


def test_an_operator_works_the_queue_from_the_page(browser: Any, gw: Gateway) -> None:
    gw.escalated("esc-resume", HOSTILE[2])
    gw.escalated("esc-abort", HOSTILE[0])
    gw.completed("done-1", {"note": HOSTILE[1]})
    gw.completed("done-2")
    shoot(browser, gw, KEYS["oncall"], "escalations", "/console/escalations")
    shoot(browser, gw, KEYS["oncall"], "run-escalated", "/console/runs/esc-resume")
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    watch = Watch(page)
    try:
        sign_in(page, gw, "oncall")
        # the list, its counts, a filter
        assert page.get_by_text("escalated: 2").is_visible()
        assert page.get_by_role("link", name="done-1").is_visible()
        page.get_by_role("link", name="escalated: 2").click()
        page.wait_for_url("**outcome=escalated**")
        rows = page.locator("table.runs tbody tr")
        assert rows.count() == 2
        assert page.get_by_role("link", name="done-1").count() == 0
        # a search by prefix
        page.get_by_label("Run id or prefix").fill("esc-r")
        page.get_by_role("button", name="Filter").click()
        page.wait_for_url("**q=esc-r**")
        assert page.locator("table.runs tbody tr").count() == 1
        watch.check(page)
        # open the run; a bad corrected proposal is refused in the page, nothing journaled
        page.get_by_role("link", name="esc-resume").click()
        page.wait_for_url("**/console/runs/esc-resume")
        assert page.get_by_text("rejected by the gate").first.is_visible()
        assert page.get_by_text(
            "The model's proposals failed the gate too many times"
        ).first.is_visible()
        seq = gw.run("esc-resume")["seq"]
        page.get_by_label("or with a corrected proposal").fill(TOO_MUCH)
        page.get_by_role("button", name="Resume").click()
        alert = page.get_by_role("alert")
        alert.wait_for()
        assert "over the refund limit of 10000" in alert.inner_text()
        assert "refund at most 10000 cents" in alert.inner_text()
        assert gw.run("esc-resume")["seq"] == seq
        watch.check(page)
        # then a good one resumes it
        page.get_by_label("or with a corrected proposal").fill(GOOD)
        page.get_by_role("button", name="Resume").click()
        page.get_by_text("resumed with the corrected proposal by oncall").wait_for()
        assert gw.run("esc-resume")["outcome"] == "running"
        # abort the other from the queue
        page.get_by_role("link", name="Escalation queue").click()
        page.wait_for_url("**/console/escalations")
        item = page.locator("section.queue-item", has_text="esc-abort")
        item.get_by_label("note (why)").fill("a duplicate of esc-resume")
        item.get_by_role("button", name="Abort the run").click()
        page.get_by_text("Run esc-abort aborted by oncall.").wait_for()
        assert page.get_by_text("No run is waiting for an operator.").is_visible()
        assert gw.run("esc-abort")["outcome"] == "failed"
        watch.check(page)
        # replay a run
        page.goto(gw.url + "/console/runs/done-1")
        page.get_by_role("link", name="Replay this run").click()
        page.get_by_text("Reproduced: all").wait_for()
        watch.check(page)
    finally:
        context.close()
    for name, path in (
        ("runs", "/console/runs"),
        ("run-aborted", "/console/runs/esc-abort"),
        ("run-completed", "/console/runs/done-1"),
        ("replay", "/console/runs/done-1/replay"),
    ):
        shoot(browser, gw, KEYS["oncall"], name, path)


def test_a_read_key_finds_no_action_and_a_page_follows_a_live_run(
    browser: Any, gw: Gateway
) -> None:
    if gw.backend == "postgres":  # type: ignore[attr-defined]
        pytest.skip("the keys and the live page are the same on both stores; once is enough")
    gw.escalated("esc-1")
    gw.start("live-1")
    context = browser.new_context(viewport={"width": 390, "height": 844})
    page = context.new_page()
    watch = Watch(page)
    try:
        page.goto(gw.url + "/console/login")
        page.get_by_label("API key").fill("not-a-key")
        page.get_by_role("button", name="Sign in").click()
        assert "that key was refused" in page.get_by_role("alert").inner_text()
        sign_in(page, gw, "reader")
        # the keyboard: the first Tab reaches the skip link, Enter moves to the content
        page.keyboard.press("Tab")
        assert page.evaluate("document.activeElement.textContent") == "Skip to content"
        page.keyboard.press("Enter")
        assert page.evaluate("location.hash") == "#main"
        page.goto(gw.url + "/console/escalations")
        assert page.get_by_role("button", name="Resume").count() == 0
        assert page.get_by_text("Your key may read, not act").is_visible()
        page.goto(gw.url + "/console/runs/esc-1")
        assert page.get_by_role("button", name="Abort the run").count() == 0
        # the live page: a proposal made elsewhere shows up without a reload
        page.goto(gw.url + "/console/runs/live-1")
        live_status(page)
        marker = page.evaluate("window.__marker = 42")
        assert marker == 42
        gw.propose("live-1", '{"tool": "refund", "args": {"order_id": "o-9", "cents": "x"}}')
        page.get_by_text("rejected by the gate").wait_for(timeout=20_000)
        assert page.evaluate("window.__marker") == 42  # the same document: not reloaded
        # the list too: a run started elsewhere appears
        page.goto(gw.url + "/console/runs")
        live_status(page)
        page.evaluate("window.__marker = 43")
        gw.start("live-2")
        page.get_by_role("link", name="live-2").wait_for(timeout=20_000)
        assert page.evaluate("window.__marker") == 43
        watch.check(page)
        # signed out, nothing is shown
        page.get_by_role("button", name="Sign out").click()
        page.goto(gw.url + "/console/runs")
        assert page.get_by_role("heading", name="Sign in").is_visible()
        assert page.get_by_text("esc-1").count() == 0
    finally:
        context.close()
    shoot(browser, gw, KEYS["reader"], "queue-read-only", "/console/escalations")
