"""One MCP session as one run: what the proxy does with ``tools/list`` and ``tools/call``,
whatever the transport.

A ``tools/call`` is a proposal. The run's machine decides it through the supervisor's public
port (:attr:`Supervisor.external <interlock.runtime.Supervisor.external>`), exactly as the
gateway's external runs are decided: the gate (tool allowed in this state, arguments
against the schema, guards), the breakers and the budgets. Only a verified call is
forwarded, and only once its intent and idempotency key are durable; the key travels to
the upstream in the request's ``_meta`` (:data:`KEY_META`), and the upstream's answer is
journaled as the commit.

A call whose outcome the proxy does not know (the upstream died, the stream broke, the
call timed out, or the proxy itself was killed) is in doubt. It is never forwarded blind
a second time: a read-only or idempotent tool is sent again under the same key; any other
is reconciled (the machine names an upstream read-only tool and an expression that says
whether the key was applied) or the run is escalated, and every later call answers, in one
line, that the run waits for an operator.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import mcp.types as types
import msgspec
import trio
from mcp.shared.exceptions import MCPError

from ..core._events import Escalated, Resumed
from ..core._exceptions import ProtocolError
from ..core._messages import CLIENT_MODEL, Escalate, Propose, Reconciliation, Report
from ..core._view import canonical_encoder, fold

if TYPE_CHECKING:
    from ..core._machine import Machine
    from ..core._messages import ToolCall, Verdict
    from ..core._tools import Tool
    from ..runtime._supervisor import Supervisor

__all__ = [
    "KEY_META",
    "RUN_META",
    "McpRun",
    "NoRules",
    "Rules",
    "Upstream",
    "canonical_args",
]

#: The ``_meta`` key under which a forwarded call carries its idempotency key (a vendor
#: prefix of our own: the spec reserves ``modelcontextprotocol`` and ``mcp``).
KEY_META = "dev.interlock/idempotency-key"
#: The ``_meta`` key of every result: the run the call belongs to.
RUN_META = "dev.interlock/run"
#: The ``_meta`` key of a result the runtime decided: its verdict.
VERDICT_META = "dev.interlock/verdict"

#: The JSON-RPC error for a tool nobody declared (the spec's "unknown tool").
INVALID_PARAMS = -32602

#: JSON-RPC errors by which a server refuses a request before acting on it (parse error,
#: invalid request, method not found, invalid params): a call answered so was not applied.
_REFUSED = frozenset({-32700, -32600, -32601, -32602})

#: Upstream calls: ``(tool, arguments, meta) -> CallToolResult``.
Upstream = Callable[[str, dict[str, Any], dict[str, Any]], Awaitable[types.CallToolResult]]


def canonical_args(args: Any) -> bytes:
    """A call's arguments in the journal's canonical encoding (sorted keys): two calls
    with the same tool and these bytes are the same call."""
    return canonical_encoder.encode(args if args is not None else {})


class Rules(Protocol):
    """What a machine file adds to a machine for the proxy (see :mod:`._config`)."""

    def moves_to(self, tool: str) -> str | None: ...

    def approval(self, tool: str) -> bool: ...

    def reconcile(self, tool: str) -> Any: ...


class NoRules:
    """The rules of a machine given as Python (``--app``): no automatic moves, no
    approvals; a tool reconciles through its own ``reconcile`` only in hosted runs."""

    transition_tool: str | None = None

    def moves_to(self, tool: str) -> str | None:
        return None

    def approval(self, tool: str) -> bool:
        return False

    def reconcile(self, tool: str) -> Any:
        return None


def _text(
    message: str,
    *,
    error: bool,
    structured: dict[str, Any] | None = None,
    meta: dict[str, Any] | None = None,
) -> types.CallToolResult:
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=message)],
        is_error=error,
        structured_content=structured,
        _meta=meta,
    )


def listed_tools(
    machine: Machine, tools: Mapping[str, types.Tool], names: Sequence[str]
) -> types.ListToolsResult:
    """The upstream's ``tools`` among ``names``, each with the schema the gate checks its
    arguments against."""
    listed = []
    for name in names:
        tool = tools.get(name)
        if tool is None:
            continue
        schema = machine.tool_by_name[name].validator.json_schema()
        listed.append(tool.model_copy(update={"input_schema": schema or tool.input_schema}))
    return types.ListToolsResult(tools=listed)


class McpRun:
    """One agent session's run: created by :meth:`open`, driven by :meth:`list_tools` and
    :meth:`call_tool`. Calls are taken one at a time (a run has one turn at a time)."""

    def __init__(
        self,
        supervisor: Supervisor,
        machine: Machine,
        run_id: str,
        upstream: Upstream,
        upstream_tools: Sequence[types.Tool],
        rules: Any = None,
        *,
        on_state_change: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.supervisor = supervisor
        self.machine = machine
        self.run_id = run_id
        self.upstream = upstream
        self.tools = {t.name: t for t in upstream_tools}
        self.rules = rules if rules is not None else NoRules()
        self.on_state_change = on_state_change
        self._turn = trio.Lock()
        self._ended: tuple[str, str, str] | None = None  # (outcome, state, reason)
        #: The tool definitions the run started with (journaled in its inputs), by name.
        self.pinned: dict[str, Any] = {}
        #: Set when the upstream said its tool list changed: read it again before a call.
        self.stale = False
        self.refresh: Callable[[], Awaitable[Sequence[types.Tool]]] | None = None

    # -- opening a session's run ---------------------------------------------------------

    @classmethod
    async def open(
        cls,
        supervisor: Supervisor,
        machine: Machine,
        session: str,
        upstream: Upstream,
        upstream_tools: Sequence[types.Tool],
        rules: Any = None,
        *,
        inputs: Mapping[str, Any] | None = None,
        on_state_change: Callable[[], Awaitable[None]] | None = None,
        trace: str | None = None,
    ) -> McpRun:
        """The run of ``session``: its newest run if that has not completed or failed (a
        proxy restarted after a crash picks up where it stopped, its call in flight
        included, and an escalated run stays escalated until an operator resumes it),
        else a new run ``mcp-SESSION-N`` (``trace``: the ``traceparent`` of the request that
        starts it, which its spans continue with tracing on)."""
        store = supervisor.store
        prefix = f"mcp-{session}-"
        mine = [
            r for r in await store.list_runs(machine=machine.name) if r.run_id.startswith(prefix)
        ]
        mine.sort(key=lambda r: (r.started, _number(r.run_id, prefix)))
        newest = mine[-1] if mine else None
        if newest is not None and newest.outcome in ("running", "escalated"):
            self = cls(
                supervisor,
                machine,
                newest.run_id,
                upstream,
                upstream_tools,
                rules,
                on_state_change=on_state_change,
            )
            if newest.outcome == "escalated":
                self._ended = ("escalated", newest.state, newest.reason)
            else:
                run = supervisor.external.get(newest.run_id)
                if run is None:
                    events = await store.load(newest.run_id)
                    run = supervisor.external.hold(fold(machine, events), events)
                self.pinned = dict(run.inputs.get(PINNED_INPUT) or {})
            return self
        number = max((_number(r.run_id, prefix) for r in mine), default=0) + 1
        run_id = f"{prefix}{number}"
        pinned = pin(machine, upstream_tools)
        start = dict(inputs or {})
        if machine.inputs is None:  # a machine with an inputs schema keeps its own inputs
            start[PINNED_INPUT] = pinned
        await supervisor.external.start(machine.name, start, run_id=run_id, trace=trace)
        self = cls(
            supervisor,
            machine,
            run_id,
            upstream,
            upstream_tools,
            rules,
            on_state_change=on_state_change,
        )
        self.pinned = pinned
        return self

    def drifted(self, name: str) -> str | None:
        """Why ``name`` may not be called: the upstream's definition of it (description,
        schemas) is no longer the one the run started with (a "rug pull"); else None."""
        if not self.pinned or name not in self.pinned:
            return None
        tool = self.tools.get(name)
        now = _definition(tool) if tool is not None else None
        if now == self.pinned[name]:
            return None
        what = "removed it" if now is None else "changed its definition"
        return (
            f"{name} was not called: the server {what} since run {self.run_id} started "
            "(a tool must not change under a running agent)"
        )

    async def refresh_ended(self) -> bool:
        """An escalated run may have been resumed or aborted by an operator since: read
        how it stands (this supervisor's table, else the journal). Whether it changed."""
        if self._ended is None or self._ended[0] != "escalated":
            return False
        live = self.supervisor.external.get(self.run_id)
        if live is not None and not live.terminal:  # resumed here (the operators' inbox)
            self._ended = None
            return True
        record = await self.supervisor.store.get_run(self.run_id)
        if record is None or record.outcome == "escalated":
            return False
        if record.outcome == "running":  # resumed by another process (a shared store)
            events = await self.supervisor.store.load(self.run_id)
            self.supervisor.external.forget(self.run_id)
            self.supervisor.external.hold(fold(self.machine, events), events)
            self._ended = None
        else:
            self._ended = (record.outcome, record.state, record.reason)
        return True

    async def _drifted(self, name: str, why: str) -> types.CallToolResult:
        """The answer to a call of ``name``, whose definition changed under the run: the
        run is escalated (an operator decides whether the agent goes on with a server
        that changed), once; after an operator resumed it, the changed tool stays
        refused and the others go on."""
        structured = {"pinned": self.pinned.get(name), "tool": name}
        meta = {RUN_META: self.run_id, VERDICT_META: "definition-changed"}
        if not await self._resumed_after_drift(name):
            detail = (
                f"{why}. Abort the run if the server should not have changed (the agent's "
                "next session starts a new run, pinned to what the server offers then), or "
                f"resume it to go on without {name}, which stays refused in this run"
            )
            await self._submit(
                Escalate(run_id=self.run_id, reason=DEFINITION_CHANGED, detail=detail)
            )
            if self._ended is not None:
                result = self._ended_result()
                return result.model_copy(
                    update={
                        "structured_content": {**(result.structured_content or {}), **structured}
                    }
                )
        return _text(drift_refusal(why), error=True, structured=structured, meta=meta)

    async def _resumed_after_drift(self, name: str) -> bool:
        """Whether an operator resumed this run after it escalated for ``name``'s change."""
        escalated = False
        for event in await self.supervisor.store.load(self.run_id):
            if isinstance(event, Escalated):
                escalated = event.reason == DEFINITION_CHANGED and event.detail.startswith(
                    f"{name} was not called"
                )
            elif isinstance(event, Resumed) and escalated:
                return True
        return False

    # -- tools/list ----------------------------------------------------------------------

    @property
    def outcome(self) -> str:
        """``running`` until the run ends (or escalates): then how it ended."""
        return self._ended[0] if self._ended is not None else "running"

    @property
    def state(self) -> str:
        if self._ended is not None:
            return self._ended[1]
        run = self.supervisor.external.get(self.run_id)
        return run.state if run is not None else "?"

    def allowed(self) -> tuple[str, ...]:
        """The tools the run allows now (none once it ended or escalated)."""
        if self._ended is not None:
            return ()
        run = self.supervisor.external.get(self.run_id)
        if run is None:
            return ()
        return self.supervisor.view(self.run_id).allowed_tools

    def list_tools(self) -> types.ListToolsResult:
        """The upstream's tools that the run's current state allows, each with the schema
        the gate checks its arguments against."""
        return listed_tools(self.machine, self.tools, self.allowed())

    # -- tools/call ----------------------------------------------------------------------

    async def call_tool(
        self, name: str, arguments: Mapping[str, Any] | None, *, written: str | None = None
    ) -> types.CallToolResult:
        """Decide a ``tools/call``; forward it once it is verified and durable.

        ``written``: the arguments as their writer wrote them (JSON text), where a
        reader's dict would hide a defect (a key named twice): the gate reads those."""
        if name not in self.machine.tool_by_name:
            known = ", ".join(sorted(self.machine.tool_by_name)) or "none"
            raise MCPError(INVALID_PARAMS, f"unknown tool {name!r}; the tools are: {known}")
        args = dict(arguments or {})
        async with self._turn:
            if self._ended is not None and self._ended[0] == "escalated":
                await self.refresh_ended()
            if self._ended is not None:
                return self._ended_result()
            if self.stale and self.refresh is not None:
                self.tools = {t.name: t for t in await self.refresh()}
                self.stale = False
            run = self.supervisor.external.get(self.run_id)
            if run is not None and run.pending is not None:
                # the call in flight was verified against the pinned definitions: settle it
                settled = await self._settle_pending(run.pending, name, args)
                if settled is not None:
                    return settled
                if self._ended is not None:
                    return self._ended_result()
            drift = self.drifted(name)
            if drift is not None:
                return await self._drifted(name, drift)
            proposal: dict[str, Any] = {"tool": name, "args": args}
            target = self.rules.moves_to(name)
            if target is not None and name in self.allowed():
                # the machine file moves the run when this call commits (a call the state
                # does not allow is refused for that alone, not for a move it never asked)
                proposal["next"] = target
            if written is not None:  # as written: the gate reads them exactly
                raw = f'{{"tool":{msgspec.json.encode(name).decode()},"args":{written}}}'
            else:
                raw = msgspec.json.encode(proposal).decode()
            state = self.state
            verdict = await self._decide(Propose(run_id=self.run_id, raw=raw, model=CLIENT_MODEL))
            if verdict.execute is None:
                if verdict.accepted and verdict.result is not None:  # committed before
                    return self._result_of(verdict.result, None)
                if self._ended is not None:
                    return self._ended_result(verdict.violations)
                return self._rejected(verdict)
            answer = await self._execute(verdict, name)
            await self._moved(state)
            return answer

    async def _execute(self, verdict: Verdict, name: str) -> types.CallToolResult:
        """Forward ``verdict.execute`` (again, while the runtime asks for a retry) and
        journal the outcome; then move the run where the machine file says."""
        while verdict.execute is not None:
            call = verdict.execute
            if not self.machine.tool_by_name[call.tool].read_only:
                # a call that may change something: its intent and key are durable first
                await self._durable()
            result, report = await self._forward(call)
            verdict = await self._decide(report)
            if verdict.reconcile is not None and self._ended is None:
                # in doubt, and the machine says how to ask: ask, then commit or run once
                verdict, answer = await self._reconciled(verdict.reconcile, "reconciled: applied")
                if answer is not None:
                    return answer
                continue
            if report.ok and verdict.execute is None:
                return self._with_meta(result, call.key)
            if verdict.execute is None:
                if self._ended is not None:
                    return self._ended_result(verdict.violations, result)
                if result is not None:  # the upstream answered with an error: hand it back
                    return self._with_meta(result, call.key)
                return _text(
                    f"{name} failed: {report.error}", error=True, meta={RUN_META: self.run_id}
                )
        return self._ended_result() if self._ended is not None else self._rejected(verdict)

    async def _forward(self, call: ToolCall) -> tuple[types.CallToolResult | None, Report]:
        """Send ``call`` upstream with its key; the :class:`Report` of what came back."""
        tool = self.machine.tool_by_name[call.tool]
        timeout = tool.timeout if tool.timeout and math.isfinite(tool.timeout) else math.inf
        started = trio.current_time()
        try:
            with trio.fail_after(timeout):
                meta = {KEY_META: call.key}
                tracing = self.supervisor.tracing
                if tracing is not None:  # the upstream's spans join the run's trace
                    parent = tracing.traceparent(self.run_id, call.key)
                    if parent:
                        meta["traceparent"] = parent
                result = await self.upstream(call.tool, dict(call.args or {}), meta)
        except trio.TooSlowError:
            return None, self._failure(
                call, f"the upstream did not answer within {timeout:g} s", started
            )
        except MCPError as exc:
            if exc.code not in _REFUSED:  # e.g. -32000, the connection closed: in doubt
                return None, self._failure(
                    call, f"the upstream call failed: {exc.message} (JSON-RPC {exc.code})", started
                )
            # The upstream refused the request before running the tool (unknown tool,
            # invalid params): nothing was applied.
            return None, Report(
                run_id=self.run_id,
                key=call.key,
                ok=False,
                applied=False,
                error=f"the upstream refused the call: {exc.message} (JSON-RPC {exc.code})",
                latency=trio.current_time() - started,
            )
        except RuntimeError as exc:
            if "structured content" not in str(exc):  # not the SDK's result check
                return None, self._failure(call, f"the upstream call failed: {exc!r}", started)
            # The server answered, so the call ran, with a result its own outputSchema
            # refuses: applied, and not to be taken as an answer.
            return self._bad_result(
                call, f"the server's result breaks its outputSchema: {exc}", started
            )
        except Exception as exc:  # the upstream died or the stream broke: in doubt
            return None, self._failure(call, f"the upstream connection failed: {exc!r}", started)
        latency = trio.current_time() - started
        if result.is_error:
            # The tool ran and said it failed: the upstream answered, so nothing is in doubt.
            text = " ".join(c.text for c in result.content if isinstance(c, types.TextContent))
            return result, Report(
                run_id=self.run_id,
                key=call.key,
                ok=False,
                applied=False,
                error=text or "the tool reported an error",
                latency=latency,
            )
        check = getattr(self.rules, "check_result", None)
        if check is not None:
            run = self.supervisor.external.get(self.run_id)
            why = check(
                call.tool,
                _structured(result),
                dict(call.args or {}),
                self.state,
                dict(run.inputs) if run is not None else {},
            )
            if why is not None:
                return self._bad_result(call, why, started)
        dumped = result.model_dump(mode="json", by_alias=True, exclude_none=True)
        dumped.pop("_meta", None)
        return result, Report(
            run_id=self.run_id, key=call.key, ok=True, result=dumped, latency=latency
        )

    def _bad_result(
        self, call: ToolCall, why: str, started: float
    ) -> tuple[types.CallToolResult, Report]:
        """A call the server ran whose result fails a check: a failure that was applied
        (a read-only tool's goes back to the agent; another's leaves the run in doubt)."""
        answer = _text(why, error=True, meta={RUN_META: self.run_id, KEY_META: call.key})
        return answer, Report(
            run_id=self.run_id,
            key=call.key,
            ok=False,
            applied=True,
            error=why,
            latency=trio.current_time() - started,
        )

    def _failure(self, call: ToolCall, error: str, started: float) -> Report:
        return Report(
            run_id=self.run_id,
            key=call.key,
            ok=False,
            applied=None,
            error=error,
            retryable=True,
            latency=trio.current_time() - started,
        )

    async def _settle_pending(
        self, pending: Any, name: str, args: dict[str, Any]
    ) -> types.CallToolResult | None:
        """A call was in flight when the proxy stopped. Settle it before anything else:
        sent again under its key if that is safe, reconciled where the machine says how,
        else escalated. The answer to this call if it is that same call re-issued, else
        None (go on with this call)."""
        same = pending.tool == name and canonical_args(pending.args) == canonical_args(args)
        tool: Tool = self.machine.tool_by_name[pending.tool]
        how = self.rules.reconcile(pending.tool)
        if tool.read_only or tool.idempotent:
            verdict_call = _Call(pending.tool, pending.args, pending.key)
            result, report = await self._forward(verdict_call)  # type: ignore[arg-type]
            verdict = await self._submit(report)
            if verdict.execute is not None:
                result = await self._execute(verdict, pending.tool)
            return self._with_meta(result, pending.key) if same and result is not None else None
        if how is not None:
            verdict, answer = await self._reconciled(pending, "reconciled: applied before")
            if answer is not None:  # committed (the run may have moved on, or ended)
                return answer if same else None
            if verdict.execute is not None:  # not applied: the runtime lets it run once
                result = await self._execute(verdict, pending.tool)
                return result if same else None
            return None
        await self._submit(
            Report(
                run_id=self.run_id,
                key=pending.key,
                ok=False,
                applied=None,
                error="the proxy stopped before the upstream answered; the call may have been applied",
            )
        )
        return None

    async def _reconciled(
        self, pending: Any, note: str
    ) -> tuple[Verdict, types.CallToolResult | None]:
        """Ask whether ``pending`` (a call in doubt) was applied, the way the machine file
        says, and journal the answer: the verdict (a commit, the call to run once, or an
        escalation) and, if it was applied, the answer to give (what the check saw)."""
        applied, recorded = await self._reconcile(self.rules.reconcile(pending.tool), pending)
        verdict = await self._submit(
            Reconciliation(
                run_id=self.run_id,
                key=pending.key,
                applied=applied,
                result=recorded,
                error="" if applied is not None else "the reconcile tool could not say",
            )
        )
        if not applied:
            return verdict, None
        meta = {RUN_META: self.run_id, KEY_META: pending.key, VERDICT_META: note}
        seen = msgspec.json.encode(recorded).decode()
        tool = self.tools.get(pending.tool)
        if tool is not None and tool.output_schema is not None:
            # NOTE: the tool's own answer was lost, and a success must carry structured
            # content that fits its outputSchema: say it was applied, as an error result
            message = (
                f"{pending.tool} was applied (key {pending.key}), but its answer was lost; "
                f"it is committed, so do not call it again. What the server shows: {seen}"
            )
            return verdict, _text(message, error=True, meta=meta)
        return verdict, _text(seen, error=False, meta=meta)

    async def _reconcile(self, how: Any, pending: Any) -> tuple[bool | None, Any]:
        """Ask the upstream's read-only tool whether ``pending`` was applied."""
        try:
            with trio.fail_after(30):
                result = await self.upstream(how.tool, dict(getattr(how, "args", None) or {}), {})
            seen = _structured(result)
            applied = how.applied(seen, dict(pending.args or {}), pending.key)
        except Exception:
            return None, None
        return applied, seen if applied else None

    async def _moved(self, before: str) -> None:
        """Tell the client its tool list changed if the run left state ``before``."""
        if self.state != before and self.on_state_change is not None:
            await self.on_state_change()

    async def transition(self, target: str) -> types.CallToolResult:
        """The agent asks to move the run to ``target`` (the machine file's transition tool)."""
        async with self._turn:
            if self._ended is not None:
                return self._ended_result()
            raw = msgspec.json.encode({"next": target}).decode()
            verdict = await self._submit(Propose(run_id=self.run_id, raw=raw, model=CLIENT_MODEL))
            if not verdict.accepted:
                return (
                    self._ended_result(verdict.violations)
                    if self._ended
                    else self._rejected(verdict)
                )
            if self.on_state_change is not None:
                await self.on_state_change()
            return _text(f"moved to {verdict.state}", error=False, meta={RUN_META: self.run_id})

    # -- answers ---------------------------------------------------------------------------

    async def _submit(self, msg: Propose | Report | Reconciliation | Escalate) -> Verdict:
        """Decide ``msg`` and return its verdict once its events are durable."""
        try:
            verdict = await self.supervisor.external.submit(msg)
        except ProtocolError as exc:
            self._refused(exc)
        await self._settled(verdict)
        return verdict

    async def _decide(self, msg: Propose | Report | Reconciliation) -> Verdict:
        """Decide ``msg`` now and return its verdict at once, its events on their way to
        the journal (written before any later verdict of the run is durable): what is
        answered before they are durable is what a crash may lose harmlessly (a
        rejection, a read-only call's intent or result, a result the agent saw; the
        call after a crash is then in doubt and settled as such). An intent that must
        be durable before its call is forwarded waits in :meth:`_durable`; a run that
        ended or escalated waits here."""
        external = self.supervisor.external
        if external.get(self.run_id) is None:  # not live here: submit loads it again
            return await self._submit(msg)
        verdict = external.decide_many([msg])[0]
        if isinstance(verdict, ProtocolError):
            self._refused(verdict)
        if isinstance(verdict, Exception):
            raise verdict
        if verdict.outcome != "running":
            await external.sync(self.run_id)
            external.settle(self.run_id)
            await self._settled(verdict)
        # NOTE: no checkpoint of its own: what the caller does next (forward the call,
        # or send the answer) is one
        return verdict

    async def _durable(self) -> None:
        """Wait until every verdict of the run decided so far is durable."""
        await self.supervisor.external.sync(self.run_id)

    def _refused(self, exc: ProtocolError) -> NoReturn:
        self._ended = ("stopped", self.state, str(exc))
        raise MCPError(-32603, f"interlock refused the request: {exc}") from None

    async def _settled(self, verdict: Verdict) -> None:
        if verdict.outcome != "running":
            reason = "; ".join(v.message for v in verdict.violations)
            record = None
            with contextlib.suppress(Exception):
                record = await self.supervisor.store.get_run(self.run_id)
            if record is not None and record.reason:
                reason = record.reason + (f" ({record.detail})" if record.detail else "")
            self._ended = (verdict.outcome, verdict.state, reason)

    def _rejected(self, verdict: Verdict) -> types.CallToolResult:
        lines = [f"{v.message}; {v.hint}" if v.hint else v.message for v in verdict.violations]
        structured = {
            "violations": [msgspec.to_builtins(v) for v in verdict.violations],
            "state": verdict.state,
        }
        return _text(
            "\n".join(lines) or "rejected",
            error=True,
            structured=structured,
            meta={RUN_META: self.run_id, VERDICT_META: "rejected"},
        )

    def _ended_result(
        self, violations: Sequence[Any] = (), result: Any = None
    ) -> types.CallToolResult:
        outcome, state, reason = self._ended or ("stopped", self.state, "")
        if outcome == "escalated":
            text = (
                f"run {self.run_id} is escalated ({reason or 'a breaker tripped'}) and waits for "
                f"an operator: `interlock escalations resume {self.run_id}` "
                "resumes it; until then no tool is called"
            )
        else:
            text = f"run {self.run_id} has {outcome} in {state}{f' ({reason})' if reason else ''}; no tool is called"
        structured = {
            "outcome": outcome,
            "state": state,
            "reason": reason,
            "violations": [msgspec.to_builtins(v) for v in violations],
        }
        return _text(
            text,
            error=True,
            structured=structured,
            meta={RUN_META: self.run_id, VERDICT_META: outcome},
        )

    def _with_meta(
        self, result: types.CallToolResult | None, key: str | None
    ) -> types.CallToolResult:
        if result is None:
            return _text("done", error=False, meta={RUN_META: self.run_id})
        meta = dict(result.meta or {})
        meta[RUN_META] = self.run_id
        if key is not None:
            meta[KEY_META] = key
        return result.model_copy(update={"meta": meta})

    def _result_of(self, recorded: Any, key: str | None) -> types.CallToolResult:
        """A result the journal holds (a call committed before), as the upstream gave it."""
        try:
            result = types.CallToolResult.model_validate(recorded)
        except Exception:
            result = _text(msgspec.json.encode(recorded).decode(), error=False)
        return self._with_meta(result, key)


class _Call(msgspec.Struct, frozen=True):
    tool: str
    args: Any
    key: str


#: The run input under which a run started by the proxy pins its tools' definitions.
PINNED_INPUT = "mcp_tools"


def _definition(tool: types.Tool) -> dict[str, Any]:
    """What a tool is, for pinning: its description and schemas, as the server sent them."""
    dumped = tool.model_dump(mode="json", by_alias=True, exclude_none=True)
    return {k: dumped[k] for k in ("description", "inputSchema", "outputSchema") if k in dumped}


def pin(machine: Machine, tools: Sequence[types.Tool]) -> dict[str, Any]:
    """The definitions of the machine's tools among ``tools``, by name."""
    return {t.name: _definition(t) for t in tools if t.name in machine.tool_by_name}


#: The escalation reason of a run whose server changed a tool's definition under it.
DEFINITION_CHANGED = "definition_changed"


def drift_refusal(why: str) -> str:
    return (
        f"{why}; the run keeps the definitions it started with, and an operator resumed "
        "it without this tool: start a new session (a new run) to use the new definition"
    )


def _structured(result: types.CallToolResult) -> Any:
    """What a result says, as data: its structured content, else its text parsed as JSON
    where it is JSON (most servers put their answer there), else the text."""
    if result.structured_content is not None:
        return result.structured_content
    text = "".join(c.text for c in result.content if isinstance(c, types.TextContent))
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError:
        return text


def _number(run_id: str, prefix: str) -> int:
    tail = run_id[len(prefix) :]
    return int(tail) if tail.isdigit() else 0
