"""JSON Schema argument schemas, compiled once into strict msgspec validators.

A tool's ``args`` (or a state's ``data``, or a machine's ``inputs``) may be a JSON
Schema object. It is compiled when the tool is defined; the validated value that
guards and ``execute`` receive is the JSON itself, as dicts and lists, with the
declared defaults filled in. Nothing given is dropped: an object keeps the
properties it does not declare unless ``additionalProperties`` is false.

The supported subset (any other keyword raises :class:`ToolDefinitionError` naming
it and where it is, when the machine is defined; none is ignored):

==========================  ================================================================
keyword                     meaning here
==========================  ================================================================
``type``                    ``object``, ``array``, ``string``, ``integer``, ``number``,
                            ``boolean``, ``null``, or a list of them: ``["string", "null"]``
                            is a nullable string. Strict: ``"5"`` is no integer, ``5.0``
                            is no integer, ``5`` is a number (read as ``5.0``)
(no ``type``)               any JSON value (``{}``), unless ``enum``, ``const``, ``anyOf``
                            or ``oneOf`` says otherwise
``properties``,             an object's declared properties; those not ``required`` may
``required``                be left out (``default`` fills them in, else they stay out)
``additionalProperties``    ``true`` or absent: other properties are kept as given;
                            ``false``: refused; a schema: each is checked against it. An
                            object without ``properties`` is a free-form object.
``minProperties``,          bounds on the number of properties of an object without
``maxProperties``           ``properties``
``items``                   the schema of every item; absent: any items
``minItems``, ``maxItems``  bounds on an array's length
``minLength``,              bounds on a string's length, in characters
``maxLength``
``pattern``                 a regular expression a string must match (``re.search``)
``format``                  checked for ``date-time`` (RFC 3339), ``date``, ``time``,
                            ``duration`` (ISO 8601) and ``uuid``; the value is kept in
                            its canonical spelling (``+00:00`` becomes ``Z``)
``minimum``, ``maximum``,   bounds on a number
``exclusiveMinimum``,
``exclusiveMaximum``
``multipleOf``              a number must be a multiple of it
``enum``, ``const``         one of the given strings, integers, booleans or null (with
                            an optional ``type`` they must be of)
``anyOf``, ``oneOf``        one of the member schemas, which must differ in JSON type (at
                            most one string member, one array member, ...), except
                            objects: several object members need a property that each
                            fixes with a distinct ``const`` (a discriminator, e.g.
                            ``"kind": {"const": "card"}``)
``title``,                  annotations, not checked
``description``,
``default``, ``examples``,
``$schema``, ``$comment``
==========================  ================================================================
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping
from datetime import date, datetime, time, timedelta
from typing import Annotated, Any, Literal, Union, get_args, get_origin
from uuid import UUID

import msgspec

from ._events import Violation
from ._exceptions import ToolDefinitionError
from ._tools import _MSGSPEC_ERROR, _lower_first, _MsgspecValidator, _schema_hint

_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$comment"})
_CHOICES = frozenset({"type", "enum", "const", "anyOf", "oneOf"})
#: The keywords that check each JSON type, and what msgspec calls them.
_CHECKS: dict[str, dict[str, str]] = {
    "object": {
        "properties": "",
        "required": "",
        "additionalProperties": "",
        "minProperties": "min_length",
        "maxProperties": "max_length",
    },
    "array": {"items": "", "minItems": "min_length", "maxItems": "max_length"},
    "string": {"minLength": "min_length", "maxLength": "max_length", "pattern": "pattern"},
    "integer": {
        "minimum": "ge",
        "maximum": "le",
        "exclusiveMinimum": "gt",
        "exclusiveMaximum": "lt",
        "multipleOf": "multiple_of",
    },
    "boolean": {},
    "null": {},
}
_CHECKS["number"] = _CHECKS["integer"]
_SCALARS: dict[str, Any] = {
    "string": str,
    "integer": int,
    "number": float,
    "boolean": bool,
    "null": type(None),
}
_FORMATS: dict[str, Any] = {
    "date-time": datetime,
    "date": date,
    "time": time,
    "duration": timedelta,
    "uuid": UUID,
}
#: Every keyword compile_json_schema understands.
SUPPORTED = frozenset(
    _ANNOTATIONS | _CHOICES | {"format"} | {k for checks in _CHECKS.values() for k in checks}
)
_KINDS = ", ".join(_SCALARS | {"object": 0, "array": 0})

# A keeper puts back what the msgspec type leaves out (the undeclared properties of an
# open object): keeper(validated builtins, the JSON as given, path) -> builtins.
_Keeper = Callable[[Any, Any, str], Any]


class _Invalid(Exception):
    """An undeclared property that its ``additionalProperties`` schema refuses."""

    def __init__(self, path: str, text: str) -> None:
        self.path = path
        self.text = text


class JsonSchemaValidator(_MsgspecValidator):
    """A compiled JSON Schema: msgspec checks it; the value is the JSON, as builtins."""

    __slots__ = ("_keeper",)

    def __init__(self, type_: Any, keeper: _Keeper | None, schema: Mapping[str, Any]) -> None:
        super().__init__(type_)
        self._keeper = keeper
        self._schema = dict(schema)

    @property
    def plain(self) -> bool:
        return False

    @property
    def struct(self) -> None:
        """None: the gate's single-decode path would hand guards a Struct, not the JSON."""
        return None

    def validate_json(self, raw: bytes) -> tuple[Any, tuple[Violation, ...]]:
        value, violations = super().validate_json(raw)
        if violations:
            return None, violations
        args = msgspec.to_builtins(value)
        if self._keeper is None:
            return args, ()
        try:
            return self._keeper(args, msgspec.json.decode(raw), "args"), ()
        except _Invalid as exc:
            hint = _schema_hint(exc.text, exc.path, self.json_schema())
            message = f"{exc.path}: {_lower_first(exc.text)}"
            return None, (Violation("schema", exc.path, message, hint),)

    def to_builtins(self, args: Any) -> dict[str, Any]:
        builtins: dict[str, Any] = args
        return builtins

    def from_builtins(self, args: dict[str, Any]) -> Any:
        return args


