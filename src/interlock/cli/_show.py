"""``interlock runs`` and ``interlock show``: what the journal holds."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

import msgspec

from ..core._conversation import Call, conversation, offered_tools
from ..core._events import (
    BreakerTripped,
    Completed,
    Escalated,
    Failed,
    IntentRecorded,
    ModelCalled,
    ProposalRejected,
    ProviderFailed,
    Reconciled,
    Resumed,
    RunStarted,
    StepProposed,
    ToolCommitted,
    ToolFailed,
    ToolInDoubt,
    Transitioned,
    event_to_builtins,
    whole_prompts,
)
from ..core._exceptions import ConfigurationError, JournalInconsistent
from ..core._hot_py import compact_failures
from ..core._view import violation_signature
from ._common import (
    _close,
    _count,
    _journal_url,
    _open_read,
    _print_json,
    _print_table,
    _record_json,
    _short,
    _table,
    _when,
)

if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence


async def _runs(args: argparse.Namespace) -> int:
    _journal_url(args)
    store = await _open_read(args)
    try:
        matching = await store.list_runs(
            machine=args.workflow, state=args.state, outcome=args.outcome
        )
    finally:
        await _close(store)
    records = matching[::-1] if args.all else matching[: -args.limit - 1 : -1]
    left_out = len(matching) - len(records)
    if args.json:
        _print_json(
            {
                "db": args.db,
                "count": len(records),
                "left_out": left_out,
                "runs": [_record_json(r) for r in records],
            }
        )
        return 0
    table = _table(
        f"{_count(len(records), 'run')} in {args.db}, newest first",
        *("run", "workflow", "state", "outcome", "events", "started", "reason"),
    )
    for r in records:
        table.add_row(
            r.run_id, r.machine, r.state, r.outcome, str(r.seq), _when(r.started), r.reason
        )
    if left_out:
        table.caption = f"{_count(left_out, 'older run')} left out; --limit N or --all shows more"
    _print_table(table)
    return 0


def _describe(event: Any) -> str:
    match event:
        case RunStarted(machine=machine, state=state, inputs=inputs):
            return f"started {machine} in {state} with {_short(inputs)}"
        case ModelCalled(model=model, raw=raw, usage=usage):
            tokens = f"({usage.prompt}+{usage.completion} tokens)"
            if event.error:  # a journal from before provider_failed
                return f"model {model} failed: {event.error} {tokens}"
            if event.defect:
                return f"model {model} answered what is not a proposal: {event.defect} {tokens}"
            return f"model {model} proposed {_short(raw)} {tokens}"
        case ProviderFailed(model=model, error=error, attempt=attempt, retry_in=retry_in):
            then = "gave up" if retry_in is None else f"asks again in {retry_in:g} s"
            return f"model {model} did not answer (failure {attempt} in a row): {error}; {then}"
        case ToolInDoubt(tool=tool, key=key, error=error):
            cause = "a crash" if event.after_crash else error
            return f"in doubt: {tool} key={key} may or may not have been applied ({cause})"
        case Reconciled(tool=tool, key=key, applied=applied, error=error):
            if applied is None:
                return f"reconcile of {tool} key={key} failed: {error}"
            return f"reconciled {tool} key={key}: " + ("applied" if applied else "not applied")
        case StepProposed(source=source, raw=raw):
            return f"{source} proposed {_short(raw)}"
        case ProposalRejected(violations=violations):
            return "rejected: " + "; ".join(
                f"[{v.code}] {v.message} -> {v.hint}" for v in violations
            )
        case IntentRecorded(tool=tool, args=args, key=key):
            line = f"intent {tool}({_short(args)}) key={key}"
            if event.next is not msgspec.UNSET:  # call and move: the move it makes on success
                data = event.data if event.data is not msgspec.UNSET else None
                line += f", then -> {event.next}" + (f" data {_short(data)}" if data else "")
            return line
        case ToolCommitted(tool=tool, result=result, attempts=attempts):
            how = (
                "as reconciled, not executed again" if event.reconciled else f"attempts {attempts}"
            )
            return f"committed {tool} -> {_short(result)} ({how})"
        case ToolFailed(tool=tool, error=error, attempts=attempts):
            if event.in_doubt is True:
                return f"failed {tool} in doubt: {error} (attempts {attempts})"
            return f"failed {tool}: {error} (attempts {attempts})"
        case Transitioned(src=src, dst=dst, reason=reason, delta=delta):
            extra = f" data {_short(delta)}" if delta else ""
            if event.delta_in_proposal:
                extra = " data: the proposal's (journaled once, above)"
            return f"{src} -> {dst} ({reason}){extra}"
        case BreakerTripped(breaker=breaker, detail=detail):
            return f"breaker {breaker} tripped: {detail}"
        case Escalated(reason=reason, detail=detail):
            return f"escalated ({reason}): {detail}"
        case Resumed(by=by, note=note, to=to):
            return f"resumed by {by}" + (f" to {to}" if to else "") + (f": {note}" if note else "")
        case Completed(output=output):
            if event.output_in_delta:
                return "completed with the transition's data"
            return f"completed with {_short(output)}"
        case Failed(reason=reason):
            return f"failed: {reason}"
    return repr(event)  # pragma: no cover - the union is closed


async def _show(args: argparse.Namespace) -> int:
    _journal_url(args)
    store = await _open_read(args)
    try:
        record = await store.get_run(args.run_id)
        events = await store.load(args.run_id)
    finally:
        await _close(store)
    # Mark runs of identical rejections the way the model saw them (compacted).
    signatures = [
        violation_signature(e.violations) if isinstance(e, ProposalRejected) else 0 for e in events
    ]
    rejected = [i for i, e in enumerate(events) if isinstance(e, ProposalRejected)]
    groups: dict[int, tuple[int, int]] = {}
    only = [signatures[i] for i in rejected]
    for first, last, count in compact_failures(only):
        for position in range(first, last + 1):
            groups[rejected[position]] = (position - first + 1, count)
    if getattr(args, "conversation", False):
        return _print_conversation(args, events)
    if args.json:
        try:
            prompts = {event.seq: prompt for event, prompt in whole_prompts(events)}
        except ValueError as exc:
            raise JournalInconsistent(f"{args.db}: {exc}") from None
        timeline = []
        for i, event in enumerate(events):
            item = event_to_builtins(event)
            if event.seq in prompts:
                item["prompt_text"] = prompts[event.seq]  # whole, however it was journaled
            if i in groups and groups[i][1] > 1:
                item["compacted"] = {"position": groups[i][0], "of": groups[i][1]}
            timeline.append(item)
        _print_json({"run": _record_json(record), "events": timeline})
        return 0
    from rich.markup import escape

    title = f"run {record.run_id} ({record.machine}): {record.outcome} in {record.state}"
    if record.reason:
        title += f" - {record.reason}"
    trace = getattr(events[0], "trace", None) if events else None
    if isinstance(trace, str) and trace.count("-") == 3:
        title += f" - trace {trace.split('-')[1]}"  # its OpenTelemetry trace
    table = _table(title, "seq", "time", "event", "what")
    for i, event in enumerate(events):
        kind = type(event).__struct_config__.tag
        mark = ""
        if i in groups and groups[i][1] > 1:
            mark = f" [compacted {groups[i][0]}/{groups[i][1]}]"
        # escape: a violation's "[code]" (and any text a model sent) is not Rich markup
        table.add_row(str(event.seq), _when(event.ts), f"{kind}{mark}", escape(_describe(event)))
    _print_table(table)
    return 0


def _print_conversation(args: argparse.Namespace, events: Sequence[Any]) -> int:
    """The request body of the run's last model call, as turns, and each call's answer."""
    try:
        calls = [(e, prompt) for e, prompt in whole_prompts(events) if isinstance(e.response, str)]
    except ValueError as exc:
        raise JournalInconsistent(f"{args.db}: {exc}") from None
    if not calls:
        raise ConfigurationError(
            f"run {args.run_id!r} has no model call with a journaled request and response (its "
            "provider is not an HTTP one); `interlock show RUN` prints its timeline"
        )
    last, request = calls[-1]
    try:
        body = json.loads(request)
    except ValueError:
        body = None
    lines = [f"model call at seq {last.seq} ({last.model}), {len(calls)} in the run:"]
    if isinstance(body, dict):
        lines.extend(_turns(body))
    else:
        lines.append(request)
    lines.append(f"answered: {_short(last.response, 2000)}")
    if last.envelope:
        lines.append(f"rejected before the gate: {last.envelope.message}")
    elif last.extra_calls:
        # several calls in one turn: the first is proposed, the others are answered as
        # not run; say which, and what came of the one that ran
        came = next(
            (
                _describe(e)
                for e in events
                if e.seq > last.seq
                and isinstance(e, ProposalRejected | IntentRecorded | ToolFailed | Transitioned)
            ),
            "nothing yet",
        )
        count = 1 + len(last.extra_calls)
        lines.append(f"answer call 1 of {count}, ran: {last.raw} -> {came}")
        lines.extend(
            f"answer call {number} of {count}, not run (one call per turn): {name}({arguments})"
            for number, (name, arguments) in enumerate(last.extra_calls, 2)
        )
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def _turns(body: dict[str, Any]) -> list[str]:
    """A request body of any of the three APIs as one line a turn (its text parts joined
    with `` | ``); a turn of several calls as one line a call, each marked as run (with
    its result) or not run. The parsing is the console's (core._conversation)."""
    out: list[str] = []
    for turn in conversation(body):
        if turn.parts or not turn.calls:
            out.append(f"[{turn.role}] {' | '.join(turn.parts)}")
        out.extend(_call_lines(turn.calls))
    tools = offered_tools(body)
    if tools:
        out.append(f"[tools] {', '.join(tools)}")
    return out


def _call_lines(calls: Sequence[Call]) -> list[str]:
    """The model's calls of one turn, a line each: of several, the one that ran (its
    result after it) and those answered as not run (one call per turn)."""
    if len(calls) == 1:
        (call,) = calls
        return [f"[assistant] call {call.name}({call.arguments}) id={call.id}"]
    lines = []
    for number, call in enumerate(calls, 1):
        if call.ran:
            mark = "ran"
            after = f" -> {_short(call.result, 400)}" if call.result is not None else ""
        else:
            mark = "not run (one call per turn)"
            after = ""
        lines.append(
            f"[assistant] call {number} of {len(calls)}, {mark}: {call.name}({call.arguments}) "
            f"id={call.id}{after}"
        )
    return lines
