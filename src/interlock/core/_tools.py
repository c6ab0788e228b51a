"""Tool specs, and their argument schemas compiled once into strict validators."""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import msgspec.inspect
import msgspec.structs

from ._events import Violation
from ._exceptions import ToolDefinitionError
from ._pacing import backoff_delay

if TYPE_CHECKING:
    import random

    from ._view import RunView

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")


class Reject(msgspec.Struct, frozen=True):
    """What a guard returns to refuse a call. Becomes a ``guard`` violation."""

    message: str
    """What is wrong, naming the value and the rule: ``amount: 150.0 exceeds ...``."""
    hint: str
    """What to propose instead: ``propose amount <= 100.0``."""
    path: str = "args"
    """Where in the proposal: ``args.amount``."""


Guard = Callable[[Any, "RunView"], Reject | None]
"""A pure function of the validated args and a read-only run view. No I/O."""


class ToolError(Exception):
    """Raise from a tool to say what its failure means for a retry.

    Any other exception from a tool is a failure whose effect is unknown: for a tool
    that is not idempotent the call is then in doubt (reconciled, or escalated), never
    run again blindly.

    Args:
      message: what failed.
      retryable: whether trying again may succeed (HTTP 429/5xx, a dropped connection).
      retry_after: seconds the downstream asked us to wait, if it said (Retry-After).
      applied: ``False`` when the downstream certainly did not apply the call (the
        request was refused before it acted, or never left): only that lets a tool that
        is not idempotent be retried, or its failure be handed back to the model.
        ``None`` (the default) means unknown; ``True``, applied and then failed.
    """

    def __init__(
        self,
        message: str,
        *,
        retryable: bool = False,
        retry_after: float | None = None,
        applied: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.retry_after = retry_after
        self.applied = applied


class RetryableToolError(ToolError):
    """Raise from a tool for a failure worth retrying (HTTP 429/5xx, a dropped connection).

    Args:
      message: what failed.
      retry_after: seconds the downstream asked us to wait, if it said (Retry-After).
      applied: ``False`` when the downstream certainly did not apply the call; see
        :class:`ToolError`.
    """

    def __init__(
        self, message: str, *, retry_after: float | None = None, applied: bool | None = None
    ) -> None:
        super().__init__(message, retryable=True, retry_after=retry_after, applied=applied)


@dataclass(frozen=True)
class RetryPolicy:
    """How a tool's retryable failures are retried: exponential backoff with full jitter.

    Only a tool that is safe to repeat (idempotent or read-only) is retried after a
    failure whose effect is unknown; one that is not is retried only after a failure
    that says it was not applied (:class:`ToolError` ``applied=False``, or an exception
    type the tool lists in ``not_applied``).

    Attributes:
      attempts: total attempts, the first included (1 disables retries). For a call in
        doubt (a tool that is not safe to repeat and has ``reconcile``), the number of
        reconciliations of that one call: each that reports the key not applied runs it
        once more, so it runs at most ``attempts + 1`` times before it escalates.
      base: seconds before the first retry, doubled after each.
      cap: the longest wait in seconds, Retry-After included.
      jitter: draw each wait uniformly from [wait/2, wait] so runs do not retry in lockstep.
    """

    attempts: int = 3
    base: float = 0.1
    cap: float = 10.0
    jitter: bool = True

    def delay(self, attempt: int, retry_after: float | None, rng: random.Random) -> float:
        """Return the seconds to wait after failed attempt number ``attempt`` (1-based)."""
        return backoff_delay(
            attempt, retry_after, rng, base=self.base, cap=self.cap, jitter=self.jitter
        )


class Applied(msgspec.Struct, frozen=True):
    """What a tool's ``reconcile`` returns when the downstream did apply the key.

    ``result`` is committed as the call's result (as if ``execute`` had returned it);
    the call is not executed again.
    """

    result: Any = None


class NotApplied(msgspec.Struct, frozen=True):
    """What a tool's ``reconcile`` returns when the downstream never applied the key.

    The call is then executed once, with the same key. Return the class or an instance.
    """


Reconcile = Callable[
    [str, Any, "ToolContext"], Awaitable["Applied | NotApplied | type[NotApplied]"]
]
"""``async def reconcile(key, args, ctx) -> Applied(result) | NotApplied``."""


@dataclass(frozen=True, slots=True)
class ToolContext:
    """What a tool's ``execute`` receives besides its args."""

    run_id: str
    state: str
    key: str
    """The idempotency key, ``run_id:state:seq``; pass it downstream so a retry cannot double-apply."""
    attempt: int
    """1 for the first attempt, 2 for the first retry, ..."""
    epoch: int = 0
    """The run's lease epoch on PostgreSQL (0 where runs are not leased): it grows each
    time another process takes the run over. A downstream that keeps the highest epoch it
    has seen per key can refuse a late call from a process that stalled and lost the run."""


class Execute(Protocol):
    def __call__(self, args: Any, ctx: ToolContext, /) -> Awaitable[Any]: ...


class Validator(Protocol):
    """A compiled argument schema."""

    def validate_json(self, raw: bytes) -> tuple[Any, tuple[Violation, ...]]:
        """Return ``(args, ())`` or ``(None, violations)``."""
        ...

    def to_builtins(self, args: Any) -> dict[str, Any]: ...

    def from_builtins(self, args: dict[str, Any]) -> Any:
        """Rebuild validated args from their journaled builtins (no coercion, no checks lost)."""
        ...

    def json_schema(self) -> dict[str, Any]: ...


def _schema_violation(path: str, message: str, hint: str) -> tuple[Violation, ...]:
    return (Violation("schema", path, message, hint),)


_MSGSPEC_ERROR = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)


