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
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE, PyByteArray_Resize
from cpython.dict cimport PyDict_GetItem, PyDict_SetItem
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE, PyList_SetItem
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF
from cpython.type cimport PyType_IsSubtype
from libc.string cimport memcpy
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

# Bound by interlock.core._view (bind_view) and interlock.core._decider (bind_decider) once they are
# imported: they import this module, so it cannot import them.
cdef object _in_frame = None  # ToolResult._in_frame
cdef object _Frame = None
cdef object _violation_signature = None
cdef object _proposal_data = None
cdef object _call_hash = None
cdef object _NO_DATA = None
cdef object _NO_TURNS = None
cdef object _RunView = None

cdef object _py_on_propose = None
cdef object _py_on_report = None
cdef object _verify = None
cdef object _checked_call = None
cdef object _plan = None
cdef object _reject = None
cdef object _transition = None
cdef object _is_fallback = None
cdef object _CircuitBoard = None
cdef object _Decision = None
cdef object _envelope_decode = None
cdef object _move_data = None
cdef object _close = None
cdef int _OK = 0
cdef object _canonical_encode = None
cdef Py_ssize_t _DELTA_BY_REFERENCE = 1024
cdef object _decider = None  # the twin's module: its ``_propose`` is the decide path in use
cdef object _dict_decode = None  # the gate's decoder of a move's data with no schema
cdef object _journal_encode = _journal_encoder.encode
cdef object _Envelope = None  # the gate's move and call envelope (bind_decider)
cdef Py_ssize_t _ENV_NEXT = -1, _ENV_TOOL = -1, _ENV_DATA = -1


def bind_view(namespace):
    """Take what the fold needs from ``interlock.core._view`` (which imports this module)."""
    global _in_frame, _Frame, _violation_signature, _proposal_data, _call_hash
    global _NO_DATA, _NO_TURNS, _RunView, _canonical_encode
    _in_frame = namespace.ToolResult._in_frame
    _Frame = namespace.Frame
    _violation_signature = namespace.violation_signature
    _proposal_data = namespace.proposal_data
    _call_hash = namespace._call_hash
    if namespace._SHORT != _SHORT:  # pragma: no cover - a twin changed alone
        raise ImportError("interlock.core._decide is out of date: rebuild it (pip install -e .)")
    _NO_DATA = namespace._NO_DATA
    _NO_TURNS = namespace._NO_TURNS
    _RunView = namespace.RunView
    _canonical_encode = namespace.canonical_encoder.encode


