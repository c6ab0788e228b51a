# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""The decide path, compiled: a run's state as a typed object, its fold, and the accepted
path of a step (a model's proposal verified and its events built; a tool's success
committed).

The pure-Python twin is ``interlock.core._view.PyRunState`` (the fold) and ``interlock.core._decider``'s
``_on_propose`` and ``_on_report`` (the paths): every decision this module does not make
itself (a step's proposal, a rejection, a provider failure, a failed call, anything out
of the ordinary) it hands to them, before it has changed anything, or, once the model
call is journaled, to the very helpers the twin uses. ``tests/hot/test_decide.py`` holds
the two to the same events and the same folded state.

What typing buys: the run's counters, clock readings and seq are C fields read and
written without an object each; the fold dispatches on the event's type by identity; the
accepted call is verified (budgets, the single-decode path, the guards, the canonical
hash, the repeat count, the circuit) and its two events built with no Python frame in
between.
"""

from cpython cimport array
from cpython.dict cimport PyDict_GetItem, PyDict_SetItem
from cpython.object cimport PyObject
from cpython.type cimport PyType_IsSubtype
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

import array as _arrays
from collections import Counter

import msgspec

from interlock.core._events import (
    BreakerTripped,
    Event,
    TokenUsage,
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
    ENCODING_ERRORS as _JOURNAL_ENCODING_ERRORS,
    _EMPTY_PROMPT_HASH,
    _encoder as _journal_encoder,
    expand_prompt,
    hash_prompt_after,
)
from interlock.core._exceptions import InterlockError, JournalInconsistent
from interlock.core._machine import ESCALATE, FAILED
from interlock.core._messages import Propose, ToolCall, Verdict
from interlock.core._stats import _BOUNDS, _Keys
from interlock.core._hot import common_affixes, hash64, scan_json

cdef object UNSET = msgspec.UNSET
cdef object _json_encode = msgspec.json.encode
cdef object _replace = msgspec.structs.replace
#: How long a value's JSON may be in a history frame before it is cut (``_view._SHORT``).
cdef Py_ssize_t _SHORT = 200


cdef inline str _cut_json(str text):
    return text if len(text) <= _SHORT else text[: _SHORT - 3] + "..."
cdef object _ENCODING_ERRORS = (TypeError, ValueError, OverflowError, msgspec.EncodeError)
# What a guard, or a request being decided, raises that is not its failure (as the
# twin: ``_gate.INTERRUPTS``).
cdef object _INTERRUPTS = (KeyboardInterrupt, SystemExit)

#: A model call journals its prompt as a delta against the previous one when the two share
#: at least this many characters (as the twin: ``_decider._MIN_SHARED_PROMPT``).
cdef Py_ssize_t _MIN_SHARED_PROMPT = 64

cdef object _journal_encode = _journal_encoder.encode


# -- fields read from their slots ------------------------------------------------------

# NOTE: a field of a msgspec Struct read by name goes through the type's attribute lookup
# (PyObject_GenericGetAttr: the type's method cache, the member descriptor, its getter),
# about 160 instructions; read from the slot the descriptor names, about five. A proposal
# read some hundred fields on its way (benchmarks/gateway_instructions.md), so the hot
# ones are read from their slots: only where the object's class is known (checked, or
# built here), and by name wherever the class holds the field otherwise than as a plain
# object slot (where _offset gives -1).

cdef extern from "Python.h":
    ctypedef struct PyMemberDef:
        int type
        Py_ssize_t offset
    ctypedef struct PyMemberDescrObject:
        PyMemberDef* d_member

cdef object _MEMBER_DESCRIPTOR = type(Propose.raw)


cdef Py_ssize_t _offset(cls, str name) except -2:
    """Where instances of the Struct ``cls`` hold the field ``name``: the offset of its
    object slot, or -1 where it is not one (the field is then read by name)."""
    descr = getattr(cls, name)
    if type(descr) is not _MEMBER_DESCRIPTOR:
        return -1
    cdef PyMemberDef* member = (<PyMemberDescrObject*><PyObject*>descr).d_member
    if member.type != 16 and member.type != 6:  # T_OBJECT_EX, T_OBJECT
        return -1
    return member.offset


cdef inline object _field(object obj, Py_ssize_t offset, str name):
    """``obj.<name>``, read from its slot at ``offset`` (an offset of ``obj``'s class, or
    of a base it inherits the field from)."""
    cdef PyObject* value
    if offset >= 0:
        value = (<PyObject**>((<char*><PyObject*>obj) + offset))[0]
        if value is not NULL:
            return <object>value
    return getattr(obj, name)


# Event (every kind inherits these)
# -- what this module calls of the pure modules -----------------------------------------

cdef class Collaborators:
    """What the compiled decide path calls of the pure modules, given to it explicitly: the
    view's fold helpers (``interlock.core._view``), the twin's paths (``_decider``), the
    gate's stages (``_gate``) and the circuit board's type (``_breakers``). Those modules
    import this one, so it cannot import them: ``interlock.core._decider`` builds one of
    these once, naming each part, and passes it to :func:`install`.

    Every part is required (keyword-only); ``short_json`` is the view's cut of a value's JSON,
    which must equal this module's (a twin changed alone is refused)."""

    # the fold (interlock.core._view)
    cdef readonly object frame, in_frame, violation_signature, proposal_data, call_hash
    cdef readonly object no_data, no_turns, run_view, canonical_encode
    # the twin's paths and helpers (interlock.core._decider)
    cdef readonly object on_propose, on_report, reject, transition, is_fallback, close
    cdef readonly Py_ssize_t delta_by_reference
    # the gate's stages (interlock.core._gate) and the circuit board's type
    cdef readonly object verify, checked_call, plan, decision, envelope_decode, envelope
    cdef readonly object move_data, dict_decode, circuit_board
    cdef readonly int ok
    # where the gate's envelope holds next, tool and data (-1: read by name)
    cdef readonly Py_ssize_t env_next, env_tool, env_data

    def __init__(
        self, *, frame, in_frame, violation_signature, proposal_data, call_hash, no_data,
        no_turns, run_view, canonical_encode, short_json, on_propose, on_report, reject,
        transition, is_fallback, close, delta_by_reference, verify, checked_call, plan,
        decision, envelope_decode, envelope, move_data, dict_decode, circuit_board, ok,
    ):
        if short_json != _SHORT:
            raise ImportError(
                f"interlock.core._decide cuts a value's JSON at {_SHORT} characters, the "
                f"view at {short_json}: the extension is out of date; rebuild it (pip install -e .)"
            )
        if not isinstance(envelope, type) or not isinstance(circuit_board, type):
            raise TypeError(
                "Collaborators: envelope and circuit_board must be classes (the gate's "
                f"_Envelope, _breakers.CircuitBoard), got {envelope!r} and {circuit_board!r}"
            )
        self.frame = frame
        self.in_frame = in_frame
        self.violation_signature = violation_signature
        self.proposal_data = proposal_data
        self.call_hash = call_hash
        self.no_data = no_data
        self.no_turns = no_turns
        self.run_view = run_view
        self.canonical_encode = canonical_encode
        self.on_propose = on_propose
        self.on_report = on_report
        self.reject = reject
        self.transition = transition
        self.is_fallback = is_fallback
        self.close = close
        self.delta_by_reference = delta_by_reference
        self.verify = verify
        self.checked_call = checked_call
        self.plan = plan
        self.decision = decision
        self.envelope_decode = envelope_decode
        self.envelope = envelope
        self.env_next = _offset(envelope, "next")
        self.env_tool = _offset(envelope, "tool")
        self.env_data = _offset(envelope, "data")
        self.move_data = move_data
        self.dict_decode = dict_decode
        self.circuit_board = circuit_board
        self.ok = ok