class _MsgspecValidator:
    __slots__ = ("_decoder", "_plain", "_schema", "_type")

    def __init__(self, type_: Any) -> None:
        self._type = type_
        self._decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder(type_)
        self._schema: dict[str, Any] | None = None
        self._plain = plain_struct(type_)

    @property
    def plain(self) -> bool:
        """Whether ``to_builtins`` of validated args is ``msgspec.structs.asdict`` of them."""
        return self._plain

    @property
    def struct(self) -> type[msgspec.Struct] | None:
        """The args Struct class, if the schema is one (the gate can then decode a call once)."""
        type_ = self._type
        if isinstance(type_, type) and issubclass(type_, msgspec.Struct):
            return type_
        return None

    def validate_json(self, raw: bytes) -> tuple[Any, tuple[Violation, ...]]:
        try:
            return self._decoder.decode(raw), ()
        except msgspec.ValidationError as exc:
            match = _MSGSPEC_ERROR.match(str(exc))
            assert match is not None
            path = "args" + (match["path"] or "")
            text = match["msg"]
            return None, _schema_violation(
                path, f"{path}: {_lower_first(text)}", _schema_hint(text, path, self.json_schema())
            )
        except msgspec.DecodeError as exc:  # pragma: no cover - args were already parsed once
            return None, _schema_violation("args", f"args: {exc}", "send args as a JSON object")

    def to_builtins(self, args: Any) -> dict[str, Any]:
        if self._plain and type(args) is self._type:
            # Equal to msgspec.to_builtins here (see plain_struct), at half the cost.
            fields: dict[str, Any] = msgspec.structs.asdict(args)
            return fields
        result: dict[str, Any] = msgspec.to_builtins(args)
        return result

    def from_builtins(self, args: dict[str, Any]) -> Any:
        return msgspec.convert(args, self._type)

    def json_schema(self) -> dict[str, Any]:
        if self._schema is None:
            schema = msgspec.json.schema(self._type)
            defs = schema.get("$defs", {})
            ref = schema.get("$ref", "")
            if ref.startswith("#/$defs/") and len(defs) == 1:
                schema = defs[ref.removeprefix("#/$defs/")]
            self._schema = schema
        return self._schema


