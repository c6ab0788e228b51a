"""Machine spec: states, edges and tools, compiled once into integer tables."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from ._exceptions import InvalidInputs, MachineDefinitionError
from ._hotpath import MAX_IDS, Tables
from ._pacing import backoff_delay
from ._tools import Tool, compile_schema

if TYPE_CHECKING:
    import random
    from collections.abc import Callable, Mapping

    from ._tools import Validator
    from ._view import RunView

#: Terminal states every machine has. ESCALATE parks a run for a human; FAILED ends it.
ESCALATE = "ESCALATE"
"""A terminal state every machine has: a run parked for a human (a breaker trip, a call
in doubt), which an operator resumes or aborts."""
FAILED = "FAILED"
"""A terminal state every machine has: a run that gave up or was aborted."""
#: Success terminal states a machine may move to without declaring them.
SUCCESS_STATES = ("COMPLETED", "DONE")
#: The default cap on one proposal's raw bytes (``Machine.max_proposal_bytes``).
MAX_PROPOSAL_BYTES = 256 * 1024


class Call(msgspec.Struct, frozen=True):
    """A step's (or model's) proposal to call ``tool`` with ``args``."""

    tool: str
    args: dict[str, Any] = {}


class Go(msgspec.Struct, frozen=True):
    """A step's (or model's) proposal to move to ``next``, merging ``data`` into the run's data."""

    next: str
    data: dict[str, Any] = {}


Action = Call | Go
_action_encoder = msgspec.json.Encoder()


def encode_action(action: Action) -> bytes:
    """Return the JSON proposal for ``action``, exactly as a model would send it."""
    if isinstance(action, Call):
        return _action_encoder.encode({"tool": action.tool, "args": action.args})
    if action.data:
        return _action_encoder.encode({"next": action.next, "data": action.data})
    return _action_encoder.encode({"next": action.next})


@dataclass(frozen=True)
class Worker:
    """A state where the model proposes: one of ``tools``, or a move to one of ``next``.

    Attributes:
      next: the states the model may move to from here.
      tools: the tools the model may call here.
      instructions: what the model is told to do in this state.
      data: optional schema for the ``data`` a transition out of this state carries.
      max_proposal_bytes: the largest proposal accepted here; None for the machine's.
      call_and_move: also accept a call that names the state to move to once it
        succeeds, ``{"tool": NAME, "args": {...}, "next": STATE, "data": {...}}``: the
        call and the move are both verified before the tool runs, and the move is made
        when the call commits, with no second model call. Off by default.
    """

    next: Sequence[str]
    tools: Sequence[str] = ()
    instructions: str = ""
    data: Any = None
    max_proposal_bytes: int | None = None
    call_and_move: bool = False


@dataclass(frozen=True)
class Step:
    """A deterministic state: ``fn(view)`` returns the next :class:`Call` or :class:`Go`.

    ``fn`` must be pure: the same view gives the same action, no I/O (side effects go
    through a tool, by returning a :class:`Call`). ``max_proposal_bytes`` caps the
    encoded action, as for a :class:`Worker`; None for the machine's cap.
    """

    fn: Callable[[RunView], Action]
    next: Sequence[str]
    tools: Sequence[str] = ()
    max_proposal_bytes: int | None = None


@dataclass(frozen=True)
class Budgets:
    """Per-run limits. A run that reaches one trips the matching breaker.

    Attributes:
      tokens: model tokens (prompt + completion) the run may use.
      steps: proposals (model or step) the run may make.
      deadline: seconds from the run's start.
    """

    tokens: int = 200_000
    steps: int = 100
    deadline: float = 3600.0


@dataclass(frozen=True)
class BreakerPolicy:
    """When breakers trip.

    Attributes:
      consecutive_failures: rejections and tool failures in a row that trip the run.
      repeats: how many times the same call (tool + canonical args) may be proposed
        in one run; the next identical proposal trips the run.
      circuit_failures: consecutive failures of a tool, across all runs, that open its circuit.
      circuit_cooldown: seconds an open circuit stays open before one trial call.
    """

    consecutive_failures: int = 3
    repeats: int = 3
    circuit_failures: int = 5
    circuit_cooldown: float = 30.0


