"""The exception tree: expected refusals are InterlockError, bugs are InternalError."""

from __future__ import annotations

from typing import Any


class InterlockError(Exception):
    """Something interlock refused, by design."""


class MachineDefinitionError(InterlockError, ValueError):
    """A machine definition is inconsistent; raised when it is compiled."""


class ToolDefinitionError(InterlockError, ValueError):
    """A tool definition is inconsistent; raised when it is compiled."""


class UnknownMachine(InterlockError, LookupError):
    """No machine of this name is registered (with the supervisor, or in the application).

    Attributes:
      machine: the name asked for.
    """

    def __init__(self, machine: str, known: list[str] | tuple[str, ...]) -> None:
        super().__init__(
            f"machine {machine!r} is not registered; registered: {', '.join(known) or 'none'}"
        )
        self.machine = machine


class AppRefError(InterlockError, ValueError):
    """An application reference (``--app``, ``INTERLOCK_APP``, pyproject) names no application."""


class InvalidInputs(InterlockError, ValueError):
    """A run's inputs break its machine's ``inputs`` schema, or cannot be journaled."""


class NoProvider(InterlockError):
    """A machine with worker states was started with no provider to ask."""


class NotEscalated(InterlockError):
    """An operator action (resume, abort) named a run that is not in the escalation queue.

    Attributes:
      run_id: the run.
      state: the state it is in.
    """

    def __init__(self, run_id: str, outcome: str, state: str) -> None:
        super().__init__(f"run {run_id!r} is not escalated; it is {outcome} in state {state!r}")
        self.run_id = run_id
        self.state = state


class EscalationResolved(NotEscalated):
    """An operator's resume or abort named a run whose escalation an operator already
    resolved otherwise: aborted it, or resumed it elsewhere or with another payload.
    Nothing was journaled. (A repeat of what was done is answered, not refused.)

    Attributes:
      run_id: the run.
      state: the state it is in now.
      done: what was done (``interlock.core._escalation.Resolution``): the action, by whom, when.
    """

    def __init__(self, message: str, run_id: str, state: str, done: Any) -> None:
        InterlockError.__init__(self, message)
        self.run_id = run_id
        self.state = state
        self.done = done


class IllegalResumeTarget(InterlockError, ValueError):
    """An escalated run may resume only where it escalated from or in a legal next state.

    Attributes:
      run_id: the run.
      target: the state asked for.
      legal: the states it may resume in.
    """

    def __init__(self, run_id: str, target: str, origin: str, legal: list[str]) -> None:
        super().__init__(
            f"cannot resume run {run_id!r} in state {target!r}; it escalated from {origin!r} "
            f"and may resume in: {', '.join(legal)}"
        )
        self.run_id = run_id
        self.target = target
        self.legal = tuple(legal)


class UnknownState(InterlockError, ValueError):
    """A run's journal names a state its machine no longer has (the machine changed
    since the run was recorded): it cannot go on there. Nothing was journaled.

    Attributes:
      run_id: the run.
      state: the state the journal names.
      machine: the machine's name.
      states: the states the machine has now.
    """

    def __init__(self, run_id: str, state: str, machine: str, states: list[str], what: str) -> None:
        super().__init__(
            f"run {run_id!r} {what} state {state!r}, which machine {machine!r} no longer has "
            f"(its states: {', '.join(states)}); give the machine that state back, resume the "
            "run in one it has with --to / to=, or abort it"
        )
        self.run_id = run_id
        self.state = state
        self.machine = machine
        self.states = tuple(states)


class PayloadRejected(InterlockError):
    """The corrected payload an operator resumed a run with was rejected by the gate; nothing
    was journaled.

    Attributes:
      run_id: the run.
      violations: the gate's violations (``code``, ``path``, ``message``, ``hint``).
    """

    def __init__(self, run_id: str, violations: tuple[Any, ...]) -> None:
        text = "; ".join(f"[{v.code}] {v.message} ({v.hint})" for v in violations)
        super().__init__(f"payload for run {run_id!r} was rejected: {text}")
        self.run_id = run_id
        self.violations = violations