_PLAIN_SCALARS = (
    msgspec.inspect.StrType,
    msgspec.inspect.IntType,
    msgspec.inspect.FloatType,
    msgspec.inspect.BoolType,
    msgspec.inspect.NoneType,
    msgspec.inspect.LiteralType,
    msgspec.inspect.AnyType,
)
_PLAIN_DEFAULTS = (str, int, float, bool, type(None))


def _plain_value(info: msgspec.inspect.Type) -> bool:
    """Whether a value of this type, decoded from JSON, is already JSON builtins."""
    if isinstance(info, _PLAIN_SCALARS):
        # An Any decoded from JSON is dicts, lists, str, int, float, bool and None.
        return True
    if isinstance(info, msgspec.inspect.ListType):
        return _plain_value(info.item_type)
    if isinstance(info, msgspec.inspect.DictType):
        return isinstance(info.key_type, msgspec.inspect.StrType) and _plain_value(info.value_type)
    if isinstance(info, msgspec.inspect.UnionType):
        return all(_plain_value(member) for member in info.types)
    return False


def plain_struct(type_: Any) -> bool:
    """Whether ``msgspec.structs.asdict`` of a decoded ``type_`` equals ``msgspec.to_builtins`` of it.

    True for a Struct class whose fields are all JSON builtins once decoded (str, int,
    float, bool, None, literals, Any, and lists and str-keyed dicts of those), with
    builtin defaults, no renamed fields, no tag, not array-like and no omitted defaults.
    Anything else (nested Structs, tuples, sets, enums, dates, UNSET fields, ...) is
    converted by ``msgspec.to_builtins``.
    """
    if not (isinstance(type_, type) and issubclass(type_, msgspec.Struct)):
        return False
    config = type_.__struct_config__
    if config.omit_defaults or config.array_like or config.tag_field is not None:
        return False
    try:
        info = msgspec.inspect.type_info(type_)
    except Exception:  # pragma: no cover - a Struct msgspec itself cannot describe
        return False
    if not isinstance(info, msgspec.inspect.StructType):  # pragma: no cover - defensive
        return False
    for field_ in info.fields:
        if field_.encode_name != field_.name or not _plain_value(field_.type):
            return False
        if field_.required:
            continue
        # An optional field needs a builtin default: an UNSET one shows as neither a
        # default nor a factory, and asdict would keep it where to_builtins drops it.
        if field_.default_factory in (list, dict):
            continue
        if field_.default is msgspec.NODEFAULT or type(field_.default) not in _PLAIN_DEFAULTS:
            return False
    return True


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:] if text else text


def _field_schema(schema: Mapping[str, Any], path: str) -> Mapping[str, Any]:
    node: Any = schema
    for part in re.findall(r"\.(\w+)|\[(\d+)\]", path.removeprefix("args")):
        name, _index = part
        if not isinstance(node, Mapping):
            return {}
        node = node.get("properties", {}).get(name, {}) if name else node.get("items", {})
    return node if isinstance(node, Mapping) else {}


_FORMAT_EXAMPLES = {
    "date-time": "2024-05-01T12:00:00Z",
    "date": "2024-05-01",
    "time": "12:00:00",
    "duration": "P1DT2H",
    "uuid": "123e4567-e89b-12d3-a456-426614174000",
}