cdef Collaborators _c = None


def install(Collaborators collaborators not None):
    """Give this module its collaborators (``interlock.core._decider`` does, once, at its
    import); until then no run state can be made here."""
    global _c
    _c = collaborators


def installed():
    """The collaborators given to :func:`install`, or None before."""
    return _c


cdef Py_ssize_t _E_RUN_ID = _offset(Event, "run_id")
cdef Py_ssize_t _E_SEQ = _offset(Event, "seq")
cdef Py_ssize_t _E_TS = _offset(Event, "ts")
# ModelCalled
cdef Py_ssize_t _MC_USAGE = _offset(ModelCalled, "usage")
cdef Py_ssize_t _MC_RAW = _offset(ModelCalled, "raw")
cdef Py_ssize_t _MC_STATE = _offset(ModelCalled, "state")
cdef Py_ssize_t _MC_MODEL = _offset(ModelCalled, "model")
cdef Py_ssize_t _MC_LATENCY = _offset(ModelCalled, "latency")
cdef Py_ssize_t _MC_RESPONSE = _offset(ModelCalled, "response")
# Transitioned
cdef Py_ssize_t _T_SRC = _offset(Transitioned, "src")
cdef Py_ssize_t _T_DST = _offset(Transitioned, "dst")
cdef Py_ssize_t _T_DELTA = _offset(Transitioned, "delta")
cdef Py_ssize_t _T_BY_REFERENCE = _offset(Transitioned, "delta_in_proposal")
# IntentRecorded
cdef Py_ssize_t _IR_KEY = _offset(IntentRecorded, "key")
# TokenUsage
cdef Py_ssize_t _U_PROMPT = _offset(TokenUsage, "prompt")
cdef Py_ssize_t _U_COMPLETION = _offset(TokenUsage, "completion")
cdef Py_ssize_t _U_CACHED = _offset(TokenUsage, "cached")
cdef Py_ssize_t _U_REASONING = _offset(TokenUsage, "reasoning")
# Propose
cdef Py_ssize_t _P_SEQ = _offset(Propose, "seq")
cdef Py_ssize_t _P_RUN_ID = _offset(Propose, "run_id")
cdef Py_ssize_t _P_RAW = _offset(Propose, "raw")
cdef Py_ssize_t _P_SOURCE = _offset(Propose, "source")
cdef Py_ssize_t _P_MODEL = _offset(Propose, "model")
cdef Py_ssize_t _P_PROMPT = _offset(Propose, "prompt")
cdef Py_ssize_t _P_USAGE = _offset(Propose, "usage")
cdef Py_ssize_t _P_LATENCY = _offset(Propose, "latency")
cdef Py_ssize_t _P_ERROR = _offset(Propose, "error")
cdef Py_ssize_t _P_DEFECT = _offset(Propose, "defect")
cdef Py_ssize_t _P_LEGACY = _offset(Propose, "legacy")
cdef Py_ssize_t _P_RESPONSE = _offset(Propose, "response")
cdef Py_ssize_t _P_ENVELOPE = _offset(Propose, "envelope")
cdef Py_ssize_t _P_EXTRA = _offset(Propose, "extra_calls")
cdef Py_ssize_t _P_OVERSIZED = _offset(Propose, "oversized")
# Verdict
cdef Py_ssize_t _V_RUN_ID = _offset(Verdict, "run_id")
cdef Py_ssize_t _V_SEQ = _offset(Verdict, "seq")
cdef Py_ssize_t _V_ACCEPTED = _offset(Verdict, "accepted")
cdef Py_ssize_t _V_STATE = _offset(Verdict, "state")
cdef Py_ssize_t _V_OUTCOME = _offset(Verdict, "outcome")
cdef Py_ssize_t _V_VIOLATIONS = _offset(Verdict, "violations")
cdef Py_ssize_t _V_EXECUTE = _offset(Verdict, "execute")
cdef Py_ssize_t _V_RESULT = _offset(Verdict, "result")
cdef Py_ssize_t _V_RECONCILE = _offset(Verdict, "reconcile")
cdef Py_ssize_t _V_RETRY_IN = _offset(Verdict, "retry_in")


def slot_offsets():
    """The fields this module reads from their slots, and each one's offset (-1: read by
    name): for the tests, which check that none falls back. (The gate's are there once its
    module is imported: it binds them.)"""
    bound = {}
    if _c is not None:
        bound.update({"_Envelope.next": _c.env_next, "_Envelope.tool": _c.env_tool,
                      "_Envelope.data": _c.env_data})
    return bound | {
        "Event.run_id": _E_RUN_ID, "Event.seq": _E_SEQ, "Event.ts": _E_TS,
        "ModelCalled.usage": _MC_USAGE, "ModelCalled.raw": _MC_RAW,
        "ModelCalled.state": _MC_STATE, "ModelCalled.model": _MC_MODEL,
        "ModelCalled.latency": _MC_LATENCY, "ModelCalled.response": _MC_RESPONSE,
        "Transitioned.src": _T_SRC, "Transitioned.dst": _T_DST,
        "Transitioned.delta": _T_DELTA, "Transitioned.delta_in_proposal": _T_BY_REFERENCE,
        "IntentRecorded.key": _IR_KEY,
        "TokenUsage.prompt": _U_PROMPT, "TokenUsage.completion": _U_COMPLETION,
        "TokenUsage.cached": _U_CACHED, "TokenUsage.reasoning": _U_REASONING,
        "Propose.seq": _P_SEQ, "Propose.run_id": _P_RUN_ID, "Propose.raw": _P_RAW, "Propose.source": _P_SOURCE,
        "Propose.model": _P_MODEL, "Propose.prompt": _P_PROMPT, "Propose.usage": _P_USAGE,
        "Propose.latency": _P_LATENCY, "Propose.error": _P_ERROR,
        "Propose.defect": _P_DEFECT, "Propose.legacy": _P_LEGACY,
        "Propose.response": _P_RESPONSE, "Propose.envelope": _P_ENVELOPE,
        "Propose.extra_calls": _P_EXTRA, "Propose.oversized": _P_OVERSIZED,
        "Verdict.run_id": _V_RUN_ID, "Verdict.seq": _V_SEQ, "Verdict.accepted": _V_ACCEPTED,
        "Verdict.state": _V_STATE, "Verdict.outcome": _V_OUTCOME,
        "Verdict.violations": _V_VIOLATIONS, "Verdict.execute": _V_EXECUTE,
        "Verdict.result": _V_RESULT, "Verdict.reconcile": _V_RECONCILE,
        "Verdict.retry_in": _V_RETRY_IN,
    }