def compile_json_schema(schema: Mapping[str, Any], tool: str) -> JsonSchemaValidator:
    """Compile a JSON Schema for ``tool``'s args (see the module's table of keywords).

    Raises:
      ToolDefinitionError: for a keyword outside the subset, or one that does not apply
        where it is, naming the keyword and its place (``args.items[]``).
    """
    if schema.get("type") != "object":
        raise ToolDefinitionError(
            f"tool {tool!r}: JSON Schema at args needs 'type': 'object' (args are a JSON "
            f"object); got {schema.get('type')!r}"
        )
    type_, keeper = _Compiler(tool).compile(schema, "args")
    try:
        return JsonSchemaValidator(type_, keeper, schema)
    except TypeError as exc:  # pragma: no cover - each part was checked as it was built
        raise ToolDefinitionError(f"tool {tool!r}: JSON Schema cannot be compiled: {exc}") from exc


class _Compiler:
    def __init__(self, tool: str) -> None:
        self.tool = tool
        self.structs = 0

    def fail(self, where: str, problem: str) -> ToolDefinitionError:
        return ToolDefinitionError(f"tool {self.tool!r}: JSON Schema at {where}: {problem}")

    def compile(self, schema: Any, where: str) -> tuple[Any, _Keeper | None]:
        """The msgspec type of ``schema`` at ``where``, and its keeper (None if it keeps all)."""
        if not isinstance(schema, Mapping):
            raise self.fail(where, f"a schema must be an object; got {schema!r}")
        for keyword in schema:
            if keyword not in SUPPORTED:
                raise ToolDefinitionError(
                    f"tool {self.tool!r}: JSON Schema keyword {keyword!r} at {where} is not "
                    f"supported; use {', '.join(sorted(SUPPORTED))}, or a msgspec Struct"
                )
        kinds = self.kinds(schema, where)
        choices = [k for k in ("enum", "const", "anyOf", "oneOf") if k in schema]
        if len(choices) > 1:
            raise self.fail(where, f"{choices[0]!r} and {choices[1]!r} cannot be combined")
        if choices:
            return self.choice(schema, choices[0], kinds, where)
        if not kinds:
            checks = [k for k in schema if k not in _ANNOTATIONS]
            if checks:
                raise self.fail(where, f"{checks[0]!r} needs a 'type' it applies to")
            return Any, None
        for keyword in schema:
            if keyword in _ANNOTATIONS or keyword == "type":
                continue
            if not any(
                keyword in _CHECKS[k] or (keyword, k) == ("format", "string") for k in kinds
            ):
                raise self.fail(where, f"{keyword!r} does not apply to type {' or '.join(kinds)}")
        return self.union([self.kind(schema, kind, where) for kind in kinds], where)

    def kinds(self, schema: Mapping[str, Any], where: str) -> list[str]:
        """The JSON types ``schema`` names (none if it has no 'type')."""
        kinds = schema.get("type", [])
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not (
            isinstance(kinds, list)
            and all(k in _CHECKS for k in kinds)
            and len(set(kinds)) == len(kinds)
            and (kinds or "type" not in schema)
        ):
            raise self.fail(
                where,
                f"'type' must be one of {_KINDS}, or a list of distinct ones; got {schema['type']!r}",
            )
        return kinds

    def kind(self, schema: Mapping[str, Any], kind: str, where: str) -> tuple[Any, _Keeper | None]:
        """The member of a ``type`` (list) for one JSON type."""
        if kind == "object":
            return self.object(schema, where)
        checks = {k: name for k, name in _CHECKS[kind].items() if name and k in schema}
        keeper = None
        if kind == "array":
            items = schema.get("items")
            item, item_keeper = (Any, None) if items is None else self.compile(items, where + "[]")
            type_: Any = list[item]  # type: ignore[valid-type]
            keeper = None if item_keeper is None else _each_item(item_keeper)
        elif kind == "string" and "format" in schema:
            type_ = _FORMATS.get(schema["format"])
            if type_ is None:
                raise self.fail(
                    where,
                    f"format {schema['format']!r} is not checked; checked formats: "
                    f"{', '.join(_FORMATS)} (or use a 'pattern')",
                )
            if checks:
                raise self.fail(where, f"{next(iter(checks))!r} does not apply to a format")
        else:
            type_ = _SCALARS[kind]
        if not checks:
            return type_, keeper
        try:
            meta = msgspec.Meta(**{name: schema[k] for k, name in checks.items()})
        except (TypeError, ValueError, re.error) as exc:
            raise self.fail(where, f"invalid {'/'.join(checks)}: {exc}") from exc
        return Annotated[type_, meta], keeper

    def object(
        self, schema: Mapping[str, Any], where: str, tag: tuple[str, Any] | None = None
    ) -> tuple[Any, _Keeper | None]:
        properties = schema.get("properties", {})
        required = schema.get("required", [])
        extra = schema.get("additionalProperties", True)
        if not isinstance(properties, Mapping):
            raise self.fail(where, f"'properties' must be an object; got {properties!r}")
        if not (isinstance(required, list) and all(isinstance(n, str) for n in required)):
            raise self.fail(where, f"'required' must be a list of names; got {required!r}")
        missing = [name for name in required if name not in properties]
        if missing:
            raise ToolDefinitionError(
                f"tool {self.tool!r}: required field {missing[0]!r} at {where} has no entry in "
                "'properties'"
            )
        extra_type, extra_keeper = Any, None
        if isinstance(extra, Mapping):
            extra_type, extra_keeper = self.compile(extra, where + ".*")
        elif not isinstance(extra, bool):
            raise self.fail(
                where, f"'additionalProperties' must be true, false or a schema; got {extra!r}"
            )
        bounds = {k: schema[k] for k in ("minProperties", "maxProperties") if k in schema}
        if not properties and tag is None:
            if extra is False:
                return self.struct([], where, forbid=True), None
            mapping: Any = dict[str, extra_type]  # type: ignore[valid-type]
            keeper = None if extra_keeper is None else _each_value(extra_keeper)
            if bounds:
                names = _CHECKS["object"]
                mapping = Annotated[
                    mapping, msgspec.Meta(**{names[k]: v for k, v in bounds.items()})
                ]
            return mapping, keeper
        if bounds:
            raise self.fail(
                where, f"{next(iter(bounds))!r} applies only to an object without 'properties'"
            )
        fields: list[Any] = []
        keepers: dict[str, _Keeper] = {}
        for name, sub in properties.items():
            if tag is not None and name == tag[0]:
                continue  # the discriminator: msgspec reads it as the tag
            type_, keeper = self.compile(sub, f"{where}.{name}")
            if keeper is not None:
                keepers[name] = keeper
            if name in required:
                fields.append((name, type_))
            elif "default" in sub:
                default = sub["default"]
                if isinstance(default, list | dict) and default:
                    default = msgspec.field(default_factory=_copies(default))
                fields.append((name, type_, default))
            else:
                # Absent stays absent (not null, and not journaled as null).
                fields.append((name, type_ | msgspec.UnsetType, msgspec.UNSET))
        struct = self.struct(fields, where, forbid=extra is False, tag=tag)
        if extra is False and not keepers:
            return struct, None
        return struct, _object_keeper(set(properties), keepers, extra, extra_type, extra_keeper)

    def struct(
        self, fields: list[Any], where: str, forbid: bool, tag: tuple[str, Any] | None = None
    ) -> Any:
        self.structs += 1
        fields.sort(key=len)  # required fields first, as defstruct wants
        tagging: dict[str, Any] = {} if tag is None else {"tag_field": tag[0], "tag": tag[1]}
        return msgspec.defstruct(
            f"{self.tool}_{where.replace('.', '_')}_{self.structs}",
            fields,
            forbid_unknown_fields=forbid,
            kw_only=True,
            **tagging,
        )

    def choice(
        self, schema: Mapping[str, Any], keyword: str, kinds: list[str], where: str
    ) -> tuple[Any, _Keeper | None]:
        """``enum`` or ``const`` (with an optional 'type'), ``anyOf`` or ``oneOf``."""
        others = [k for k in schema if k not in _ANNOTATIONS and k not in (keyword, "type")]
        if kinds and keyword in ("anyOf", "oneOf"):
            others.insert(0, "type")
        if others:
            raise self.fail(
                where, f"{keyword!r} cannot be combined with {others[0]!r} (put it in each choice)"
            )
        if keyword in ("enum", "const"):
            values = [schema["const"]] if keyword == "const" else schema["enum"]
            if not isinstance(values, list) or not values:
                raise ToolDefinitionError(f"tool {self.tool!r}: empty enum at {where}")
            for value in values:
                kind = _kind_of(value)
                if kind is None:
                    raise self.fail(
                        where,
                        f"{keyword} value {value!r} is a {type(value).__name__}; only strings, "
                        "integers, booleans and null are supported",
                    )
                if kinds and kind not in kinds and not (kind == "integer" and "number" in kinds):
                    raise self.fail(
                        where, f"{keyword} value {value!r} is not of type {' or '.join(kinds)}"
                    )
            return Literal[tuple(values)], None
        options = schema[keyword]
        if not isinstance(options, list) or not options:
            raise self.fail(where, f"{keyword!r} must be a non-empty list of schemas")
        wheres = [f"{where}.{keyword}[{i}]" for i in range(len(options))]
        objects = [i for i, option in enumerate(options) if _is_object(option)]
        tags: list[tuple[str, Any] | None] = [None] * len(options)
        if len(objects) > 1:
            for i, tag in zip(
                objects,
                self.discriminator([options[i] for i in objects], where, keyword),
                strict=True,
            ):
                tags[i] = tag
        members = [
            self.object(option, at, tag) if tag is not None else self.compile(option, at)
            for option, at, tag in zip(options, wheres, tags, strict=True)
        ]
        return self.union(members, where, keyword, tags)

    def discriminator(
        self, options: list[Mapping[str, Any]], where: str, keyword: str
    ) -> list[tuple[str, Any]]:
        """The property every object choice fixes to a distinct const: (name, value) each."""
        for name in options[0].get("properties", {}):
            values = [_fixed(option.get("properties", {}).get(name)) for option in options]
            if all(v is not None for v in values) and len(set(values)) == len(values):
                return [(name, value) for value in values]
        raise self.fail(
            where,
            f"{keyword!r} has {len(options)} object choices and no property that each fixes to "
            "a distinct string or integer with 'const' (a discriminator, e.g. "
            '"kind": {"const": "card"}); add one',
        )

    def union(
        self,
        members: list[tuple[Any, _Keeper | None]],
        where: str,
        keyword: str = "type",
        tags: list[tuple[str, Any] | None] | None = None,
    ) -> tuple[Any, _Keeper | None]:
        if len(members) == 1:
            return members[0]
        union: Any = Union[tuple(type_ for type_, _ in members)]  # noqa: UP007
        # msgspec picks a union's member by the JSON type it reads (and an object's by
        # its tag); it would take two strings, or an integer that is also a number, as one.
        kinds = [_json_kind(member) for member in get_args(union)]
        for kind in kinds:
            overlap = kinds.count(kind) > 1 and kind not in ("object", "literal")
            if keyword == "oneOf" and kind == "number":
                overlap = overlap or "integer" in kinds  # 5 would match both
            if overlap or (kind == "any" and keyword != "type"):
                raise self.fail(
                    where,
                    f"{keyword!r} has choices that overlap ({kind}); each must read a different "
                    "JSON type (objects may be several, with a discriminator)",
                )
        try:
            msgspec.json.Decoder(union)
        except TypeError as exc:
            raise self.fail(where, f"{keyword!r} cannot be decoded unambiguously: {exc}") from exc
        keepers = [
            (_json_kind(type_), tag, keeper)
            for (type_, keeper), tag in zip(members, tags or [None] * len(members), strict=True)
            if keeper is not None
        ]
        return union, (_union_keeper(keepers) if keepers else None)