def _schema_hint(text: str, path: str, schema: Mapping[str, Any]) -> str:
    """Turn a validator's complaint into an instruction the model can follow."""
    if text.startswith("Object missing required field"):
        name = text.split("`")[1] if "`" in text else "?"
        return f"include the required field {path}.{name}".replace("args.", "args.", 1)
    field_schema = _field_schema(schema, path)
    if text.startswith("Object contains unknown field"):
        if "properties" not in field_schema:
            return "remove the field"
        allowed = sorted(field_schema["properties"])
        return f"remove the field; allowed fields: {', '.join(allowed) or 'none'}"
    if field_schema.get("format") in _FORMAT_EXAMPLES:
        example = _FORMAT_EXAMPLES[field_schema["format"]]
        return f"send {path} as a {field_schema['format']} string, like {example!r}"
    if "enum" in field_schema:
        return f"use one of: {', '.join(map(str, field_schema['enum']))}"
    rules = []
    for key, word in (
        ("minimum", ">="),
        ("exclusiveMinimum", ">"),
        ("maximum", "<="),
        ("exclusiveMaximum", "<"),
        ("minLength", "length >="),
        ("maxLength", "length <="),
        ("minItems", "items >="),
        ("maxItems", "items <="),
        ("pattern", "matching"),
        ("multipleOf", "a multiple of"),
    ):
        if key in field_schema:
            rules.append(f"{word} {field_schema[key]}")
    if text.startswith("Expected") and ", got `" in text:
        expected = text.split("`")[1]
        got = text.rsplit("`", 2)[1]
        extra = f" ({', '.join(rules)})" if rules else ""
        return f"send {path} as a JSON {expected}{extra}, not {got}"
    if text.startswith("Expected `"):
        # A constraint, e.g. "Expected `float` > 0" or "Expected `str` matching regex '...'".
        constraint = text.split("`", 2)[2].strip()
        return f"propose {path} {constraint}"
    if rules:
        return f"propose {path} {' and '.join(rules)}"
    return f"fix {path} to match the tool's argument schema"


class _PydanticValidator:
    __slots__ = ("_schema", "_validator")

    def __init__(self, validator: Any, schema: dict[str, Any] | None) -> None:
        self._validator = validator
        self._schema = schema or {}

    def validate_json(self, raw: bytes) -> tuple[Any, tuple[Violation, ...]]:
        from pydantic_core import ValidationError

        try:
            return self._validator.validate_json(bytes(raw), strict=True), ()
        except ValidationError as exc:
            violations = []
            for error in exc.errors(include_url=False):
                path = "args" + "".join(
                    f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"]
                )
                message = f"{path}: {_lower_first(error['msg'])}"
                if "input" in error and error["type"] != "missing":
                    message += f" (got {error['input']!r})"
                hint = _pydantic_hint(error, path)
                violations.append(Violation("schema", path, message, hint))
            return None, tuple(violations)

    def to_builtins(self, args: Any) -> dict[str, Any]:
        if hasattr(args, "model_dump"):
            result: dict[str, Any] = args.model_dump(mode="json")
            return result
        converted: dict[str, Any] = msgspec.to_builtins(args)
        return converted

    def from_builtins(self, args: dict[str, Any]) -> Any:
        return self._validator.validate_python(args)

    def json_schema(self) -> dict[str, Any]:
        return self._schema


def _pydantic_hint(error: Mapping[str, Any], path: str) -> str:
    kind = error["type"]
    ctx = error.get("ctx") or {}
    if kind == "missing":
        return f"include the required field {path}"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        word = {
            "greater_than": ">",
            "greater_than_equal": ">=",
            "less_than": "<",
            "less_than_equal": "<=",
        }[kind]
        bound = next(iter(ctx.values()), "?")
        return f"propose {path} {word} {bound}"
    if kind in ("literal_error", "enum"):
        return f"use one of: {ctx.get('expected', '?')}"
    if kind == "extra_forbidden":
        return "remove the field"
    return f"fix {path}: {_lower_first(error['msg'])}"