# -- a machine's facts, looked up once -------------------------------------------------

cdef class _Facts:
    """The attributes of one machine the decide path reads per proposal, read once: a
    machine is frozen once built (its ``__post_init__`` sets them), so they never change."""

    cdef object machine
    cdef object success  # frozenset of the success states
    cdef object tables
    cdef object data_validators
    cdef object on_breaker
    cdef object gate_plans
    cdef object tokens, steps, deadline  # the budgets


# NOTE: one entry, the last machine asked about: a batch is of one machine or a few, and
# the check is one identity comparison. (It keeps that one machine alive.)
cdef _Facts _last_facts = None


cdef _Facts _facts_of(machine):
    """``machine``'s facts (see _Facts)."""
    global _last_facts
    cdef _Facts facts = _last_facts
    if facts is not None and facts.machine is machine:
        return facts
    facts = _Facts.__new__(_Facts)
    facts.machine = machine
    facts.success = machine.success_states
    facts.tables = machine.tables
    facts.data_validators = machine.data_validators
    facts.on_breaker = machine.on_breaker
    facts.gate_plans = machine.gate_plans
    budgets = machine.budgets
    facts.tokens = budgets.tokens
    facts.steps = budgets.steps
    facts.deadline = budgets.deadline
    _last_facts = facts
    return facts