@dataclass(frozen=True)
class ProviderPolicy:
    """How a run waits for its model, and when it stops asking.

    A provider's failure (it raised, timed out, or answered 429/5xx) is not the model's
    mistake: it is journaled as ``provider_failed``, never counted as a rejection, and
    the call is retried with exponential backoff and jitter (a Retry-After the provider
    reports wins). When ``attempts`` calls in a row have failed, or retrying would go
    past ``max_elapsed`` seconds since the first of them, or the provider says the
    failure is permanent (``ProviderError(retryable=False)``), the run escalates with
    reason ``provider_unavailable``; a :class:`~interlock.errors.RequestRefused` (the server
    refused the request's shape) escalates it at once with ``request_refused``.

    Attributes:
      timeout: seconds one model call may take; past it the call is a provider failure.
      attempts: model calls in a row that may fail before the run escalates.
      base: seconds before the first retry, doubled after each.
      cap: the longest wait in seconds between two calls, Retry-After included.
      max_elapsed: seconds from the first failure of a row to the last retry.
      jitter: draw each wait uniformly from [wait/2, wait].
    """

    timeout: float = 120.0
    attempts: int = 5
    base: float = 1.0
    cap: float = 30.0
    max_elapsed: float = 300.0
    jitter: bool = True

    def delay(self, attempt: int, retry_after: float | None, rng: random.Random) -> float:
        """Return the seconds to wait after failed call number ``attempt`` (1-based)."""
        return backoff_delay(
            attempt, retry_after, rng, base=self.base, cap=self.cap, jitter=self.jitter
        )