def compile_schema(spec: Any, tool: str) -> Validator:
    """Compile an argument schema once.

    Args:
      spec: a msgspec ``Struct`` class, a pydantic model class, a pydantic-core
        ``SchemaValidator`` or core schema dict, or a JSON Schema dict (``"type": "object"``).
      tool: the tool's name, for error messages.

    Raises:
      ToolDefinitionError: if ``spec`` is none of those, or uses an unsupported keyword.
    """
    if isinstance(spec, type) and issubclass(spec, msgspec.Struct):
        return _MsgspecValidator(spec)
    if isinstance(spec, type) and hasattr(spec, "__pydantic_validator__"):
        return _PydanticValidator(spec.__pydantic_validator__, spec.model_json_schema())  # type: ignore[attr-defined]
    try:
        from pydantic_core import SchemaValidator
    except ImportError:  # pragma: no cover - pydantic-core is a dependency
        SchemaValidator = None  # type: ignore[assignment,misc]
    if SchemaValidator is not None and isinstance(spec, SchemaValidator):
        return _PydanticValidator(spec, None)
    if isinstance(spec, Mapping):
        kind = spec.get("type")
        if kind == "object" or "properties" in spec or "$schema" in spec:
            from ._schema import compile_json_schema  # it builds on _MsgspecValidator

            return compile_json_schema(spec, tool)
        if SchemaValidator is not None and isinstance(kind, str):
            try:
                compiled = SchemaValidator(dict(spec))
            except Exception as exc:
                raise ToolDefinitionError(
                    f"tool {tool!r}: invalid pydantic-core schema: {exc}"
                ) from exc
            return _PydanticValidator(compiled, None)
    raise ToolDefinitionError(
        f"tool {tool!r}: args must be a msgspec Struct class, a pydantic model, a pydantic-core "
        f"schema or a JSON Schema object; got {spec!r}"
    )


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - an object with an async __call__
    )


def _check_guard(tool: str, guard: Guard) -> None:
    """Refuse a guard the gate could not call as ``guard(args, view)``, or one that would
    return a coroutine (a guard does no I/O): found now, not when a model's call meets it.

    Raises:
      ToolDefinitionError: naming the guard, its parameters and the signature expected.
    """
    name = getattr(guard, "__name__", None) or repr(guard)
    expected = f"def {name}(args, view) -> Reject | None"
    if _is_async(guard):
        raise ToolDefinitionError(
            f"tool {tool!r}: guard {name!r} is async; a guard is a plain function that does "
            f"no I/O, called as guard(args, view): write {expected}"
        )
    try:
        signature = inspect.signature(guard)
    except (TypeError, ValueError):  # a builtin or extension without one: nothing to check
        return
    try:
        signature.bind(None, None)
    except TypeError:
        raise ToolDefinitionError(
            f"tool {tool!r}: guard {name!r} takes {signature}, but a guard is called with "
            f"two positional arguments, guard(args, view): write {expected}"
        ) from None


class _NoArgs(msgspec.Struct, forbid_unknown_fields=True):
    pass