cdef class RunState:
    """Everything the supervisor knows of one run; rebuilt by folding its events.

    The compiled twin of ``interlock.core._view.PyRunState``: the same attributes (the
    counters, seq and clock readings typed), the same :meth:`apply`.
    """

    cdef public str run_id
    cdef public object machine
    cdef public str state
    cdef public long long seq
    cdef public object inputs
    cdef public object data
    cdef public double started_ts
    cdef public double last_ts
    cdef public long long tokens
    cdef public long long steps
    cdef public long long consecutive_failures
    cdef public array.array _repeats
    cdef public array.array _committed_calls
    cdef public list history
    cdef public list signatures
    cdef public list results
    cdef public object pending
    cdef public object validated
    cdef public long long doubts
    cdef public bint external
    cdef public long long provider_failures
    cdef public double provider_failures_since
    cdef public str proposal_raw
    cdef public object _final_delta
    cdef public object escalation
    cdef public object output
    cdef public str previous
    cdef public bint closed
    cdef public str prompt
    cdef public long long prompt_seq
    cdef public object turns
    cdef public object _hash_state
    cdef public long long _data_version

    def __init__(self, str run_id, machine):
        if _c is None:
            raise ImportError(
                "interlock.core._decide has no collaborators yet: import interlock (or "
                "interlock.core._decider, which installs them) before making a RunState"
            )
        self.run_id = run_id
        self.machine = machine
        self.state = ""
        self.seq = 0
        self.inputs = {}
        self.data = _c.no_data
        self.started_ts = 0.0
        self.last_ts = 0.0
        self.tokens = 0
        self.steps = 0
        self.consecutive_failures = 0
        self._repeats = None
        self._committed_calls = None
        self.history = []
        self.signatures = []
        self.results = []
        self.pending = None
        self.validated = None
        self.doubts = 0
        self.external = False
        self.provider_failures = 0
        self.provider_failures_since = 0.0
        self.proposal_raw = ""
        self._final_delta = None
        self.escalation = None
        self.output = None
        self.previous = ""
        self.closed = False
        self.prompt = ""
        self.prompt_seq = 0
        self.turns = _c.no_turns
        self._hash_state = None
        self._data_version = 0

    @property
    def terminal(self):
        return _terminal(self.machine, self.state)

    @property
    def committed(self):
        """Every committed call's result by idempotency key (built from ``results`` on each read)."""
        return {done.key: done.result for done in self.results}

    cpdef Py_ssize_t repeats_of(self, call_hash) except -1:
        """How many times the run intended the call whose repeat hash is ``call_hash``."""
        cdef array.array repeats = self._repeats
        if repeats is None:
            return 0
        if call_hash < 0 or call_hash > 0xFFFFFFFFFFFFFFFF:
            return 0  # no call hashes to it (the twin's array.count finds none)
        cdef unsigned long long wanted = call_hash
        cdef unsigned long long* hashes = repeats.data.as_ulonglongs
        cdef Py_ssize_t i, count = 0
        for i in range(len(repeats)):
            if hashes[i] == wanted:
                count += 1
        return count

    cpdef bint committed_before(self, call_hash) except -1:
        """Whether the run committed a call whose repeat hash is ``call_hash``."""
        cdef array.array done = self._committed_calls
        if done is None:
            return False
        if call_hash < 0 or call_hash > 0xFFFFFFFFFFFFFFFF:
            return False  # no call hashes to it (the twin's ``in`` finds none)
        cdef unsigned long long wanted = call_hash
        cdef unsigned long long* hashes = done.data.as_ulonglongs
        cdef Py_ssize_t i
        for i in range(len(done)):
            if hashes[i] == wanted:
                return True
        return False

    @property
    def repeat_counts(self):
        """The repeat breaker's counts by call hash (built from the run's calls on each read)."""
        return dict(Counter(self._repeats)) if self._repeats is not None else {}

    cdef inline void _push(self, frame, object signature=0) except *:
        cdef list history = self.history
        cdef list signatures
        cdef Py_ssize_t missing
        history.append(frame)
        if signature:
            signatures = self.signatures
            missing = len(history) - 1 - len(signatures)
            if missing:
                signatures.extend([0] * missing)
            signatures.append(signature)

    cpdef apply(self, event, object call_hash=0, object prompt=None, object validated=None):
        """Fold one event into the state (see ``PyRunState.apply``).

        Raises:
          ProtocolError: if the event is out of order for this run.
        """
        cdef long long seq
        kind = type(event)
        cdef bint event_struct = PyType_IsSubtype(<type>kind, <type>Event)
        seq = _field(event, _E_SEQ, "seq") if event_struct else event.seq
        if seq != self.seq + 1:
            raise JournalInconsistent(
                f"run {self.run_id!r}: event seq {seq} does not follow {self.seq}; "
                "the journal is missing or repeating events"
            )
        self.seq = seq
        self.last_ts = _field(event, _E_TS, "ts") if event_struct else event.ts
        if kind is ModelCalled:
            self._model_called(event, prompt)
        elif kind is IntentRecorded:
            self.proposal_raw = ""
            self.pending = event
            self.validated = validated
            self.doubts = 0
            call = call_hash or _c.call_hash(event.tool, event.args)
            if self._repeats is None:
                self._repeats = _arrays.array("Q")
            self._repeats.append(call)
        elif kind is ToolCommitted:
            self._committed(event)
        elif kind is Transitioned:
            self._transitioned(event)
        elif kind is StepProposed:
            if event.source != "operator":
                self.steps += 1
            self.proposal_raw = event.raw
        elif kind is ProposalRejected:
            violations = event.violations
            self.proposal_raw = ""
            self.consecutive_failures += 1
            text = "; ".join([v.message for v in violations])
            self._push(
                _c.frame("rejected", seq, text, violations=violations, first_seq=seq),
                _c.violation_signature(violations),
            )
        elif kind is ToolFailed:
            self.pending = None
            self.validated = None
            self.consecutive_failures += 1
            self._push(_c.frame("tool_failed", seq, f"{event.tool} failed: {event.error}", first_seq=seq))
        elif kind is BreakerTripped:
            self._push(
                _c.frame("breaker", seq, f"breaker {event.breaker}: {event.detail}", first_seq=seq)
            )
        elif kind is Escalated:
            self.escalation = event
            self.closed = True
        elif kind is Resumed:
            self.escalation = None
            self.closed = False
            self.consecutive_failures = 0
            self._repeats = None
            self._push(
                _c.frame(
                    "resumed", seq, f"resumed by {event.by}: {event.note}".rstrip(": "), first_seq=seq
                )
            )
        elif kind is Completed:
            self.output = (self._final_delta or None) if event.output_in_delta else event.output
            self._final_delta = None
            self.closed = True
        elif kind is ToolInDoubt:
            self.doubts += 1
        elif kind is Reconciled:
            pass  # the call stays pending: a commit, an execution or an escalation follows
        elif kind is ProviderFailed:
            if not self.provider_failures:
                self.provider_failures_since = event.ts
            self.provider_failures += 1
        elif kind is Failed:
            self.output = {"reason": event.reason}
            self.closed = True
        elif kind is RunStarted:
            self.external = event.external is True
            self.state = event.state
            inputs = event.inputs
            self.inputs = inputs if type(inputs) is dict else dict(inputs)
            self.started_ts = event.ts
        else:
            raise JournalInconsistent(f"unknown event {event!r}")

    cdef void _model_called(self, event, object prompt) except *:
        # (event is a ModelCalled: apply dispatched on its type)
        usage = _field(event, _MC_USAGE, "usage")
        if type(usage) is TokenUsage:
            self.tokens += _field(usage, _U_PROMPT, "prompt") + _field(
                usage, _U_COMPLETION, "completion"
            )
        else:
            self.tokens += usage.prompt + usage.completion
        self.steps += 1
        self.provider_failures = 0
        self.proposal_raw = _field(event, _MC_RAW, "raw")
        if prompt is None:
            try:
                prompt = expand_prompt(self.prompt_seq, self.prompt, event)
            except ValueError as exc:
                raise JournalInconsistent(str(exc)) from None
        self.prompt = prompt
        self.prompt_seq = _field(event, _E_SEQ, "seq")
        if _field(event, _MC_RESPONSE, "response") is not UNSET:
            extra = event.extra_calls
            if self.turns is _c.no_turns:
                self.turns = []
            self.turns.append((event.seq, event.raw, () if extra is UNSET else extra))

    cdef void _committed(self, event) except *:
        intent = self.pending
        key = event.key
        result = event.result
        self.pending = None
        self.validated = None
        self.consecutive_failures = 0
        cdef array.array repeats
        if intent is not None and intent.key == key:
            args = intent.args
            # The pending intent's hash is the last one intended (see PyRunState._commit_call).
            repeats = self._repeats
            call = repeats[len(repeats) - 1] if repeats else _c.call_hash(intent.tool, args)
            if self._committed_calls is None:
                self._committed_calls = _arrays.array("Q")
            self._committed_calls.append(call)
        else:
            args = {}
        cdef str args_json = _json_encode(args).decode()
        cdef str result_json = _json_encode(result).decode()
        tool = event.tool
        text = f"{tool}({_cut_json(args_json)}) -> {_cut_json(result_json)}"
        state = self.state
        if intent is not None and intent.state != state:
            state = intent.state
        self.results.append(
            _c.in_frame(
                tool,
                args,
                result,
                key,
                event.seq,
                text,
                args_json,
                result_json,
                self.run_id,
                state,
                intent.seq if intent is not None else 0,
            )
        )
        self._push(_c.frame("tool_result", event.seq, text, first_seq=event.seq))

    cdef void _transitioned(self, event) except *:
        # (event is a Transitioned: apply dispatched on its type)
        src = _field(event, _T_SRC, "src")
        dst = _field(event, _T_DST, "dst")
        delta = _field(event, _T_DELTA, "delta")
        seq = _field(event, _E_SEQ, "seq")
        if _field(event, _T_BY_REFERENCE, "delta_in_proposal"):
            delta = _c.proposal_data(self.run_id, seq, self.proposal_raw)
        self.proposal_raw = ""
        if dst in _facts_of(self.machine).success:
            self._final_delta = delta
        self.previous = src
        self.state = dst
        self.consecutive_failures = 0
        if delta:
            if self.data is _c.no_data:
                self.data = {}
            self.data.update(delta)
            self._data_version += 1
        self._push(_c.frame("transitioned", seq, f"{src} -> {dst}", first_seq=seq))


# -- the accepted path --------------------------------------------------------------------


cdef inline bint _terminal(machine, str state) except -1:
    """``Machine.is_terminal``, inline."""
    return state in _facts_of(machine).success or state == ESCALATE or state == FAILED


cdef inline str _outcome(machine, str state):
    """``Machine.outcome``, inline."""
    if state in _facts_of(machine).success:
        return "completed"
    if state == ESCALATE:
        return "escalated"
    if state == FAILED:
        return "failed"
    return "running"