def _json_kind(type_: Any) -> str:
    """The JSON type a msgspec type reads: object, array, string, integer, ... or union."""
    if get_origin(type_) is Annotated:
        type_ = get_args(type_)[0]
    origin = get_origin(type_) or type_
    if origin is Union:
        return "union"
    if origin is list:
        return "array"
    if origin is dict or (isinstance(origin, type) and issubclass(origin, msgspec.Struct)):
        return "object"
    if origin is Literal:
        return "literal"
    if type_ is Any:
        return "any"
    kinds = {scalar: kind for kind, scalar in _SCALARS.items()}
    return kinds.get(type_, "string")  # the formats read strings


def _copies(value: Any) -> Callable[[], Any]:
    return lambda: copy.deepcopy(value)


def _kind_of(value: Any) -> str | None:
    """The JSON type of an enum or const value, if one is supported."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return "string" if isinstance(value, str) else None


def _is_object(schema: Any) -> bool:
    return isinstance(schema, Mapping) and (
        schema.get("type") == "object" or ("properties" in schema and "type" not in schema)
    )


def _fixed(schema: Any) -> Any:
    """The one value a property schema allows (``const`` or a one-value ``enum``), else None."""
    if not isinstance(schema, Mapping):
        return None
    values = [schema["const"]] if "const" in schema else schema.get("enum", [None, None])
    value = values[0] if isinstance(values, list) and len(values) == 1 else None
    return value if _kind_of(value) in ("string", "integer") else None


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key) else f"{path}[{key!r}]"


def _each_item(keeper: _Keeper) -> _Keeper:
    def keep(built: list[Any], given: list[Any], path: str) -> list[Any]:
        return [
            keeper(b, g, f"{path}[{i}]") for i, (b, g) in enumerate(zip(built, given, strict=True))
        ]

    return keep


def _each_value(keeper: _Keeper) -> _Keeper:
    def keep(built: dict[str, Any], given: dict[str, Any], path: str) -> dict[str, Any]:
        return {key: keeper(value, given[key], _join(path, key)) for key, value in built.items()}

    return keep


def _object_keeper(
    declared: set[str],
    keepers: dict[str, _Keeper],
    extra: Any,
    extra_type: Any,
    extra_keeper: _Keeper | None,
) -> _Keeper:
    def keep(built: dict[str, Any], given: dict[str, Any], path: str) -> dict[str, Any]:
        for key, value in given.items():
            if key in declared:
                keeper = keepers.get(key)
                if keeper is not None and key in built:
                    built[key] = keeper(built[key], value, _join(path, key))
            elif extra is True:
                built[key] = value
            else:  # a schema for the undeclared properties
                built[key] = _checked(value, extra_type, extra_keeper, _join(path, key))
        return built

    return keep


def _checked(value: Any, type_: Any, keeper: _Keeper | None, path: str) -> Any:
    try:
        built = msgspec.to_builtins(msgspec.convert(value, type_, strict=True))
    except msgspec.ValidationError as exc:
        match = _MSGSPEC_ERROR.match(str(exc))
        assert match is not None
        raise _Invalid(path + (match["path"] or ""), match["msg"]) from None
    return built if keeper is None else keeper(built, value, path)


def _union_keeper(keepers: list[tuple[str, tuple[str, Any] | None, _Keeper]]) -> _Keeper:
    """The keeper of the choice the JSON value took: by its type, and an object's by its tag."""

    def keep(built: Any, given: Any, path: str) -> Any:
        kind = "object" if isinstance(given, dict) else "array" if isinstance(given, list) else ""
        for member_kind, tag, keeper in keepers:
            if member_kind in (kind, "union") and (tag is None or given.get(tag[0]) == tag[1]):
                return keeper(built, given, path)
        return built

    return keep