@dataclass(frozen=True, eq=False)
class Tool:
    """A tool the model (or a step) may call, once the gate has verified the call.

    Attributes:
      name: unique within a machine; letters, digits, ``_ . -``.
      execute: ``async def execute(args, ctx: ToolContext) -> result``; the result must
        be JSON-serialisable (builtins or msgspec Structs).
      args: the argument schema (see :func:`compile_schema`); no args by default.
      description: shown to the model.
      guards: pure checks over ``(args, view)`` that return a :class:`Reject` or None.
      timeout: seconds one attempt may take before it counts as a retryable failure.
      retry: how retryable failures are retried.
      idempotent: the tool honours ``ctx.key``, so it is safe to run again with the same
        key after a crash or a failed attempt. A call of a tool that is not idempotent
        whose outcome is in doubt is reconciled (below) or escalated, never run again.
      read_only: the tool changes nothing anywhere (always safe to run again).
      repeatable: repeats are meant: the same call (this tool, the same canonical args)
        may be committed more than once in a run, each time under its own key (a poll,
        a "send another reminder"). Off by default: a call identical to one the run
        already committed is refused by the gate (code ``already_committed``, quoting
        the earlier result), since running it again would apply its side effect twice.
        A read-only tool needs no such declaration: its repeats change nothing.
      not_applied: exception types that mean the call was certainly not applied (the
        request never reached the downstream, or was refused before it acted); only such
        a failure (or a :class:`ToolError` with ``applied=False``) lets a tool that is
        not idempotent be retried or its failure be handed back to the model.
      reconcile: ``async def reconcile(key, args, ctx)`` asks the downstream whether the
        call with idempotency key ``key`` was applied, and returns :class:`Applied` with
        the recorded result or :class:`NotApplied`. Called for a call in doubt (after a
        crash, or after an attempt that failed after dispatch): applied commits the
        result without executing, not applied executes once, and a reconcile that raises
        or times out escalates the run as in doubt.
    """

    name: str
    execute: Execute
    args: Any = _NoArgs
    description: str = ""
    guards: Sequence[Guard] = ()
    timeout: float = 30.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    idempotent: bool = False
    read_only: bool = False
    repeatable: bool = False
    not_applied: tuple[type[BaseException], ...] = ()
    reconcile: Reconcile | None = None
    validator: Validator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ToolDefinitionError(
                f"tool name {self.name!r} is invalid; use 1-64 letters, digits, '_', '.' or '-', "
                "starting with a letter or '_'"
            )
        if not callable(self.execute):
            raise ToolDefinitionError(
                f"tool {self.name!r}: execute must be an async function "
                f"(async def execute(args, ctx)); got {self.execute!r}"
            )
        if not _is_async(self.execute):
            raise ToolDefinitionError(
                f"tool {self.name!r}: execute must be an async function "
                f"(async def execute(args, ctx)); got the plain function "
                f"{getattr(self.execute, '__name__', self.execute)!r}: make it async, or run "
                "blocking work in it with trio.to_thread.run_sync(..., abandon_on_cancel=True)"
            )
        if (
            not (isinstance(self.timeout, int | float) and math.isfinite(self.timeout))
            or self.timeout <= 0
        ):
            raise ToolDefinitionError(
                f"tool {self.name!r}: timeout must be a positive number of seconds; got {self.timeout!r}"
            )
        if self.retry.attempts < 1:
            raise ToolDefinitionError(
                f"tool {self.name!r}: retry.attempts must be at least 1; got {self.retry.attempts}"
            )
        if self.repeatable not in (True, False):
            raise ToolDefinitionError(
                f"tool {self.name!r}: repeatable must be True or False; got {self.repeatable!r}"
            )
        not_applied = self.not_applied
        if isinstance(not_applied, type):
            not_applied = (not_applied,)
        if not isinstance(not_applied, tuple | list) or not all(
            isinstance(cls, type) and issubclass(cls, BaseException) for cls in not_applied
        ):
            raise ToolDefinitionError(
                f"tool {self.name!r}: not_applied must be a tuple of exception types; "
                f"got {self.not_applied!r}"
            )
        object.__setattr__(self, "not_applied", tuple(not_applied))
        if self.reconcile is not None and not _is_async(self.reconcile):
            raise ToolDefinitionError(
                f"tool {self.name!r}: reconcile must be an async function "
                "(async def reconcile(key, args, ctx)); got "
                f"{getattr(self.reconcile, '__name__', self.reconcile)!r}"
            )
        guards = (self.guards,) if callable(self.guards) else self.guards
        # a string is a sequence too: of one-letter "guards"
        if isinstance(guards, str | bytes) or not isinstance(guards, Sequence):
            bad: Any = guards
        else:
            bad = next((guard for guard in guards if not callable(guard)), None)
        if bad is not None:
            raise ToolDefinitionError(
                f"tool {self.name!r}: guards must be functions (args, view) -> Reject | None; "
                f"got {bad!r}: pass the function itself, not its name"
            )
        for guard in guards:
            _check_guard(self.name, guard)
        object.__setattr__(self, "guards", tuple(guards))
        object.__setattr__(self, "validator", compile_schema(self.args, self.name))

    @property
    def safe_to_repeat(self) -> bool:
        """Whether re-running a call whose outcome is unknown cannot do harm."""
        return self.idempotent or self.read_only