cdef inline object _verdict(RunState run, bint accepted):
    state = run.state
    return Verdict(
        run_id=run.run_id,
        seq=run.seq,
        accepted=accepted,
        state=state,
        outcome=_outcome(run.machine, state),
    )


cdef bint _ordinary(RunState run, msg) except -1:
    """Whether ``msg`` is a model's proposal the compiled path decides from its first
    event on: at the run's seq, with text as it is journaled, and no failure to handle."""
    if type(msg) is not Propose:
        return False
    cdef long long seq = _field(msg, _P_SEQ, "seq")
    if seq and seq != run.seq:
        return False
    if (
        run.pending is not None
        or _field(msg, _P_SOURCE, "source") != "model"
        or _field(msg, _P_ERROR, "error")
        or _field(msg, _P_DEFECT, "defect")
    ):
        return False
    if _field(msg, _P_ENVELOPE, "envelope") is not None or _field(msg, _P_LEGACY, "legacy"):
        return False
    if _field(msg, _P_OVERSIZED, "oversized") is not None:
        return False
    if not (
        _field(msg, _P_RAW, "raw").isascii()
        and _field(msg, _P_PROMPT, "prompt").isascii()
        and _field(msg, _P_MODEL, "model").isascii()
    ):
        return False
    response = _field(msg, _P_RESPONSE, "response")
    if response is not None and not response.isascii():
        return False
    return not _terminal(run.machine, run.state)


def on_propose(RunState run, msg, double now, circuits, list events):
    """``_decider._on_propose``, compiled for a model's proposal (see the module)."""
    return _on_propose(run, msg, now, circuits, events)


cdef object _on_propose(RunState run, msg, double now, circuits, list events):
    if not _ordinary(run, msg):
        return _c.on_propose(run, msg, now, circuits, events)
    # (msg is a Propose: _ordinary checked)
    machine = run.machine
    state = run.state
    raw = _field(msg, _P_RAW, "raw")
    plan = _facts_of(machine).gate_plans.get(state) or _c.plan(machine, state)
    if len(raw) > plan.max_bytes:  # (ASCII: its length is its size in bytes)
        # Refused unread, and journaled bounded: the Python path does both.
        return _c.on_propose(run, msg, now, circuits, events)
    prompt = _field(msg, _P_PROMPT, "prompt")
    cdef Py_ssize_t size = len(prompt)
    cdef Py_ssize_t base = 0, prefix = 0, suffix = 0, shared = 0, tail = size
    text = prompt
    if not size:
        # No prompt (an external run's proposal): nothing shared, the empty text's hash
        # (what common_affixes and hash_prompt_after give it), with no Python frame.
        prompt_hash, hash_state = _EMPTY_PROMPT_HASH, None
    else:
        if run.prompt_seq:
            prefix, suffix = common_affixes(run.prompt, prompt)
            shared = prefix
            tail = size - suffix
            if prefix + suffix >= _MIN_SHARED_PROMPT:
                base = run.prompt_seq
                text = prompt[prefix : size - suffix]
            else:
                prefix = suffix = 0
        prompt_hash, hash_state = hash_prompt_after(
            run._hash_state, run.prompt, prompt, shared, tail
        )
    # Only the fields that differ from their defaults: a keyword a Struct must match
    # against its fields costs more than the field's default.
    response = _field(msg, _P_RESPONSE, "response")
    extra = _field(msg, _P_EXTRA, "extra_calls")
    called = ModelCalled(
        run_id=run.run_id,
        seq=run.seq + 1,
        ts=now,
        state=state,
        model=_field(msg, _P_MODEL, "model"),
        prompt_hash=prompt_hash,
        prompt=text,
        raw=raw,
        usage=_field(msg, _P_USAGE, "usage"),
        latency=_field(msg, _P_LATENCY, "latency"),
        prompt_base=base,
        prompt_prefix=prefix,
        prompt_suffix=suffix,
    )
    if response is not None or extra:  # an HTTP provider's exact response, other calls
        called = _replace(
            called,
            response=UNSET if response is None else response,
            extra_calls=tuple(extra) if extra else UNSET,
        )
    run.apply(called, 0, prompt)
    events.append(called)
    run._hash_state = hash_state
    encoded = raw.encode()
    if not _within_budgets(run, machine, now):
        return _decided(run, msg, _c.verify(machine, run, encoded, now, circuits), raw, now, events)
    accepted = _accept_call(run, machine, plan, encoded, now, circuits)
    if type(accepted) is tuple:
        call, builtins, value, call_hash = <tuple>accepted
        tool = call.tool
        key = f"{run.run_id}:{state}:{run.seq + 1}"
        intent = IntentRecorded(
            run_id=run.run_id, seq=run.seq + 1, ts=now, state=state, tool=call.name,
            args=builtins, key=key,
        )
        run.apply(intent, call_hash, None, value)
        events.append(intent)
        verdict = Verdict(
            run_id=run.run_id,
            seq=run.seq,
            accepted=True,
            state=state,
            outcome="running",
            execute=ToolCall(call.name, builtins, key),
        )
        return verdict
    if accepted is None:
        moved = _accept_move(run, machine, plan, encoded, raw, now, events)
        if moved is not None:
            return moved
        accepted = _c.verify(machine, run, encoded, now, circuits)
    return _decided(run, msg, accepted, raw, now, events)


cdef object _accept_move(
    RunState run, machine, plan, bytes encoded, str raw, double now, list events
):
    """The gate's accepted path for a move (``{"next": ..., "data": ...}``) and its events:
    the verdict, or None (before anything changed) for whatever the Python gate must
    decide or explain. The same stages as ``_gate._verify`` for a move (the budgets are
    checked by the caller, see _within_budgets): the cap, the exact reading, the envelope, the transition's legality, the state's data
    schema."""
    state = run.state
    if len(encoded) > plan.max_bytes:
        return None
    try:
        envelope = _c.envelope_decode(encoded)
    except (msgspec.DecodeError, RecursionError):  # the Python gate explains either
        return None
    if type(envelope) is not _c.envelope:  # pragma: no cover - the gate's decoder's type
        return None
    target = _field(envelope, _c.env_next, "next")
    if _field(envelope, _c.env_tool, "tool") is not None or target is None:
        return None
    raw_data = _field(envelope, _c.env_data, "data")
    if scan_json(encoded) is not None:
        return None
    cdef _Facts facts = _facts_of(machine)
    tables = facts.tables
    target_id = tables.state_id(target)
    if tables.check_transition(tables.state_id(state), target_id) != _c.ok:
        return None
    # The machine's own string for the state (equal to the one decoded): a run's states
    # are then the same few objects, which the counters' label caches find by identity.
    target = tables.states[target_id]
    cdef PyObject* validator = PyDict_GetItem(facts.data_validators, state)
    if validator is NULL:
        # ``_gate._move_data`` for a state with no data schema, inline: the data as a
        # JSON object the journal can hold, or None for the Python gate to explain
        try:
            data = _c.dict_decode(raw_data)
            _journal_encode(data)
        except msgspec.ValidationError:
            return None
        except _JOURNAL_ENCODING_ERRORS:
            return None
    else:
        data, violations = _c.move_data(machine, run, raw_data)
        if violations:
            return None
    reason = (
        "fallback" if facts.on_breaker == state and _c.is_fallback(machine, state) else "proposal"
    )
    cdef long long seq = run.seq + 1
    if len(raw) >= _c.delta_by_reference and data and _c.proposal_data(run.run_id, seq, raw) == data:
        moved = Transitioned(
            run_id=run.run_id, seq=seq, ts=now, src=state, dst=target, reason=reason,
            delta_in_proposal=True,
        )
        by_reference = True
    else:
        moved = Transitioned(
            run_id=run.run_id, seq=seq, ts=now, src=state, dst=target, delta=data, reason=reason
        )
        by_reference = False
    run.apply(moved)
    events.append(moved)
    if _terminal(machine, run.state):
        _c.close(run, events, now, reason, state, data, None, by_reference)
    return _verdict(run, True)