class ProtocolError(InterlockError):
    """A request that does not fit the run it is for, or a message or journal that does
    not fit the protocol. Catch this for any of its leaves; each names what to do.

    The leaves, by what a caller does about them: :class:`StaleSeq` (re-read the run and
    send again), :class:`RunEnded` (stop), :class:`RunExists` (read that run, or choose
    another id), :class:`OutOfTurn` (send what the run waits for), :class:`NotExternal`
    (let the runtime drive it), :class:`RunLeased` (wait, then retry), :class:`InvalidRunId`
    and :class:`MalformedMessage` (fix the request: it can never be valid) and
    :class:`JournalInconsistent` (run ``interlock check``: the journal is damaged).
    """


class StaleSeq(ProtocolError):
    """A request was made at a seq the run is no longer at (another request advanced it),
    or has not reached. Nothing was journaled.

    Re-read the run (its ``seq``, or the last verdict's) and send the request again at
    that seq; a retry of the very request that advanced it gets its recorded answer.
    """


class RunEnded(ProtocolError):
    """A request was sent to a run that has ended (completed or failed) or waits in the
    escalation queue: it takes no more proposals, results or reconciliations.

    Stop driving it; read its outcome. An escalated run goes on only when an operator
    resumes it.
    """


class RunExists(ProtocolError):
    """A run was started or enqueued with a run id the supervisor or the journal already
    holds; run ids are unique. Nothing was written.

    Read that run if it is the one meant (a retried create), or choose another id, or
    omit it to have one generated.
    """


class OutOfTurn(ProtocolError):
    """A request the run is not waiting for: a proposal while it waits for the outcome of
    an accepted tool call, or a result or reconciliation for a key it is not waiting for.
    Nothing was journaled.

    Re-read the run and send what it waits for: report the pending call's outcome (with
    the key its verdict gave) before proposing again.
    """


class NotExternal(ProtocolError):
    """A proposal, result or reconciliation was sent for a run the runtime drives (its
    actor, or a worker): only runs started with ``external=True`` (mode ``'external'``)
    take them from outside.

    Leave that run to the runtime, or start an external run to drive it yourself.
    """


class RunLeased(ProtocolError):
    """Another process (a worker, or another gateway) holds the run's lease and drives it.
    Nothing was journaled.

    Wait for it to finish or let go of the run (its lease expires if that process is
    gone), then retry; or send the request to the process that drives it.
    """


class InvalidRunId(ProtocolError, ValueError):
    """Run ids given that can never be valid: empty or not strings, one repeated within a
    batch, or not one per inputs. Nothing was written.

    Fix the ids (or omit them to have them generated); retrying the same ones cannot help.
    """


class MalformedMessage(ProtocolError, ValueError):
    """A message between an actor and the supervisor that cannot be decoded, or is of no
    type the receiver takes. A bug in the sender: retrying the same bytes cannot help.
    """


class RunNotFound(InterlockError, LookupError):
    """No run with this id exists in the store."""

    def __init__(self, run_id: str) -> None:
        super().__init__(f"run {run_id!r} not found")
        self.run_id = run_id


class ProviderError(InterlockError):
    """Raise from a provider for a failure to answer (not a bad answer).

    Any exception a provider raises is a provider failure: journaled, retried under the
    machine's :class:`ProviderPolicy`, never counted as the model's mistake. This one
    says more: whether retrying can help and how long the provider asked us to wait.

    Args:
      message: what failed (never include an API key).
      retryable: False for a failure that retrying cannot fix (a bad API key, a model
        that does not exist): the run escalates with ``provider_unavailable`` at once.
      retry_after: seconds the provider asked us to wait (Retry-After), if it said.
      status: the HTTP status, if there was one.
      server_message: the server's own error message (``error.message`` of an OpenAI or
        Anthropic error body, redacted), if its body had one; ``""`` when it was empty.
    """

    def __init__(
        self,
        message: str,
        *,
        retryable: bool = True,
        retry_after: float | None = None,
        status: int | None = None,
        server_message: str | None = None,
    ) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.retry_after = retry_after
        self.status = status
        self.server_message = server_message