@dataclass(frozen=True, eq=False)
class Machine:
    """A run's state machine. Compiled once, when constructed.

    Args:
      name: the machine's name, as runs and metrics refer to it.
      initial: the state a run starts in.
      states: the non-terminal states, each a :class:`Worker` or a :class:`Step`.
      tools: every tool any state may call.
      success: extra success terminal states (COMPLETED and DONE always are).
      on_breaker: where a tripped breaker sends a run: ``ESCALATE`` or the name of a
        :class:`Step` state that computes a fallback answer.
      budgets: per-run limits.
      breakers: breaker thresholds.
      inputs: optional schema the run's inputs must satisfy at start.
      provider_policy: the model call's timeout and how provider failures are retried.
      max_proposal_bytes: the largest proposal (raw bytes) the gate reads, in every
        state that does not set its own; a larger one is rejected before parsing.

    Raises:
      MachineDefinitionError: the definition is inconsistent (the message names the
        state, edge or tool).
    """

    name: str
    initial: str
    states: Mapping[str, Worker | Step]
    tools: Sequence[Tool] = ()
    success: Sequence[str] = ()
    on_breaker: str = ESCALATE
    budgets: Budgets = field(default_factory=Budgets)
    breakers: BreakerPolicy = field(default_factory=BreakerPolicy)
    inputs: Any = None
    provider_policy: ProviderPolicy = field(default_factory=ProviderPolicy)
    max_proposal_bytes: int = MAX_PROPOSAL_BYTES
    tables: Tables = field(init=False, repr=False)
    tool_by_name: Mapping[str, Tool] = field(init=False, repr=False)
    success_states: frozenset[str] = field(init=False, repr=False)
    data_validators: Mapping[str, Validator] = field(init=False, repr=False)
    input_validator: Validator | None = field(init=False, repr=False)
    gate_plans: dict[str, Any] = field(init=False, repr=False, default_factory=dict)
    """The gate's per-state precomputation, filled on first use (see ``_gate._Plan``)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise MachineDefinitionError("machine name must not be empty")
        tools: dict[str, Tool] = {}
        for tool in self.tools:
            if tool.name in tools:
                raise MachineDefinitionError(
                    f"machine {self.name!r}: duplicate tool {tool.name!r}; tool names must be unique"
                )
            tools[tool.name] = tool
        success = tuple(dict.fromkeys((*SUCCESS_STATES, *self.success)))
        terminals = (*success, ESCALATE, FAILED)
        for name in self.states:
            if name in terminals:
                raise MachineDefinitionError(
                    f"machine {self.name!r}: state {name!r} is terminal and cannot have a spec"
                )
            if not isinstance(self.states[name], Worker | Step):
                raise MachineDefinitionError(
                    f"machine {self.name!r}: state {name!r} must be a Worker or a Step; "
                    f"got {type(self.states[name]).__name__}"
                )
        if self.initial not in self.states:
            raise MachineDefinitionError(
                f"machine {self.name!r}: initial state {self.initial!r} is not declared; "
                f"declared states: {', '.join(self.states) or 'none'}"
            )
        used_terminals = [
            t
            for t in terminals
            if t in (ESCALATE, FAILED) or any(t in spec.next for spec in self.states.values())
        ]
        names = [*self.states, *used_terminals]
        if len(names) > MAX_IDS:
            raise MachineDefinitionError(
                f"machine {self.name!r} has {len(names)} states; at most {MAX_IDS} are supported"
            )
        if len(tools) > MAX_IDS:
            raise MachineDefinitionError(
                f"machine {self.name!r} has {len(tools)} tools; at most {MAX_IDS} are supported"
            )
        ids = {name: i for i, name in enumerate(names)}
        tool_names = list(tools)
        tool_ids = {name: i for i, name in enumerate(tool_names)}
        edges = [0] * len(names)
        tool_masks = [0] * len(names)
        for name, spec in self.states.items():
            _check_names(self.name, name, "next", spec.next)
            _check_names(self.name, name, "tools", spec.tools)
            if isinstance(spec, Step) and not callable(spec.fn):
                raise MachineDefinitionError(
                    f"machine {self.name!r}: state {name!r}: Step needs a function view -> "
                    f"Call | Go; got {spec.fn!r}"
                )
            if isinstance(spec, Worker) and spec.call_and_move not in (True, False):
                raise MachineDefinitionError(
                    f"machine {self.name!r}: state {name!r}: call_and_move must be True or "
                    f"False; got {spec.call_and_move!r}"
                )
            if isinstance(spec, Worker) and spec.call_and_move and not spec.tools:
                raise MachineDefinitionError(
                    f"machine {self.name!r}: state {name!r} sets call_and_move but allows no "
                    "tools; give it tools=[...] or leave call_and_move off"
                )
            if not spec.next:
                raise MachineDefinitionError(
                    f"machine {self.name!r}: state {name!r} has no way out; give it at least one next state"
                )
            for dst in spec.next:
                if dst not in ids:
                    raise MachineDefinitionError(
                        f"machine {self.name!r}: edge {name} -> {dst} names an unknown state {dst!r}; "
                        f"known states: {', '.join(names)}"
                    )
                edges[ids[name]] |= 1 << ids[dst]
            for tool_name in spec.tools:
                if tool_name not in tool_ids:
                    raise MachineDefinitionError(
                        f"machine {self.name!r}: state {name!r} allows unknown tool {tool_name!r}; "
                        f"declared tools: {', '.join(tool_names) or 'none'}"
                    )
                tool_masks[ids[name]] |= 1 << tool_ids[tool_name]
        if self.on_breaker != ESCALATE:
            target = self.states.get(self.on_breaker)
            if not isinstance(target, Step):
                raise MachineDefinitionError(
                    f"machine {self.name!r}: on_breaker must be 'ESCALATE' or the name of a Step "
                    f"state; got {self.on_breaker!r}"
                )
        _check_provider_policy(self.name, self.provider_policy)
        _check_proposal_cap(self.name, "", self.max_proposal_bytes)
        for name, spec in self.states.items():
            if spec.max_proposal_bytes is not None:
                _check_proposal_cap(self.name, name, spec.max_proposal_bytes)
        reachable = _reachable(self.initial, self.states)
        if self.on_breaker != ESCALATE:
            reachable |= _reachable(self.on_breaker, self.states)
        for name in self.states:
            if name not in reachable:
                raise MachineDefinitionError(
                    f"machine {self.name!r}: state {name!r} is unreachable from {self.initial!r}"
                )
        if not any(s in reachable for s in success):
            raise MachineDefinitionError(
                f"machine {self.name!r}: no success terminal state ({', '.join(success)}) is "
                f"reachable from {self.initial!r}"
            )
        terminal_mask = 0
        for name in used_terminals:
            terminal_mask |= 1 << ids[name]
        data_validators = {
            name: compile_schema(spec.data, f"{self.name}.{name}.data")
            for name, spec in self.states.items()
            if isinstance(spec, Worker) and spec.data is not None
        }
        setattr_ = object.__setattr__
        setattr_(self, "states", dict(self.states))
        setattr_(self, "tools", tuple(self.tools))
        setattr_(self, "tables", Tables(names, tool_names, edges, tool_masks, terminal_mask))
        setattr_(self, "tool_by_name", tools)
        setattr_(self, "success_states", frozenset(success))
        setattr_(self, "data_validators", data_validators)
        setattr_(
            self,
            "input_validator",
            None if self.inputs is None else compile_schema(self.inputs, f"{self.name}.inputs"),
        )

    @property
    def needs_provider(self) -> bool:
        """Whether a run of this machine needs a model: it has a worker state."""
        return any(isinstance(spec, Worker) for spec in self.states.values())

    def check_inputs(self, inputs: Mapping[str, Any] | None) -> dict[str, Any]:
        """The inputs of a new run, as its ``run_started`` event will hold them.

        Raises:
          InvalidInputs: the journal cannot hold them, or they break the machine's
            ``inputs`` schema (the message names each violation).
        """
        from ._events import unjournalable  # _events needs this module's names

        payload = dict(inputs or {})
        problem = unjournalable(payload, "inputs")
        if problem is not None:
            raise InvalidInputs(
                f"inputs of machine {self.name!r} cannot be journaled: {problem}; pass "
                "JSON-like values (str, int within 64 bits, float, bool, None, lists and "
                "dicts of them)"
            )
        if self.input_validator is not None:
            _, violations = self.input_validator.validate_json(_action_encoder.encode(payload))
            if violations:
                text = "; ".join(v.message.replace("args", "inputs", 1) for v in violations)
                raise InvalidInputs(f"inputs of machine {self.name!r} are invalid: {text}")
        return payload

    def is_terminal(self, state: str) -> bool:
        """Return whether ``state`` ends a run."""
        return state in self.success_states or state in (ESCALATE, FAILED)

    def outcome(self, state: str) -> str:
        """Return ``completed``, ``escalated``, ``failed`` or ``running`` for a run in ``state``."""
        if state in self.success_states:
            return "completed"
        if state == ESCALATE:
            return "escalated"
        if state == FAILED:
            return "failed"
        return "running"


def _check_proposal_cap(machine: str, state: str, cap: object) -> None:
    if type(cap) is not int or cap < 1:
        where = f"machine {machine!r}" + (f", state {state!r}" if state else "")
        fix = (
            "leave it None for the machine's cap"
            if state
            else f"the default is {MAX_PROPOSAL_BYTES}, 256 KiB"
        )
        raise MachineDefinitionError(
            f"{where}: max_proposal_bytes must be a positive int, a number of bytes; "
            f"got {cap!r} ({fix})"
        )


def _check_names(machine: str, state: str, field: str, names: Any) -> None:
    """``next`` and ``tools`` are lists of names; a bare string would read as its letters."""
    if isinstance(names, str):
        raise MachineDefinitionError(
            f"machine {machine!r}: state {state!r}: {field} must be a list of names, not the "
            f"string {names!r}; write {field}=[{names!r}]"
        )
    if not isinstance(names, Sequence | frozenset | set) or not all(
        isinstance(item, str) for item in names
    ):
        raise MachineDefinitionError(
            f"machine {machine!r}: state {state!r}: {field} must be a list of names (str); "
            f"got {names!r}"
        )


def _check_provider_policy(machine: str, policy: ProviderPolicy) -> None:
    if not isinstance(policy, ProviderPolicy):
        raise MachineDefinitionError(
            f"machine {machine!r}: provider_policy must be a ProviderPolicy; got {policy!r}"
        )
    for name in ("timeout", "base", "cap", "max_elapsed"):
        value = getattr(policy, name)
        if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
            raise MachineDefinitionError(
                f"machine {machine!r}: provider_policy.{name} must be a positive number of "
                f"seconds; got {value!r}"
            )
    if not isinstance(policy.attempts, int) or policy.attempts < 1:
        raise MachineDefinitionError(
            f"machine {machine!r}: provider_policy.attempts must be at least 1; "
            f"got {policy.attempts!r}"
        )


def _reachable(initial: str, states: Mapping[str, Worker | Step]) -> set[str]:
    seen = {initial}
    todo: list[str] = [initial]
    while todo:
        spec = states.get(todo.pop())
        if spec is None:
            continue
        for dst in spec.next:
            if dst not in seen:
                seen.add(dst)
                todo.append(dst)
    return seen