cdef object _decided(RunState run, msg, decision, raw, double now, list events):
    """The rest of the twin's ``_on_propose``, for what the compiled gate left to the
    Python one: a rejection, a transition, a call that moves on."""
    if decision.violations:
        return _c.reject(run, events, now, decision.violations, decision.trip)
    machine = run.machine
    state = run.state
    if decision.tool is not None:
        key = f"{run.run_id}:{state}:{run.seq + 1}"
        target = decision.target
        data = decision.data
        intent = IntentRecorded(
            run_id=run.run_id,
            seq=run.seq + 1,
            ts=now,
            state=state,
            tool=decision.tool.name,
            args=decision.args,
            key=key,
            next=target or UNSET,
            data=data if target and data else UNSET,
        )
        run.apply(intent, decision.call_hash, None, decision.value)
        events.append(intent)
        return Verdict(
            run_id=run.run_id,
            seq=run.seq,
            accepted=True,
            state=run.state,
            outcome=_outcome(machine, run.state),
            execute=ToolCall(decision.tool.name, decision.args, key),
        )
    reason = "fallback" if _c.is_fallback(machine, state) else "proposal"
    data = decision.data
    by_reference = (
        len(raw) >= _c.delta_by_reference
        and bool(data)
        and _c.proposal_data(run.run_id, run.seq + 1, raw) == data
    )
    _c.transition(run, events, now, decision.target, data, reason, by_reference=by_reference)
    return _verdict(run, True)


cdef inline bint _within_budgets(RunState run, machine, double now) except -1:
    """Whether no budget of the run is exhausted (``_breakers.check_budgets`` finds none);
    an exhausted one is the Python gate's to explain."""
    cdef _Facts facts = _facts_of(machine)
    if run.tokens > facts.tokens or run.steps > facts.steps:
        return False
    return not (now - run.started_ts > facts.deadline)


cdef object _accept_call(RunState run, machine, plan, bytes raw, double now, circuits):
    """The gate's accepted path for a call that does not move on: ``(call, builtins,
    value, call_hash)``; a ``Decision`` where the encoding, a committed identical call
    (``_gate._checked_call``'s order), a guard, the repeat breaker
    (the Python gate's, which explains them) or the circuit refused the call; None for
    whatever else the Python gate must decide from the start (it explains a rejection,
    and decides a transition or a call that moves on). Nothing it does before it
    answers None has an effect: the circuit, which counts a trial call, is asked last."""
    decoder = plan.decoder
    if decoder is None or len(raw) > plan.max_bytes:
        return None
    if raw.startswith(b'{"next":"'):
        # A move, as the compact JSON of most clients spells it: no call envelope decodes
        # it (``next`` is null in each, and a later "next" repeated is a key named twice),
        # and the decode that says so raises: about a µs a proposal
        # (benchmarks/gateway_instructions.md).
        return None
    try:
        envelope = decoder.decode(raw)
    except (msgspec.DecodeError, RecursionError):  # too deep: the Python gate explains it
        return None
    cdef PyObject* found = PyDict_GetItem(plan.by_type, type(envelope))
    if found is NULL:
        return None
    call = <object>found
    args = envelope.args
    if args is UNSET or envelope.next is not None:
        return None
    if scan_json(raw) is not None:
        return None
    plain = call.plain
    builtins = call.to_builtins(args)
    try:
        canonical = _c.canonical_encode(args if plain else builtins)
    except _ENCODING_ERRORS:
        return _refused(run, machine, call, args, now, circuits)
    call_hash = hash64(canonical, call.seed)
    if call.once and run.committed_before(call_hash):
        return _refused(run, machine, call, args, now, circuits)
    guards = call.guards
    if guards:
        view = _c.run_view(run)
        for guard in guards:
            try:
                rejected = guard(args, view)
            except _INTERRUPTS:
                raise
            except BaseException:  # the guard's failure: the Python gate explains it
                return _refused(run, machine, call, args, now, circuits)
            if rejected is not None:
                return _refused(run, machine, call, args, now, circuits)
    policy = machine.breakers
    if run.repeats_of(call_hash) >= policy.repeats:
        return _refused(run, machine, call, args, now, circuits)
    if circuits is not None and (type(circuits) is not _c.circuit_board or circuits._circuits):
        refusal = circuits.check(call.name, now, policy)
        if refusal is not None:
            return _c.decision((refusal[0],), refusal[1])
    return (call, builtins, args, call_hash)


cdef object _refused(RunState run, machine, call, args, double now, circuits):
    """The Python gate's decision on a call the compiled one found refused (by the
    journal's encoding, a committed identical call, a guard or the repeat breaker): it
    explains the refusal, guards and all."""
    return _c.checked_call(machine, run, call, args, now, circuits)


def on_report(RunState run, msg, double now, circuits, list events):
    """``_decider._on_report``, compiled for the success of the call the run waits for."""
    pending = run.pending
    cdef long long seq = msg.seq
    if pending is None or not msg.ok or (seq and seq != run.seq):
        return _c.on_report(run, msg, now, circuits, events)
    key = msg.key
    if pending.key != key or _terminal(run.machine, run.state):
        return _c.on_report(run, msg, now, circuits, events)
    machine = run.machine
    tool = machine.tool_by_name[pending.tool]
    name = tool.name
    circuits.record(name, True, now, machine.breakers, msg.error)
    committed = ToolCommitted(
        run_id=run.run_id,
        seq=run.seq + 1,
        ts=now,
        tool=name,
        key=key,
        result=msg.result,
        attempts=msg.attempts,
        latency=msg.latency,
    )
    run.apply(committed)
    events.append(committed)
    target = pending.next
    if target is not UNSET:
        # The move its intent named (call_and_move), in the same write.
        data = pending.data
        _c.transition(run, events, now, target, {} if data is UNSET else data, "call")
    return _verdict(run, True)