def bind_decider(namespace, gate, breakers):
    """Take the twin's paths and helpers from ``interlock.core._decider`` and the gate's."""
    global _py_on_propose, _py_on_report, _verify, _checked_call, _plan, _reject
    global _transition, _is_fallback, _CircuitBoard, _DELTA_BY_REFERENCE, _Decision
    global _envelope_decode, _move_data, _close, _OK, _decider, _dict_decode
    _decider = namespace
    _dict_decode = gate._dict_decoder.decode
    _py_on_propose = namespace._on_propose
    _py_on_report = namespace._on_report
    _reject = namespace._reject
    _transition = namespace._transition
    _is_fallback = namespace._is_fallback
    _DELTA_BY_REFERENCE = namespace._DELTA_BY_REFERENCE
    _verify = gate.verify
    _checked_call = gate._checked_call
    _plan = gate._plan
    _Decision = gate.Decision
    _envelope_decode = gate._envelope_decoder.decode
    global _Envelope, _ENV_NEXT, _ENV_TOOL, _ENV_DATA
    _Envelope = gate._Envelope
    _ENV_NEXT = _offset(_Envelope, "next")
    _ENV_TOOL = _offset(_Envelope, "tool")
    _ENV_DATA = _offset(_Envelope, "data")
    _move_data = gate._move_data
    _close = namespace._close
    _OK = gate.OK
    _CircuitBoard = breakers.CircuitBoard


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
    name): for the tests, which check that none falls back. (The gateway's, the channel's
    and the gate's are there once their modules are imported: they bind theirs.)"""
    bound = {}
    if _ProposalIn is not None:
        for i, name in enumerate(("expected_seq", "proposal", "usage", "model")):
            bound[f"ProposalIn.{name}"] = _PI_OFFSETS[i]
            bound[f"VerifyItem.{name}"] = _VI_OFFSETS[i]
        bound["_Answer.event"] = _A_EVENT
    if _ChannelRequest is not None:
        bound.update({"ChannelRequest.id": _CR_ID, "ChannelRequest.run_id": _CR_RUN_ID,
                      "ChannelRequest.body": _CR_BODY, "ChannelRequest.op": _CR_OP})
    if _Envelope is not None:
        bound.update({"_Envelope.next": _ENV_NEXT, "_Envelope.tool": _ENV_TOOL,
                      "_Envelope.data": _ENV_DATA})
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
        self.run_id = run_id
        self.machine = machine
        self.state = ""
        self.seq = 0
        self.inputs = {}
        self.data = _NO_DATA
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
        self.turns = _NO_TURNS
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
            call = call_hash or _call_hash(event.tool, event.args)
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
                _Frame("rejected", seq, text, violations=violations, first_seq=seq),
                _violation_signature(violations),
            )
        elif kind is ToolFailed:
            self.pending = None
            self.validated = None
            self.consecutive_failures += 1
            self._push(_Frame("tool_failed", seq, f"{event.tool} failed: {event.error}", first_seq=seq))
        elif kind is BreakerTripped:
            self._push(
                _Frame("breaker", seq, f"breaker {event.breaker}: {event.detail}", first_seq=seq)
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
                _Frame(
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
            if self.turns is _NO_TURNS:
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
            call = repeats[len(repeats) - 1] if repeats else _call_hash(intent.tool, args)
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
            _in_frame(
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
        self._push(_Frame("tool_result", event.seq, text, first_seq=event.seq))

    cdef void _transitioned(self, event) except *:
        # (event is a Transitioned: apply dispatched on its type)
        src = _field(event, _T_SRC, "src")
        dst = _field(event, _T_DST, "dst")
        delta = _field(event, _T_DELTA, "delta")
        seq = _field(event, _E_SEQ, "seq")
        if _field(event, _T_BY_REFERENCE, "delta_in_proposal"):
            delta = _proposal_data(self.run_id, seq, self.proposal_raw)
        self.proposal_raw = ""
        if dst in _facts_of(self.machine).success:
            self._final_delta = delta
        self.previous = src
        self.state = dst
        self.consecutive_failures = 0
        if delta:
            if self.data is _NO_DATA:
                self.data = {}
            self.data.update(delta)
            self._data_version += 1
        self._push(_Frame("transitioned", seq, f"{src} -> {dst}", first_seq=seq))


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
        return _py_on_propose(run, msg, now, circuits, events)
    # (msg is a Propose: _ordinary checked)
    machine = run.machine
    state = run.state
    raw = _field(msg, _P_RAW, "raw")
    plan = _facts_of(machine).gate_plans.get(state) or _plan(machine, state)
    if len(raw) > plan.max_bytes:  # (ASCII: its length is its size in bytes)
        # Refused unread, and journaled bounded: the Python path does both.
        return _py_on_propose(run, msg, now, circuits, events)
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
        return _decided(run, msg, _verify(machine, run, encoded, now, circuits), raw, now, events)
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
        accepted = _verify(machine, run, encoded, now, circuits)
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
        envelope = _envelope_decode(encoded)
    except msgspec.DecodeError:  # ValidationError too: the Python gate explains it
        return None
    if type(envelope) is not _Envelope:  # pragma: no cover - the gate's decoder's type
        return None
    target = _field(envelope, _ENV_NEXT, "next")
    if _field(envelope, _ENV_TOOL, "tool") is not None or target is None:
        return None
    raw_data = _field(envelope, _ENV_DATA, "data")
    if scan_json(encoded) is not None:
        return None
    cdef _Facts facts = _facts_of(machine)
    tables = facts.tables
    target_id = tables.state_id(target)
    if tables.check_transition(tables.state_id(state), target_id) != _OK:
        return None
    # The machine's own string for the state (equal to the one decoded): a run's states
    # are then the same few objects, which the counters' label caches find by identity.
    target = tables.states[target_id]
    cdef PyObject* validator = PyDict_GetItem(facts.data_validators, state)
    if validator is NULL:
        # ``_gate._move_data`` for a state with no data schema, inline: the data as a
        # JSON object the journal can hold, or None for the Python gate to explain
        try:
            data = _dict_decode(raw_data)
            _journal_encode(data)
        except msgspec.ValidationError:
            return None
        except _JOURNAL_ENCODING_ERRORS:
            return None
    else:
        data, violations = _move_data(machine, run, raw_data)
        if violations:
            return None
    reason = (
        "fallback" if facts.on_breaker == state and _is_fallback(machine, state) else "proposal"
    )
    cdef long long seq = run.seq + 1
    if len(raw) >= _DELTA_BY_REFERENCE and data and _proposal_data(run.run_id, seq, raw) == data:
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
        _close(run, events, now, reason, state, data, None, by_reference)
    return _verdict(run, True)


cdef object _decided(RunState run, msg, decision, raw, double now, list events):
    """The rest of the twin's ``_on_propose``, for what the compiled gate left to the
    Python one: a rejection, a transition, a call that moves on."""
    if decision.violations:
        return _reject(run, events, now, decision.violations, decision.trip)
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
    reason = "fallback" if _is_fallback(machine, state) else "proposal"
    data = decision.data
    by_reference = (
        len(raw) >= _DELTA_BY_REFERENCE
        and bool(data)
        and _proposal_data(run.run_id, run.seq + 1, raw) == data
    )
    _transition(run, events, now, decision.target, data, reason, by_reference=by_reference)
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
    except msgspec.DecodeError:
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
        canonical = _canonical_encode(args if plain else builtins)
    except _ENCODING_ERRORS:
        return _refused(run, machine, call, args, now, circuits)
    call_hash = hash64(canonical, call.seed)
    if call.once and run.committed_before(call_hash):
        return _refused(run, machine, call, args, now, circuits)
    guards = call.guards
    if guards:
        view = _RunView(run)
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
    if circuits is not None and (type(circuits) is not _CircuitBoard or circuits._circuits):
        refusal = circuits.check(call.name, now, policy)
        if refusal is not None:
            return _Decision((refusal[0],), refusal[1])
    return (call, builtins, args, call_hash)


cdef object _refused(RunState run, machine, call, args, double now, circuits):
    """The Python gate's decision on a call the compiled one found refused (by the
    journal's encoding, a committed identical call, a guard or the repeat breaker): it
    explains the refusal, guards and all."""
    return _checked_call(machine, run, call, args, now, circuits)


def on_report(RunState run, msg, double now, circuits, list events):
    """``_decider._on_report``, compiled for the success of the call the run waits for."""
    pending = run.pending
    cdef long long seq = msg.seq
    if pending is None or not msg.ok or (seq and seq != run.seq):
        return _py_on_report(run, msg, now, circuits, events)
    key = msg.key
    if pending.key != key or _terminal(run.machine, run.state):
        return _py_on_report(run, msg, now, circuits, events)
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
        _transition(run, events, now, target, {} if data is UNSET else data, "call")
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
    if run.external:
        return _DURABLE
    call = verdict.execute
    if call is None:
        return _LAG
    return _WRITE if run.machine.tool_by_name[call.tool].read_only else _DURABLE


def decide_many(sup, list msgs, list events):
    """``GroupCommit.submit_many_nowait``'s loop over ``Supervisor._decide``, compiled for
    the supervisor's proposals: each decided in order, its events appended to ``events``;
    returns each one's verdict or the error it was refused with, and whether the writer
    must be woken (a verdict that is not :data:`LAG`). A proposal is timed, decided by the
    decide path in use (``_decider._propose``, this module's unless replaced), recorded in
    its machine's verification latency and counted as ``RuntimeStats.count`` counts it,
    with no Python frame between; any other request goes through ``sup._decide`` and
    ``sup._early`` as in the loop. A bug met deciding a request ends that run only (its
    events dropped, ``sup._contain``'s error in its place), as in the loop."""
    cdef list results = []
    cdef bint wake = False
    cdef Py_ssize_t mark
    cdef double started, seconds
    cdef PyObject* found
    runs = sup._runs
    circuits = sup._circuits
    clock = sup.clock
    decide = sup._decide
    early = sup._early
    contain = sup._contain
    propose = _decider._propose
    cdef bint compiled = propose is on_propose
    cdef _Counting counting = _Counting(sup.stats)
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
                run = sup._run(run_id) if found is NULL else <object>found  # raises
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


# -- encode and frame ---------------------------------------------------------------------


def encode_rows(list events, dict tags, keyed, encode, frame):
    """``stores._base._encode_rows``, compiled: each event as ``(run_id, seq, kind, ts,
    key, framed msgpack)``, with ``tags`` the kind of each event type, ``keyed`` the types
    that carry an idempotency key, ``encode`` the journal's encoder and ``frame`` the hot
    path's ``frame_event``. Raises what ``encode`` raises."""
    cdef Py_ssize_t i, n = len(events)
    cdef list rows = [None] * n
    for i in range(n):
        event = events[i]
        kind = type(event)
        rows[i] = (
            event.run_id,
            event.seq,
            tags[kind],
            event.ts,
            event.key if kind in keyed else None,
            frame(encode(event)),
        )
    return rows


def group_batch(list events, encode, indexed, dict changes, dict slots, frame_events):
    """``stores._sqlite._Batch``'s pass over a batch, compiled: the events encoded and
    grouped by run, each run's frames joined into one chunk. Returns ``(runs, starts,
    irregular, chunks, intents, marks, contiguous, size)``, the attributes of a
    ``_Batch`` as its pure-Python ``__init__`` computes them (``tests/hot/test_decide.py``
    holds the two to the same values). Raises what ``encode`` raises."""
    cdef dict runs = {}
    cdef list intents = []
    cdef list marks = []
    cdef list starts = []
    cdef list chunks = []
    cdef list run
    cdef bint contiguous = True
    cdef bint irregular = False
    cdef PyObject* found
    cdef Py_ssize_t i, n = len(events), size = 0
    for i in range(n):
        event = events[i]
        kind = type(event)
        if PyType_IsSubtype(<type>kind, <type>Event):
            run_id = _field(event, _E_RUN_ID, "run_id")
            seq = _field(event, _E_SEQ, "seq")
        else:
            run_id = event.run_id
            seq = event.seq
        found = PyDict_GetItem(runs, run_id)
        if found is NULL:
            run = [seq, seq, [encode(event)], event, None, None, None, None]
            runs[run_id] = run
            marks.append(event)
            if kind is RunStarted:
                if seq == 1:
                    starts.append(run_id)
                else:
                    irregular = True
        else:
            run = <list>found
            if seq != run[1] + 1:
                contiguous = False
            run[1] = seq
            (<list>run[2]).append(encode(event))
            run[3] = event
            if kind in indexed:
                marks.append(event)
                if kind is RunStarted:
                    irregular = True
        if kind is Transitioned:
            run[4] = _field(event, _T_DST, "dst")
        elif kind is IntentRecorded:
            intents.append((_field(event, _IR_KEY, "key"), run_id, seq))
        elif kind in changes:
            for field, value in changes[kind](event).items():
                run[slots[field]] = value
    for run_id, value in runs.items():
        run = <list>value
        marks.append(run[3])
        body = frame_events(run[2])
        size += len(body)
        chunks.append((run_id, run[0], run[1], body))
        run[2] = None
    if contiguous and intents:
        contiguous = len({row[0] for row in intents}) == len(intents)
    return runs, starts, irregular, chunks, intents, marks, contiguous, size


def move_runs(
    dict runs, dict remembered, dict stored, set starting, Py_ssize_t first_chunk,
    encode, crc32, row_checksum, running_outcome,
):
    """``stores._sqlite._move_runs_py``, compiled: how a SQLite store's fast path moves
    the index rows of the runs a batch continues (``same``: the pending moves of those
    that stay in their outcome; ``changed``: the parameters of the UPDATE of those whose
    outcome changes; ``written``, ``prevs``, the change in running runs), or None where a
    run is not where the batch says it is. ``tests/hot/test_decide.py`` holds the two to
    the same values."""
    cdef dict written = {}
    cdef list same = []
    cdef list changed = []
    cdef list prevs = []
    cdef list run
    cdef tuple row
    cdef PyObject* found
    cdef Py_ssize_t chunk = first_chunk - 1
    cdef long running = 0
    for run_id, value in runs.items():
        chunk += 1
        run = <list>value
        first = run[0]
        if first == 1 and starting and run_id in starting:
            prevs.append(None)
            continue
        before = first - 1
        found = PyDict_GetItem(remembered, run_id)
        if found is NULL or (<tuple>found)[3] != before:
            found = PyDict_GetItem(stored, run_id)
            if found is NULL or (<tuple>found)[3] != before:
                return None
        row = <tuple>found
        machine = row[0]
        was = row[2]
        started_at = row[4]
        was_reason = row[6]
        was_detail = row[7]
        prevs.append(row[9])
        seq = run[1]
        updated = run[3].ts
        state = run[4]
        if state is None:
            state = row[1]
        outcome = run[5]
        if outcome is None:
            crc = crc32(
                encode(
                    (
                        run_id, machine, state, was, seq, float(started_at), float(updated),
                        was_reason, was_detail,
                    )
                )
            )
            moved = (
                machine, state, was, seq, started_at, updated, was_reason, was_detail, crc, chunk
            )
            same.append((run_id,) + moved)
            written[run_id] = moved
        else:
            reason = run[6]
            if reason is None:
                reason = was_reason
            detail = run[7]
            if detail is None:
                detail = was_detail
            crc = row_checksum(
                run_id, machine, state, outcome, seq, started_at, updated, reason, detail
            )
            changed.append(
                (seq, updated, state, crc, chunk, run_id) + row + (outcome, reason, detail)
            )
            written[run_id] = (
                machine, state, outcome, seq, started_at, updated, reason, detail, crc, chunk
            )
            running += (outcome == running_outcome) - (was == running_outcome)
    return same, changed, written, prevs, running


def accept_call(RunState run, bytes raw, double now, circuits):
    """The compiled gate's accepted path on its own, for the benchmarks and the tests:
    ``(call, builtins, value, call_hash)`` for a call it accepts, a ``Decision`` for one a
    guard, the encoding, the repeat breaker or the circuit refused, None for whatever the
    Python gate (``verify``) must decide (see ``_accept_call``)."""
    machine = run.machine
    if not _within_budgets(run, machine, now):
        return None
    plan = machine.gate_plans.get(run.state) or _plan(machine, run.state)
    return _accept_call(run, machine, plan, raw, now, circuits)


# -- the gateway's batch: its intake and its settling -------------------------------------

cdef object _GatewayError = None
cdef object _allow = None
cdef object _hosted = None
cdef object _item_problem = None
cdef object _Answer = None
cdef object _NO_USAGE = None
cdef object _usage = None
cdef object _VerdictOut = None
cdef object _verdict_out = None
cdef tuple _AGENT = ("agent",)
# the fields of a batch's items (ProposalIn from the channel, VerifyItem from POST
# /v1/verify): [expected_seq, proposal, usage, model] of each class
cdef object _ProposalIn = None
cdef object _VerifyItem = None
cdef Py_ssize_t _PI_OFFSETS[4]
cdef Py_ssize_t _VI_OFFSETS[4]
cdef Py_ssize_t _NO_OFFSETS[4]
_NO_OFFSETS[:] = [-1, -1, -1, -1]
cdef Py_ssize_t _A_SETTLED = -1, _A_EVENT = -1


def bind_gateway(namespace):
    """Take what a batch's intake and settling need from ``interlock.gateway._service``
    (which imports this module)."""
    global _GatewayError, _allow, _hosted, _item_problem, _Answer, _NO_USAGE, _usage
    global _VerdictOut, _verdict_out
    _GatewayError = namespace.GatewayError
    _allow = namespace.GatewayService._allow
    _hosted = namespace._hosted
    _item_problem = namespace._item_problem
    _Answer = namespace._Answer
    _NO_USAGE = namespace._NO_USAGE
    _usage = namespace._usage
    _VerdictOut = namespace.VerdictOut
    _verdict_out = namespace.verdict_out
    global _ProposalIn, _VerifyItem, _A_SETTLED, _A_EVENT
    _ProposalIn = namespace.ProposalIn
    _VerifyItem = namespace.VerifyItem
    cdef Py_ssize_t i
    for i, name in enumerate(("expected_seq", "proposal", "usage", "model")):
        _PI_OFFSETS[i] = _offset(_ProposalIn, name)
        _VI_OFFSETS[i] = _offset(_VerifyItem, name)
    _A_SETTLED = _offset(_Answer, "settled")
    _A_EVENT = _offset(_Answer, "event")


cdef extern from "Python.h":
    bint PyExceptionInstance_Check(object)


cdef void _decide_group(
    submit, refused, list msgs, list taken, list decided, list verdicts
) except *:
    """``_service._decide_group``: ``msgs`` decided at once, each verdict to ``decided``."""
    cdef list results = submit(msgs)
    cdef Py_ssize_t at, count = len(taken)
    cdef tuple entry
    if len(results) != count:  # pragma: no cover - a bug in the supervisor
        raise RuntimeError(f"{len(results)} verdicts for {count} proposals")
    for at in range(count):
        result = results[at]
        if PyExceptionInstance_Check(result):
            refused(taken, at, result, verdicts)
        else:
            entry = <tuple>taken[at]
            decided.append((entry[0], result, entry[2], entry[3]))


def take_proposals(
    dict runs, answers, list run_ids, list bodies, principal, submit, refused,
    list verdicts, list later, list decided,
):
    """``_service._take_proposals_py`` (the same arguments and results), compiled: a run's
    seq and flags are read as C fields, with no Python frame per item."""
    cdef Py_ssize_t index, count = len(bodies)
    cdef set allowed = set()
    cdef list msgs = []
    cdef list taken = []
    cdef set taking = set()
    cdef PyObject* found
    cdef RunState run
    cdef Py_ssize_t* offsets
    for index in range(count):
        run_id = run_ids[index]
        item = bodies[index]
        kind = type(item)
        if kind is _ProposalIn:
            offsets = &_PI_OFFSETS[0]
        elif kind is _VerifyItem:
            offsets = &_VI_OFFSETS[0]
        else:
            offsets = &_NO_OFFSETS[0]
        found = PyDict_GetItem(runs, run_id)
        if found is NULL:
            later.append(index)
            continue
        run = <RunState?>found
        if run_id in taking:
            _decide_group(submit, refused, msgs, taken, decided, verdicts)
            msgs = []
            taken = []
            taking = set()
        answer = None
        if principal is not None:
            machine = run.machine.name
            if machine not in allowed:
                try:
                    _allow(principal, _AGENT, machine)
                except _GatewayError as exc:
                    verdicts[index] = _item_problem(run_id, exc)
                    continue
                allowed.add(machine)
        if not run.external:
            verdicts[index] = _item_problem(run_id, _hosted(run_id))
            continue
        expected = _field(item, offsets[0], "expected_seq")
        proposal = _field(item, offsets[1], "proposal")
        if expected is not None:
            known = answers.get(run_id)
            if known is not None and known.seq == expected and known.proposal == proposal:
                later.append(index)  # a repeat: it gets the recorded answer
                continue
            if run.seq != expected:
                later.append(index)  # stale, or answered before: the journal says
                continue
            answer = _Answer(expected, proposal)
            answers[run_id] = answer
            if known is not None:
                answers.move_to_end(run_id)
        usage = _field(item, offsets[2], "usage")
        msgs.append(
            Propose(
                run_id=run_id,
                seq=expected or 0,
                raw=proposal,
                usage=_NO_USAGE if usage is None else _usage(usage),
                model=_field(item, offsets[3], "model"),
            )
        )
        taken.append((index, run_id, answer, run.seq))
        taking.add(run_id)
    if msgs:
        _decide_group(submit, refused, msgs, taken, decided, verdicts)


def settle_from(
    list decided, Py_ssize_t at, list verdicts, dict runs, settle, dict steps, steps_of,
    set reconciling,
):
    """``_service._settle_from_py`` (the same arguments and result), compiled; a move's
    answer (the most common) is built inline, as ``verdict_out`` builds it."""
    cdef Py_ssize_t position, count = len(decided)
    cdef PyObject* found
    cdef RunState run
    cdef tuple entry
    cdef bint exact
    for position in range(at, count):
        entry = <tuple>decided[position]
        index = entry[0]
        verdict = entry[1]
        answer = entry[2]
        exact = type(verdict) is Verdict  # else each field is read by name
        run_id = _field(verdict, _V_RUN_ID if exact else -1, "run_id")
        found = PyDict_GetItem(runs, run_id)
        if found is not NULL:
            run = <RunState?>found
            if run.closed and _terminal(run.machine, run.state):
                settle(run_id)
                found = PyDict_GetItem(runs, run_id)
                if found is not NULL:
                    run = <RunState?>found
        call = _field(verdict, _V_EXECUTE if exact else -1, "execute")
        reconcile = _field(verdict, _V_RECONCILE if exact else -1, "reconcile")
        if found is not NULL and call is None and not reconcile and run.external and not run.closed and run.pending is None:
            machine = run.machine
            names = steps.get(machine.name)
            if names is None:
                names = steps_of(machine)
            if run.state in names:
                return position
        if (
            call is None
            and reconcile is None
            and not _field(verdict, _V_VIOLATIONS if exact else -1, "violations")
            and _field(verdict, _V_RESULT if exact else -1, "result") is None
            and not _field(verdict, _V_RETRY_IN if exact else -1, "retry_in")
        ):
            out = _VerdictOut(
                run_id=run_id,
                accepted=_field(verdict, _V_ACCEPTED if exact else -1, "accepted"),
                outcome=_field(verdict, _V_OUTCOME if exact else -1, "outcome"),
                state=_field(verdict, _V_STATE if exact else -1, "state"),
                seq=_field(verdict, _V_SEQ if exact else -1, "seq"),
            )
        else:
            out = _verdict_out(verdict)
            reconcile = out.reconcile
            if reconcile is not None:
                reconciling.add((run_id, reconcile.key))
        if answer is not None:
            answer.verdict = out
            # _Answer.settle, inline: settled, and whoever waits woken
            answer.settled = True
            event = _field(answer, _A_EVENT if type(answer) is _Answer else -1, "event")
            if event is not None:
                event.set()
        verdicts[index] = out
    return count


# -- the gateway's channel: a batch's passes --------------------------------------------

cdef object _ChannelRequest = None
cdef object _ChannelAnswer = None
cdef object _answer_encode_into = None
cdef Py_ssize_t _CR_ID = -1, _CR_RUN_ID = -1, _CR_BODY = -1, _CR_OP = -1
cdef object _DECODE_ERRORS = (msgspec.ValidationError, msgspec.DecodeError)
cdef object _decode_request = None
cdef object _deque = None
cdef int _FRAMES_DONE = 0, _FRAMES_FULL = 1, _FRAMES_BAD_SIZE = 2


def bind_channel(namespace):
    """Take what a channel batch's passes need from ``interlock.gateway._channel`` (which
    imports this module)."""
    global _ChannelRequest, _ChannelAnswer, _answer_encode_into, _CR_ID, _CR_RUN_ID, _CR_BODY
    answer = namespace._Answer
    # frame_verdicts writes an answer's map itself: {id, body}, as msgspec writes it
    if answer.__struct_fields__ != ("id", "body", "problem") or not (
        answer.__struct_config__.omit_defaults
    ):  # pragma: no cover - a twin changed alone
        raise ImportError("interlock.core._decide is out of date: rebuild it (pip install -e .)")
    _ChannelAnswer = answer
    _ChannelRequest = namespace.ChannelRequest
    _answer_encode_into = namespace._ENCODE_INTO
    _CR_ID = _offset(_ChannelRequest, "id")
    _CR_RUN_ID = _offset(_ChannelRequest, "run_id")
    _CR_BODY = _offset(_ChannelRequest, "body")
    global _CR_OP, _decode_request, _deque, _FRAMES_DONE, _FRAMES_FULL, _FRAMES_BAD_SIZE
    _CR_OP = _offset(_ChannelRequest, "op")
    _decode_request = namespace._DECODE_REQUEST
    _deque = namespace.deque
    _FRAMES_DONE = namespace._DONE
    _FRAMES_FULL = namespace._FULL
    _FRAMES_BAD_SIZE = namespace._BAD_SIZE


def take_frames(conn, bytes data, Py_ssize_t pos, take, nursery):
    """``_channel._take_frames_py`` (the same arguments, results and effects), compiled,
    with ``_Connection._take``'s first branch inline: a proposal of a run, on a connection
    with a key and no rate limit, is queued behind its run's requests, or batched if the
    run is idle, with no Python frame; any other frame goes to ``take``."""
    cdef Py_ssize_t end = len(data), size
    cdef Py_ssize_t max_frame = conn.max_frame, max_in_flight = conn.max_in_flight
    cdef Py_ssize_t in_flight = conn.in_flight
    cdef const unsigned char* at
    cdef const unsigned char* start = <const unsigned char*>(<char*>data)
    cdef bint fast = conn.principal is not None and conn.rate_limiter is None
    cdef dict runs = conn.runs
    cdef PyObject* found
    batch = conn.batch
    while end - pos >= 4:
        at = start + pos
        size = (<Py_ssize_t>at[0] << 24) | (<Py_ssize_t>at[1] << 16) | (<Py_ssize_t>at[2] << 8) | at[3]
        if size > max_frame or size == 0:
            conn.in_flight = in_flight
            return pos, _FRAMES_BAD_SIZE, size
        if end - pos - 4 < size:
            break
        if in_flight >= max_in_flight:
            conn.in_flight = in_flight
            return pos, _FRAMES_FULL, 0
        payload = data[pos + 4 : pos + 4 + size]
        pos += 4 + size
        if fast:
            try:
                request = _decode_request(payload)
            except msgspec.DecodeError:
                request = None
            if request is not None and type(request) is _ChannelRequest:
                run_id = _field(request, _CR_RUN_ID, "run_id")
                if _field(request, _CR_OP, "op") == "propose" and run_id:
                    in_flight += 1
                    found = PyDict_GetItem(runs, run_id)
                    if found is not NULL:
                        (<object>found).append(request)
                    else:
                        runs[run_id] = _deque()
                        batch.append(request)
                    continue
        conn.in_flight = in_flight
        take(payload, nursery)
        in_flight = conn.in_flight
        runs = conn.runs
        batch = conn.batch
        fast = conn.principal is not None and conn.rate_limiter is None
    conn.in_flight = in_flight
    return pos, _FRAMES_DONE, 0


def take_bodies(list requests, decode, refuse, list taken, list run_ids, list bodies):
    """``_channel._take_bodies_py`` (the same arguments and results), compiled."""
    cdef bint exact
    for request in requests:
        exact = type(request) is _ChannelRequest
        try:
            body = decode(_field(request, _CR_BODY if exact else -1, "body"))
        except _DECODE_ERRORS as exc:
            refuse(request, exc)
            continue
        run_id = _field(request, _CR_RUN_ID if exact else -1, "run_id")
        if run_id is None:  # pragma: no cover - the reader batches proposals of a run only
            raise AssertionError("a proposal of no run in a batch")
        taken.append(request)
        run_ids.append(run_id)
        bodies.append(body)


cdef inline Py_ssize_t _put_uint(unsigned char* at, unsigned long long value) noexcept:
    """``value`` as msgpack writes a non-negative int (its shortest form); its length."""
    if value < 128:
        at[0] = <unsigned char>value
        return 1
    if value < 256:
        at[0] = 0xcc
        at[1] = <unsigned char>value
        return 2
    cdef Py_ssize_t size, i
    if value < 65536:
        at[0] = 0xcd
        size = 2
    elif value < 4294967296:
        at[0] = 0xce
        size = 4
    else:
        at[0] = 0xcf
        size = 8
    for i in range(size):
        at[size - i] = <unsigned char>(value >> (8 * i))
    return size + 1


def frame_verdicts(bytearray out, list requests, list verdicts, put):
    """``_channel._frame_verdicts_py`` (the same arguments, the same bytes in ``out``),
    compiled: an answer with a verdict is framed here, its map (``{id, body}``, as
    msgspec writes an ``_Answer`` with no problem) written around the verdict's own
    encoding; any other answer goes to ``put``."""
    cdef Py_ssize_t index, count = len(requests), start, size, length
    cdef unsigned char prefix[24]
    cdef unsigned char* data
    cdef long long request_id
    if len(verdicts) != count:  # pragma: no cover - zip(strict=True) in the twin
        raise ValueError("as many verdicts as requests")
    for index in range(count):
        request = requests[index]
        verdict = verdicts[index]
        ident = _field(request, _CR_ID if type(request) is _ChannelRequest else -1, "id")
        problem = verdict.problem
        if problem is not None or type(ident) is not int or not 0 <= ident < 2**63:
            if problem is not None:
                put(_ChannelAnswer(id=ident, problem=problem))
            else:
                put(_ChannelAnswer(id=ident, body=verdict))
            continue
        request_id = ident
        # the frame's length (written last), then the map's header, "id", the id, "body"
        prefix[0] = prefix[1] = prefix[2] = prefix[3] = 0
        prefix[4] = 0x82
        prefix[5] = 0xa2
        prefix[6] = 0x69  # i
        prefix[7] = 0x64  # d
        length = 8 + _put_uint(prefix + 8, <unsigned long long>request_id)
        prefix[length] = 0xa4
        memcpy(prefix + length + 1, b"body", 4)
        length += 5
        start = PyByteArray_GET_SIZE(out)
        PyByteArray_Resize(out, start + length)
        memcpy(PyByteArray_AS_STRING(out) + start, prefix, length)
        try:
            _answer_encode_into(verdict, out, -1)
        except Exception:  # pragma: no cover - put explains what could not be encoded
            PyByteArray_Resize(out, start)
            put(_ChannelAnswer(id=ident, body=verdict))
            continue
        size = PyByteArray_GET_SIZE(out) - start - 4
        data = <unsigned char*>PyByteArray_AS_STRING(out) + start
        data[0] = <unsigned char>(size >> 24)
        data[1] = <unsigned char>(size >> 16)
        data[2] = <unsigned char>(size >> 8)
        data[3] = <unsigned char>size


def release_runs(list requests, dict runs, schedule):
    """``_channel._release_runs_py`` (the same arguments and effects), compiled."""
    for request in requests:
        run_id = _field(request, _CR_RUN_ID if type(request) is _ChannelRequest else -1, "run_id")
        if run_id is None:  # pragma: no cover - the reader batches proposals of a run only
            raise AssertionError("a proposal of no run in a batch")
        if runs[run_id]:
            schedule(run_id)
        else:
            del runs[run_id]
