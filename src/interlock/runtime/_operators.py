"""Operator requests handed to the process that holds a SQLite journal.

One process writes a SQLite journal (see :class:`~interlock.stores.JournalHeld`), so an
operator's ``interlock escalations resume|abort`` cannot open it while, say, an MCP proxy
serves an agent from it. It hands the request over instead: one JSON file in the
journal's *inbox* (``<db>.operators/``), written whole (a temporary file renamed), that
the holder takes (:func:`serve_operator_requests`), decides through its supervisor as
the operator's own process would (:meth:`Supervisor.resume_escalated
<interlock.runtime.Supervisor.resume_escalated>`, :meth:`~interlock.runtime.Supervisor.abort_escalated`),
and answers with a file beside it. The request is journaled by the holder, with the
operator's name; the answer says how the run stands, or the refusal's message.

The inbox lives beside the journal, with its permissions: whoever may write the journal's
directory may resume its runs, as whoever may open the journal could.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from ..core._exceptions import InterlockError, MalformedMessage

if TYPE_CHECKING:
    from ._supervisor import Supervisor

__all__ = ["OperatorRequest", "inbox", "post_operator_request", "serve_operator_requests"]

log = logging.getLogger("interlock.operators")

#: How often a holder looks for requests (seconds).
POLL = 0.25


class OperatorRequest(msgspec.Struct, frozen=True, kw_only=True):
    """``interlock escalations resume|abort`` for a live holder of the journal."""

    action: str  # "resume" or "abort"
    run_id: str
    by: str
    note: str = ""
    to: str | None = None
    payload: str | None = None


class OperatorAnswer(msgspec.Struct, frozen=True, kw_only=True):
    """What the holder did: the run as it stands (``result``, a RunResult's fields), or
    why it refused (``error``)."""

    result: dict[str, Any] | None = None
    error: str = ""


def inbox(journal: str) -> Path:
    """The inbox of the SQLite journal ``journal``: ``<journal>.operators``."""
    return Path(f"{journal}.operators")


def _write_whole(path: Path, data: bytes) -> None:
    partial = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    with open(partial, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


async def post_operator_request(
    journal: str, request: OperatorRequest, *, wait: float = 10.0
) -> OperatorAnswer | None:
    """Hand ``request`` to the process that holds ``journal`` and wait up to ``wait``
    seconds for its answer: the answer, or None if nobody took the request (it is
    withdrawn: a holder that does not serve the inbox never sees it later)."""
    folder = inbox(journal)
    os.makedirs(folder, exist_ok=True)
    name = f"{time.time_ns()}-{secrets.token_hex(4)}"
    asked = folder / f"{name}.request.json"
    answered = folder / f"{name}.answer.json"
    await trio.to_thread.run_sync(_write_whole, asked, msgspec.json.encode(request))
    answer = await _answer(answered, wait)
    if answer is not None:
        return answer
    if _claim(asked) is None:  # taken meanwhile: its answer comes
        return await _answer(answered, 60.0)
    return None  # withdrawn before anybody took it


async def _answer(path: Path, seconds: float) -> OperatorAnswer | None:
    """The answer at ``path`` once it is there (within ``seconds``), read and removed."""
    with trio.move_on_after(seconds):
        while True:
            data = _claim(path)
            if data is not None:
                return msgspec.json.decode(data, type=OperatorAnswer)
            await trio.sleep(0.05)
    return None


def _claim(path: Path) -> bytes | None:
    """The file at ``path``, read and removed (the caller has it alone); None if absent."""
    try:
        data = path.read_bytes()
        path.unlink()
    except FileNotFoundError:
        return None
    return data


async def serve_operator_requests(
    supervisor: Supervisor,
    journal: str,
    *,
    on_done: Any = None,
    poll: float = POLL,
) -> None:
    """Take the operator requests posted to ``journal``'s inbox, decide each through
    ``supervisor`` and answer it, until cancelled; ``on_done(run_id)`` hears each run
    an operator resumed or aborted (to tell its agent)."""
    folder = inbox(journal)
    while True:
        with contextlib.suppress(OSError):  # no inbox yet, or unreadable: look again later
            for entry in sorted(os.listdir(folder)):
                if entry.endswith(".request.json"):
                    await _take(supervisor, folder, entry, on_done)
        await trio.sleep(poll)


async def _take(supervisor: Supervisor, folder: Path, entry: str, on_done: Any) -> None:
    data = _claim(folder / entry)  # taken: the poster now waits for the answer
    if data is None:  # withdrawn meanwhile
        return
    answer_path = folder / entry.replace(".request.json", ".answer.json")
    try:
        request = msgspec.json.decode(data, type=OperatorRequest)
        if request.action == "abort":
            result = await supervisor.abort_escalated(
                request.run_id, by=request.by, note=request.note
            )
        elif request.action == "resume":
            handle = await supervisor.resume_escalated(
                request.run_id,
                by=request.by,
                note=request.note,
                to=request.to,
                payload=request.payload,
            )
            # an external run (the proxy's) goes on with its caller: where it stands now
            result = await handle.wait() if handle.done else supervisor.result_of(request.run_id)
        else:
            raise MalformedMessage(
                f"unknown operator action {request.action!r}; the actions are resume and abort"
            )
        answer = OperatorAnswer(result=msgspec.to_builtins(result))
        if on_done is not None:
            await on_done(request.run_id)
    except (InterlockError, msgspec.DecodeError) as exc:
        answer = OperatorAnswer(error=str(exc))
    except Exception as exc:  # a bug, or the disk: this request's, never the holder's runs
        log.exception("operator request %s failed", entry)
        answer = OperatorAnswer(error=f"the holder could not decide the request: {exc!r}")
    try:
        await trio.to_thread.run_sync(_write_whole, answer_path, msgspec.json.encode(answer))
    except OSError:  # the poster is told nothing, and says so after its wait
        log.exception("could not answer operator request %s", entry)