# -- a batch of requests ------------------------------------------------------------------

# How a verdict goes out (interlock.runtime._journal): once durable, at once and written now, at once
# and written with the run's next request.
cdef int _DURABLE = 0, _WRITE = 1, _LAG = 2

# The latency histograms' bucket bounds (interlock.core._stats._BOUNDS) as C doubles.
cdef Py_ssize_t _NBOUNDS = len(_BOUNDS)
cdef double _bound_values[128]
if _NBOUNDS > 128:  # pragma: no cover - a twin changed alone
    raise ImportError("interlock.core._decide is out of date: rebuild it (pip install -e .)")
for _i, _bound in enumerate(_BOUNDS):
    _bound_values[_i] = _bound


cdef inline double _monotonic() noexcept nogil:
    """``time.perf_counter()`` (CLOCK_MONOTONIC on Linux), without a float object."""
    cdef timespec now
    clock_gettime(CLOCK_MONOTONIC, &now)
    return <double>now.tv_sec + <double>now.tv_nsec * 1e-9


cdef inline Py_ssize_t _bucket(double value) noexcept:
    """``bisect_left(_BOUNDS, value)`` over the C bounds."""
    cdef Py_ssize_t low = 0, high = _NBOUNDS, middle
    while low < high:
        middle = (low + high) >> 1
        if _bound_values[middle] < value:
            low = middle + 1
        else:
            high = middle
    return low


cdef class _Samples:
    """A LatencyHistogram's samples of one batch, counted in C and written to it once.

    The sum is carried on from the histogram's and added to sample by sample, in the
    order recorded, so it is the float ``record`` would leave; it is written back
    (:meth:`flush`) before anything else may record into the histogram.
    """

    cdef object target
    cdef long long counts[128]
    cdef double sum
    cdef long long total

    cdef inline void add(self, histogram, double seconds) except *:
        if histogram is not self.target:
            self.flush()
            self.target = histogram
            self.sum = histogram.sum
        self.counts[_bucket(seconds)] += 1
        self.sum += seconds
        self.total += 1

    cdef void flush(self) except *:
        cdef Py_ssize_t index
        cdef list counts
        target = self.target
        if target is None:
            return
        self.target = None
        if not self.total:
            return
        counts = target.counts
        for index in range(_NBOUNDS + 1):
            if self.counts[index]:
                counts[index] = counts[index] + self.counts[index]
                self.counts[index] = 0
        target.sum = self.sum
        target.total = target.total + self.total
        self.total = 0


cdef inline void _add(table, key, amount) except *:
    """``table[key] += amount`` on a ``defaultdict(int)``, without its ``__missing__``."""
    cdef PyObject* found = PyDict_GetItem(table, key)
    if found is NULL:
        PyDict_SetItem(table, key, amount)
    else:
        PyDict_SetItem(table, key, <object>found + amount)


cdef inline void _touch(table, key) except *:
    """``table[key] += 0`` (the key made, its count unchanged)."""
    if PyDict_GetItem(table, key) is NULL:
        PyDict_SetItem(table, key, 0)


cdef long long _TALLY_MAX = 1 << 62
cdef object _NOTHING = object()  # no key yet


cdef class _Tally:
    """``table[key] += n`` for one table and key at a time, added up in C and written when
    another key comes, or at :meth:`flush`: a batch's proposals mostly count into the same
    keys, one after the other (the same machine, state and model, the same move)."""

    cdef object table
    cdef object key
    cdef long long count
    cdef bint counted

    cdef inline void add(self, table, key, long long amount) except *:
        if key is not self.key or table is not self.table:
            self.flush()
            self.table = table
            self.key = key
        self.count += amount
        self.counted = True

    cdef void flush(self) except *:
        if self.counted:
            if self.count:
                _add(self.table, self.key, self.count)
            else:
                _touch(self.table, self.key)
            self.count = 0
            self.counted = False
        self.table = self.key = None