class RequestRefused(ProviderError):
    """The server refused the shape of the request, not the load: retrying it cannot help.

    Raised for a 4xx that names no credential or address problem (not 401, 402, 403, 404,
    407) and no congestion (not 408, 409, 425, 429), and for a 5xx whose body names request
    validation (a server that answers its own validation errors as 500). The message
    names the flag of the request's shape that would fix it, where the provider knows one
    (e.g. a :class:`~interlock.providers.Profile`'s ``tool_choice``). The run escalates at
    once with ``request_refused``, never ``provider_unavailable``.

    Args:
      message: what the server said, and the fix.
      status: the HTTP status.
      server_message: as :class:`ProviderError`'s.
    """

    def __init__(
        self, message: str, *, status: int | None = None, server_message: str | None = None
    ) -> None:
        super().__init__(message, retryable=False, status=status, server_message=server_message)


class StoreError(InterlockError):
    """The store cannot be opened, read or written now (a full disk, a lost connection):
    retrying may help. Damage, which retrying cannot heal, is :class:`StoreDamaged`."""


class StoreDamaged(StoreError):
    """What the store holds is damaged (a journal frame, its events, or the runs index):
    reported, never believed. Damage does not heal: retrying cannot help. Run
    ``interlock check --db JOURNAL`` to list all the damage, and restore from a backup.
    Catch this for any kind."""


class JournalCorrupt(StoreDamaged):
    """A journal frame failed its length or checksum check."""


class JournalInconsistent(StoreDamaged, ProtocolError):
    """A run's journal events do not fit together: seqs that skip or repeat, a run that
    does not start with ``run_started``, no events at all, or an event that refers to
    data the events before it do not hold. The frames may pass their checksums; what
    they hold was written outside interlock, or lost.

    Nothing built on it is believed. Run ``interlock check --db JOURNAL`` to list all the
    damage, then restore the journal from a backup.
    """


class IndexDamaged(StoreDamaged):
    """The runs index is damaged: a row fails its checksum or disagrees with its run's
    journal, or rows are missing.

    The index is derived from the journal, so the journal may well be intact; but no
    answer built on the damaged index is given.

    Attributes:
      run_id: the run the damaged row names (as stored, so itself possibly damaged), or
        None when the damage is not one row's (rows are missing).
    """

    def __init__(self, run_id: str | None, what: str) -> None:
        where = "runs index" if run_id is None else f"runs index row of run {run_id!r}"
        super().__init__(
            f"{where} is damaged ({what}); the store was written outside interlock or its "
            "file is damaged; restore it from a backup"
        )
        self.run_id = run_id


class LeaseLost(StoreError):
    """Another worker took over a run this worker had leased."""


class ReplayDivergence(InterlockError):
    """A replayed run decided differently from its recording.

    Attributes:
      seq: the first journal sequence number where the two differ.
      expected: what the recording holds there.
      got: what the replay produced.
    """

    def __init__(self, run_id: str, seq: int, expected: str, got: str) -> None:
        super().__init__(f"run {run_id!r} diverged at seq {seq}: expected {expected}, got {got}")
        self.run_id = run_id
        self.seq = seq
        self.expected = expected
        self.got = got


class ConfigurationError(InterlockError, ValueError):
    """An argument, option or setting given to interlock cannot work as given: an App's
    machines or prices, a provider's ``base_url`` or model, a worker's store, a command
    line's flags. Raised where it is given, before anything runs; the message names the
    value and the fix. Retrying cannot help: fix the configuration.
    """


class OperatorRefused(InterlockError):
    """The process that holds a SQLite journal refused an operator's request handed to it
    (``interlock escalations resume|abort`` while an ``interlock mcp`` proxy serves the
    journal): the message is its refusal (the run is not escalated, an operator resolved
    it otherwise, the target or payload is not legal, ...), as the operator's own process
    would have raised it."""


class LifespanError(InterlockError):
    """An application's lifespan failed: it raised while opening or closing (the cause is
    chained), returned something that is not an async context manager, or was not
    entered before what it opens was used. Fix the lifespan, or enter it first.
    """


class MissingExtra(InterlockError, ImportError):
    """A feature needs a package that is not installed; the message names the extra to
    install (``pip install 'interlock[gateway]'``)."""


class InternalError(Exception):
    """A bug in interlock. Deliberately outside the InterlockError tree."""