cdef class _Counting:
    """``RuntimeStats.count`` for a batch's proposals: the tables looked up once per batch,
    the label tuples of the last machine, model call and move kept at hand, the counts
    of the keys in turn added up in C (:class:`_Tally`) and the latency samples counted
    in C (:class:`_Samples`), all written by :meth:`flush` before anything else counts."""

    cdef object stats
    cdef object tokens, model_calls, model_latency, verdicts, transitions, by_name
    cdef object verify_latency
    cdef object name, keys, state, model, call, src, dst, move
    cdef object machine, latency, latency_model, model_histogram
    cdef _Samples verified, called
    cdef _Tally prompt, completion, calls, accepted, moves

    def __cinit__(self, stats):
        self.stats = stats
        self.tokens = stats.tokens
        self.model_calls = stats.model_calls
        self.model_latency = stats.model_latency
        self.verdicts = stats.verdicts
        self.transitions = stats.transitions
        self.by_name = stats._keys
        self.verify_latency = stats.verify_latency
        self.verified = _Samples()
        self.called = _Samples()
        self.latency_model = _NOTHING
        self.prompt = _Tally()
        self.completion = _Tally()
        self.calls = _Tally()
        self.accepted = _Tally()
        self.moves = _Tally()

    cdef void flush(self) except *:
        """Write the counts and samples counted so far (before anything else counts)."""
        self.prompt.flush()
        self.completion.flush()
        self.calls.flush()
        self.accepted.flush()
        self.moves.flush()
        self.verified.flush()
        self.called.flush()

    cdef void verification(self, machine, double seconds) except *:
        """``stats.verify_latency[machine.name].record(seconds)``."""
        if machine is not self.machine:
            name = machine.name
            found = PyDict_GetItem(self.verify_latency, name)
            if found is NULL:
                self.flush()
                latency = self.stats.histogram(self.verify_latency, name)
            else:
                latency = <object>found
            self.machine = machine
            self.latency = latency
        self.verified.add(self.latency, seconds)

    cdef _Keys_of(self, name):
        if name is not self.name:
            keys = self.by_name.get(name)
            if keys is None:
                self.flush()
                keys = self.by_name[name] = _Keys(name)
            self.name = name
            self.keys = keys
            self.state = self.src = None
        return self.keys

    cdef void count(self, machine, msg, list events, Py_ssize_t start) except *:
        """``RuntimeStats.count`` for a proposal's events, compiled for those of nearly
        every step (a model call, then a move or a call); any other event, a count past
        what C adds up, and it is the twin's."""
        cdef Py_ssize_t index, end = len(events)
        cdef bint proposed = False
        for index in range(start, end):
            event = events[index]
            kind = type(event)
            if kind is ModelCalled:
                usage = _field(event, _MC_USAGE, "usage")
                if type(usage) is not TokenUsage:
                    break
                prompt = _field(usage, _U_PROMPT, "prompt")
                completion = _field(usage, _U_COMPLETION, "completion")
                if (
                    type(prompt) is not int
                    or type(completion) is not int
                    or not (0 <= prompt < _TALLY_MAX and 0 <= completion < _TALLY_MAX)
                    or _field(usage, _U_CACHED, "cached")
                    or _field(usage, _U_REASONING, "reasoning")
                    or type(_field(event, _MC_LATENCY, "latency")) is not float
                ):
                    break
            elif kind is not Transitioned and kind is not IntentRecorded:
                break
        else:
            index = end
        if index < end:
            self.flush()
            self.stats.count(machine, msg, events, start)
            return
        keys = self._Keys_of(machine.name)
        for index in range(start, end):
            event = events[index]
            kind = type(event)
            if kind is ModelCalled:
                state = _field(event, _MC_STATE, "state")
                model = _field(event, _MC_MODEL, "model")
                if state is not self.state or model is not self.model:
                    by_model = keys.calls.get(state)
                    call = by_model.get(model) if by_model is not None else None
                    if call is None:
                        self.flush()
                        call = keys.call(state, model)
                    self.state = state
                    self.model = model
                    self.call = call
                call = self.call
                usage = _field(event, _MC_USAGE, "usage")  # a TokenUsage: checked above
                self.prompt.add(self.tokens, (<tuple>call)[0], _field(usage, _U_PROMPT, "prompt"))
                self.completion.add(
                    self.tokens, (<tuple>call)[1], _field(usage, _U_COMPLETION, "completion")
                )
                self.calls.add(self.model_calls, (<tuple>call)[4], 1)
                if model is not self.latency_model:
                    latencies = self.model_latency
                    latency = latencies.get(model)
                    if latency is None:
                        self.flush()
                        latency = self.stats.histogram(latencies, model)
                    self.latency_model = model
                    self.model_histogram = latency
                self.called.add(self.model_histogram, _field(event, _MC_LATENCY, "latency"))
                proposed = True
            else:  # Transitioned or IntentRecorded
                if proposed:
                    self.accepted.add(self.verdicts, keys.accepted, 1)
                    proposed = False
                if kind is Transitioned:
                    src = _field(event, _T_SRC, "src")
                    dst = _field(event, _T_DST, "dst")
                    if src is not self.src or dst is not self.dst:
                        by_dst = keys.moves.get(src)
                        move = by_dst.get(dst) if by_dst is not None else None
                        if move is None:
                            self.flush()
                            move = keys.move(src, dst)
                        self.src = src
                        self.dst = dst
                        self.move = move
                    self.moves.add(self.transitions, self.move, 1)


cdef int _proposal_mode(runs, msg, verdict) except -1:
    """``Supervisor._early`` for a proposal."""
    if verdict.outcome != "running":
        return _DURABLE
    cdef PyObject* found = PyDict_GetItem(runs, msg.run_id)
    if found is NULL:
        return _DURABLE
    run = <object>found
    call = verdict.execute
    if run.external:  # a read-only call's intent goes with the run's next flush
        if call is not None and run.machine.tool_by_name[call.tool].read_only:
            return _LAG
        return _DURABLE
    if call is None:
        return _LAG
    return _WRITE if run.machine.tool_by_name[call.tool].read_only else _DURABLE


def decide_many(
    list msgs, list events, dict runs, circuits, clock, stats, propose, decide, early,
    contain, find
):
    """``GroupCommit.submit_many_nowait``'s loop over a supervisor's decide, compiled for
    its proposals: each decided in order, its events appended to ``events``; returns each
    one's verdict or the error it was refused with, and whether the writer must be woken
    (a verdict that is not :data:`LAG`). The supervisor passes what the loop needs: its
    live ``runs`` by id, its ``circuits``, ``clock`` and ``stats``; ``propose``, the decide
    path of a proposal in use (``_decider.propose``: this module's ``on_propose`` unless
    replaced); ``decide(msg, events)`` and ``early(msg, verdict)`` for any other request;
    ``contain(msg, exc)``, the error a bug met deciding ``msg`` ends its run with; and
    ``find(run_id)``, the run of an id not in ``runs`` (it raises what is wrong).

    A proposal is timed, decided by ``propose``, recorded in its machine's verification
    latency and counted as ``RuntimeStats.count`` counts it, with no Python frame between;
    any other request goes through ``decide`` and ``early`` as in the loop. A bug met
    deciding a request ends that run only (its events dropped, ``contain``'s error in its
    place), as in the loop."""
    cdef list results = []
    cdef bint wake = False
    cdef Py_ssize_t mark
    cdef double started, seconds
    cdef PyObject* found
    cdef bint compiled = propose is on_propose
    cdef _Counting counting = _Counting(stats)
    try:
        for msg in msgs:
            mark = len(events)
            if type(msg) is not Propose:
                counting.flush()
                try:
                    verdict = decide(msg, events)
                except InterlockError as exc:
                    results.append(exc)
                    continue
                except _INTERRUPTS:
                    raise
                except BaseException as exc:  # a bug: it ends that run only (see contain)
                    del events[mark:]
                    error = contain(msg, exc)
                    error.__cause__ = exc
                    results.append(error)
                    continue
                results.append(verdict)
                if not wake and early(msg, verdict) != _LAG:
                    wake = True
                continue
            try:
                now = clock()
                run_id = _field(msg, _P_RUN_ID, "run_id")  # (a Propose: checked above)
                found = PyDict_GetItem(runs, run_id)
                run = find(run_id) if found is NULL else <object>found  # raises
                started = _monotonic()
                if compiled:
                    verdict = _on_propose(<RunState?>run, msg, now, circuits, events)
                else:
                    verdict = propose(run, msg, now, circuits, events)
                seconds = _monotonic() - started
                machine = run.machine
                counting.verification(machine, seconds)
                if len(events) > mark:
                    counting.count(machine, msg, events, mark)
            except InterlockError as exc:
                results.append(exc)
                continue
            except _INTERRUPTS:
                raise
            except BaseException as exc:  # a bug: it ends that run only (see contain)
                del events[mark:]
                error = contain(msg, exc)
                error.__cause__ = exc
                results.append(error)
                continue
            results.append(verdict)
            if not wake and _proposal_mode(runs, msg, verdict) != _LAG:
                wake = True
    finally:
        counting.flush()
    return results, wake


