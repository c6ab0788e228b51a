"""OpenAI's Chat Completions and Responses APIs, and the servers that speak them.

Both providers offer the state's tools plus ``transition`` as native function tools,
rebuild the conversation from the run (``_wire.exchanges``), journal the exact request and
response bodies, and read the response exactly: the first call's ``arguments`` text goes
to the gate unchanged; an envelope that rules out a proposal (a stop reason without the
call it announces, a refusal, a reply cut at the output limit, text instead of a call)
is a rejection in the API's own words. OpenAI-compatible servers differ in documented
ways; each difference is a flag of a :class:`Profile`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import msgspec

from ..core._events import TokenUsage, Violation
from ..core._exceptions import ConfigurationError, ProviderError, RequestRefused
from ..core._wire import (
    ONE_CALL,
    ONE_TOOL_HINT,
    TRANSITION,
    Exchange,
    cached_closing,
    check_machine,
    clip,
    encoded_tools,
    envelope,
    framing,
    judge_calls,
    memo,
    parts,
    split_move,
    system_text,
    tool_specs,
    with_defect,
)
from ._base import TRACEPARENT, Proposal

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..core._machine import Machine
    from ..core._view import RunView
    from ..core._wire import ToolSpec
    from ._http import Transport

_T = TypeVar("_T")

_encode = msgspec.json.encode


@dataclass(frozen=True)
class Profile:
    """How an OpenAI-compatible server departs from OpenAI's API: one named flag each.

    Attributes:
      name: for messages.
      arguments_as_object: accept a call's ``arguments`` sent as a JSON object instead of
        a string (taken verbatim from the body, never re-serialised). Without it, such a
        call is rejected naming the quirk.
      calls_with_stop: accept tool calls that arrive with ``finish_reason: "stop"``.
      markup_calls: read a call written as text in ``content``
        (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``), as servers do that
        have no tool-call parser for the model's template.
      shared_index: in a stream, parallel calls may share one ``index``; a new call id
        then starts a new call.
      tool_choice: what to send as ``tool_choice`` ("required", "auto"; "" sends none).
      parallel_tool_calls: send ``parallel_tool_calls: false``.
      max_tokens_field: the name of the output-limit field.
      stream_usage: ask for usage in the last stream chunk (``stream_options``).
      null_content: send ``content: null`` beside an assistant turn's ``tool_calls``, as
        OpenAI documents; False sends ``""``, for servers whose request validation
        refuses null there.
      tool_results_as_user: send each tool result (a call's result, or why the call was
        rejected) as a ``user`` message that names the call, instead of a ``tool``
        message: for servers whose chat template drops ``tool`` messages, so the model
        would never see a rejection.
      stream_calls: the server can stream tool calls; False refuses ``stream=True`` (in
        the ``tools`` output) when the provider is made, for servers that cannot.
    """

    name: str
    arguments_as_object: bool = False
    calls_with_stop: bool = False
    markup_calls: bool = False
    shared_index: bool = False
    tool_choice: str = "required"
    parallel_tool_calls: bool = True
    max_tokens_field: str = "max_completion_tokens"
    stream_usage: bool = True
    null_content: bool = True
    tool_results_as_user: bool = False
    stream_calls: bool = True


#: OpenAI itself: the API as documented, nothing tolerated.
OPENAI = Profile("openai")
#: vLLM's OpenAI-compatible server (its tool parsers): calls may arrive with "stop".
VLLM = Profile("vllm", calls_with_stop=True, max_tokens_field="max_tokens")
#: Ollama's /v1 endpoint: arguments may be objects, parallel streamed calls share index 0,
#: calls arrive with "stop".
OLLAMA = Profile(
    "ollama",
    arguments_as_object=True,
    calls_with_stop=True,
    shared_index=True,
    max_tokens_field="max_tokens",
)
#: llama.cpp's server: calls may be left as markup in content, and arrive with "stop".
LLAMA_CPP = Profile(
    "llama.cpp", calls_with_stop=True, markup_calls=True, max_tokens_field="max_tokens"
)
#: llama-cpp-python's server (``python -m llama_cpp.server``, 0.3.x) with
#: ``--chat_format chatml-function-calling``, each flag checked against it (see
#: tests/test_real_model.py): its function-calling handler takes tool_choice "auto" or
#: a named function ("required" fails an assertion: HTTP 500); its request validation
#: refuses ``content: null`` beside tool_calls (HTTP 500); its chat template renders no
#: ``tool`` message (the model would never see a result or a rejection); it cannot
#: stream an automatic tool choice (a 200 with an empty stream); it ignores
#: ``parallel_tool_calls``, ``max_completion_tokens`` and ``stream_options``.
LLAMA_CPP_PYTHON = Profile(
    "llama-cpp-python",
    tool_choice="auto",
    parallel_tool_calls=False,
    max_tokens_field="max_tokens",
    stream_usage=False,
    null_content=False,
    tool_results_as_user=True,
    stream_calls=False,
)
#: Any other OpenAI-compatible server: every documented quirk tolerated.
GENERIC = Profile(
    "generic",
    arguments_as_object=True,
    calls_with_stop=True,
    markup_calls=True,
    shared_index=True,
    max_tokens_field="max_tokens",
)
PROFILES = {p.name: p for p in (OPENAI, VLLM, OLLAMA, LLAMA_CPP, LLAMA_CPP_PYTHON, GENERIC)}


# -- the response, as msgspec reads it ------------------------------------------------------


class _Function(msgspec.Struct):
    name: str = ""
    arguments: msgspec.Raw = msgspec.Raw(b'""')


class _ToolCall(msgspec.Struct):
    function: _Function
    id: str = ""


class _Message(msgspec.Struct):
    content: str | None = None
    tool_calls: list[_ToolCall] | None = None
    refusal: str | None = None


class _Choice(msgspec.Struct):
    message: _Message
    finish_reason: str | None = None


class _PromptDetails(msgspec.Struct):
    cached_tokens: int | None = 0


class _CompletionDetails(msgspec.Struct):
    reasoning_tokens: int | None = 0


class _ChatUsage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _PromptDetails | None = None
    completion_tokens_details: _CompletionDetails | None = None


class _Completion(msgspec.Struct):
    choices: list[_Choice]
    usage: _ChatUsage | None = None


_read_completion = msgspec.json.Decoder(_Completion).decode
_MARKUP = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


class _MarkupCall(msgspec.Struct):
    name: str
    arguments: msgspec.Raw = msgspec.Raw(b"{}")


_read_markup = msgspec.json.Decoder(_MarkupCall).decode


def _usage(usage: _ChatUsage | None) -> TokenUsage:
    if usage is None:
        return TokenUsage()
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    reasoning = (
        usage.completion_tokens_details.reasoning_tokens if usage.completion_tokens_details else 0
    )
    return TokenUsage(
        max(usage.prompt_tokens, 0),
        max(usage.completion_tokens, 0),
        max(cached or 0, 0),
        max(reasoning or 0, 0),
    )


# -- the shared machinery of an HTTP provider -------------------------------------------------


class HttpProvider:
    """What the OpenAI and Anthropic providers share: the key, the transport, the options."""

    api = ""
    path = ""
    key_variable = ""
    #: ``gen_ai.provider.name`` in traces (OpenTelemetry's GenAI conventions).
    gen_ai_provider = ""
    default_base_url = ""

    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float = 60.0,
        max_in_flight: int = 64,
        tokens_per_minute: int | None = None,
        max_tokens: int | None = 1024,
        temperature: float | None = None,
        transition_tool: str = TRANSITION,
        strict: bool = False,
        stream: bool = False,
        headers: dict[str, str] | None = None,
        run_header: str | None = None,
        transport: Transport | None = None,
    ) -> None:
        if not isinstance(model, str) or not model:
            raise ConfigurationError(
                f"{type(self).__name__}: model must be a model name, got {model!r}"
            )
        self.model = model
        self.base_url = (base_url or self.default_base_url).rstrip("/")
        if urlsplit(self.base_url).scheme not in ("http", "https"):
            # NOTE: checked here, not when the transport is made at the first call: there
            # every call of every run would fail, be retried, and escalate
            example = "https://host/v1" if "://" in self.base_url else f"http://{self.base_url}"
            raise ConfigurationError(
                f"{type(self).__name__}: base_url {base_url!r} does not start with http:// "
                f"or https://; pass the whole URL, e.g. {example!r}"
            )
        key = api_key if api_key is not None else os.environ.get(self.key_variable)
        if not key and self.base_url == self.default_base_url:
            raise ConfigurationError(
                f"{type(self).__name__} needs an API key for {self.base_url}: pass api_key= "
                f"or set {self.key_variable}"
            )
        self._key = key or ""
        self.timeout = timeout
        self.max_in_flight = max_in_flight
        self.tokens_per_minute = tokens_per_minute
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.transition = transition_tool
        self.strict = strict
        self.stream = stream
        self._extra_headers = dict(headers or {})
        self.run_header = run_header
        self._transport: Transport | None = transport
        self._own_transport = transport is None
        self._tools: dict[int, tuple[Any, bytes]] = {}
        self._closings: dict[int, tuple[Any, Any, bytes]] = {}
        """Per state's specs: the body's bytes after the conversation (see request_body)."""

    def __repr__(self) -> str:  # never the key
        return f"{type(self).__name__}(model={self.model!r}, base_url={self.base_url!r})"

    def auth_headers(self) -> dict[str, str]:
        raise NotImplementedError

    def transport(self) -> Transport:
        if self._transport is None:
            from ._http import Transport

            self._transport = Transport(
                self.base_url,
                headers={**self.auth_headers(), **self._extra_headers},
                timeout=self.timeout,
                max_in_flight=self.max_in_flight,
                tokens_per_minute=self.tokens_per_minute,
            )
        return self._transport

    async def aclose(self) -> None:
        """Close the connection pool."""
        if self._transport is not None and self._own_transport:
            await self._transport.aclose()
            self._transport = None

    async def __aenter__(self) -> HttpProvider:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def check(self, machine: Machine) -> None:
        """Raise MachineDefinitionError if ``machine`` cannot be offered to this API as tools
        (a schema strict mode cannot take, a tool named like the transition tool)."""
        check_machine(machine, self.transition, self.strict)

    def mode_for(self, view: RunView) -> str:
        """How the model answers in the run's state: ``tools`` (native calls) here."""
        return "tools"

    async def propose(self, view: RunView) -> Proposal:
        mode = self.mode_for(view)
        specs = tool_specs(view, self.transition, self.strict)
        body = self.request_body(view, specs)
        transport = self.transport()
        tokens = len(body) // 4
        headers = {self.run_header: view.run_id} if self.run_header else None
        parent = TRACEPARENT.get()
        if parent:  # tracing on: the server's spans join the run's trace
            headers = {**(headers or {}), "traceparent": parent}
        try:
            if self.stream:
                text, parsed = await self._streamed(transport, body, tokens, headers, mode)
            else:
                response = await transport.post(self.path, body, headers=headers, tokens=tokens)
                text = response.body.decode("utf-8", "replace")
                parsed = self.read(response.body, mode)
        except ProviderError as exc:
            refused = self.refusal(exc, body)
            if refused is None:
                raise
            raise refused from exc
        raw, usage, violation, extra = parsed
        if violation is None and getattr(
            view.definition.states.get(view.state), "call_and_move", False
        ):
            raw = split_move(raw)  # a call that names its move: the move out of its args
        return Proposal(
            raw,
            usage,
            self.model,
            body.decode("utf-8"),
            response=text,
            envelope=violation,
            extra_calls=extra,
        )

    async def _streamed(
        self,
        transport: Transport,
        body: bytes,
        tokens: int,
        headers: dict[str, str] | None,
        mode: str = "tools",
    ) -> tuple[str, tuple[str, TokenUsage, Violation | None, tuple[tuple[str, str], ...]]]:
        data: list[str] = []
        async with transport.stream(self.path, body, headers=headers, tokens=tokens) as events:
            async for event in events:
                data.append(f"{event.event}\n{event.data}" if event.event else event.data)
        return "\n\n".join(data), self.read_stream(data, mode)

    def request_body(self, view: RunView, specs: tuple[ToolSpec, ...]) -> bytes:
        raise NotImplementedError

    def refusal(self, exc: ProviderError, body: bytes) -> RequestRefused | None:
        """The failure ``exc`` of the request ``body`` as a refusal of the request's shape
        that names the flag to fix it, or None to let ``exc`` go as it is."""
        return None

    def read(
        self, body: bytes, mode: str = "tools"
    ) -> tuple[str, TokenUsage, Violation | None, tuple[tuple[str, str], ...]]:
        raise NotImplementedError

    def read_stream(
        self, data: list[str], mode: str = "tools"
    ) -> tuple[str, TokenUsage, Violation | None, tuple[tuple[str, str], ...]]:
        raise NotImplementedError

    def _decoded(self, decode: Callable[[Any], _T], body: bytes | str) -> _T:
        """``decode(body)``; a body that is not the API's shape is a retryable
        ProviderError quoting its start (a model's answer is never guessed at)."""
        try:
            return decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raw = body.encode() if isinstance(body, str) else body
            raise self._bad_body(exc, raw) from None

    def _bad_body(self, exc: Exception, body: bytes) -> ProviderError:
        return ProviderError(
            f"{self.api} at {self.base_url} answered with a body that is not a {self.api} "
            f"response ({exc}); it began {clip(body[:200].decode('utf-8', 'replace'))!r}",
            retryable=True,
        )


class OpenAIChat(HttpProvider):
    """OpenAI Chat Completions (``POST {base_url}/chat/completions``), with native tools.

    Args:
      model: the model name (also the name prices and metrics use).
      base_url: the API root, ``https://api.openai.com/v1`` by default; any
        OpenAI-compatible server's ``/v1`` (vLLM, Ollama, llama.cpp's server), with its
        ``http://`` or ``https://`` (a URL without one is refused here).
      api_key: defaults to ``$OPENAI_API_KEY``; needed only for OpenAI's own URL. Never
        journaled, logged or shown.
      profile: a :class:`Profile` (or its name: openai, vllm, ollama, llama.cpp,
        llama-cpp-python, generic) naming the server's quirks; ``openai`` for OpenAI's
        URL, else ``generic``.
      output: ``"tools"`` (native tool calls) or ``"json_schema"`` (structured output:
        the proposal is the message content, constrained to the proposal's schema).

    Other Parameters:
      timeout (float): the transport's per-call timeout, in seconds.
      max_in_flight (int): the most requests in flight.
      tokens_per_minute (int | None): an optional token rate limit.
      max_tokens (int | None): sent as given (None sends none).
      temperature (float | None): sent as given (None sends none).
      transition_tool (str): the name of the tool that moves the run on.
      strict (bool): send the tools with ``strict: true`` (every schema must allow it;
        checked when the machine is registered).
      stream (bool): use Server-Sent Events; the call is assembled from the deltas.
      headers (dict[str, str] | None): more headers for every request.
      run_header (str | None): send the run's id in this header (e.g. for a gateway that
        routes by run, or the fake server of the offline demo); None sends none.
      transport (Transport | None): the HTTP client to use instead of the built-in one (any
        object with the ``post`` and ``stream`` of
        :class:`interlock.providers._http.Transport`); the provider does not close a
        transport it was given.
    """

    api = "chat completions"
    path = "/chat/completions"
    key_variable = "OPENAI_API_KEY"
    gen_ai_provider = "openai"
    default_base_url = "https://api.openai.com/v1"

    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        profile: Profile | str | None = None,
        output: str | dict[str, str] = "tools",
        **options: Any,
    ) -> None:
        super().__init__(model, base_url=base_url, api_key=api_key, **options)
        if isinstance(profile, str):
            if profile not in PROFILES:
                raise ConfigurationError(
                    f"unknown profile {profile!r}; use one of {', '.join(PROFILES)} or a Profile"
                )
            profile = PROFILES[profile]
        self.profile = profile or (OPENAI if self.base_url == self.default_base_url else GENERIC)
        modes = output.values() if isinstance(output, dict) else (output,)
        for mode in modes:
            if mode not in ("tools", "json_schema"):
                raise ConfigurationError(
                    f"output must be 'tools' or 'json_schema' (or a dict of them by state), "
                    f"got {mode!r}"
                )
        # a state a dict of outputs does not name answers with tools
        calls = isinstance(output, dict) or output == "tools"
        if self.stream and calls and not self.profile.stream_calls:
            raise ConfigurationError(
                f"OpenAIChat: profile {self.profile.name!r} cannot stream tool calls "
                "(stream_calls=False); pass stream=False"
            )
        self.output = output

    def mode_for(self, view: RunView) -> str:
        output = self.output
        return output if isinstance(output, str) else output.get(view.state, "tools")

    def refusal(self, exc: ProviderError, body: bytes) -> RequestRefused | None:
        """A refusal of a request flag the profile sets, with the flag that fixes it:
        ``content: null`` beside tool_calls refused by request validation, or tool_choice
        "required" refused (named by the server, or a 5xx with an empty message, which is
        how llama-cpp-python's function-calling handler answers it)."""
        said = exc.server_message
        # Encoded by msgspec: no spaces, and the same bytes inside a string are escaped
        required = b'"tool_choice":"required"' in body
        if isinstance(exc, RequestRefused):
            words = (said if said is not None else str(exc)).lower()
            if b'"content":null' in body and "content" in words:
                fix = _NULL_CONTENT_FIX
            elif required and "tool_choice" in words:
                fix = _REQUIRED_FIX
            else:
                return None
        elif required and exc.status is not None and exc.status >= 500 and said == "":
            fix = f"{_REQUIRED_FIX} (it answered HTTP {exc.status} with an empty message)"
        else:
            return None
        # NOTE: the fix first: a journaled error is cut at 500 characters, and a
        # validation error's text is often longer
        return RequestRefused(f"{fix}; {exc}", status=exc.status, server_message=said)

    def auth_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self._key}"} if self._key else {}

    def _system(self, view: RunView, mode: str) -> bytes:
        """The body's start up to the system message, kept on the view while its text and
        the model stay."""
        run = view._run
        key = (run.state, run._data_version, mode, self.model)
        cache = memo(view)
        found = cache.get("chat_system")
        if found is None or found[0] != key:  # what system_text's own memo is keyed on
            opening = _encode({"model": self.model})[:-1] + b',"messages":['
            system = _encode({"role": "system", "content": system_text(view, mode)})
            found = cache["chat_system"] = (key, opening + system)
        return found[1]  # type: ignore[no-any-return]

    def _tool(self, spec: ToolSpec) -> dict[str, Any]:
        function: dict[str, Any] = {
            "name": spec.name,
            "description": spec.description,
            "parameters": spec.parameters,
        }
        if self.strict:
            function["strict"] = True
        return {"type": "function", "function": function}

    def request_body(self, view: RunView, specs: tuple[ToolSpec, ...]) -> bytes:
        """The exact body: ``{"model":...,"messages":[system, steps..., next],...rest}``,
        joined once from the parts kept on the view and on the provider."""
        mode = self.mode_for(view)
        options = (
            mode,
            self.model,
            self.profile,
            self.max_tokens,
            self.temperature,
            self.stream,
            self.strict,
            self.transition,
        )
        closing = cached_closing(
            self._closings,
            specs,
            options,
            lambda: (
                b","
                + _NEXT_USER
                + framing({"model": self.model}, "messages", self._rest(specs, mode))[1]
            ),
        )
        key, render = _chat_renderer(self.profile)
        return b"".join([self._system(view, mode), *parts(view, key, render), closing])

    def _rest(self, specs: tuple[ToolSpec, ...], mode: str) -> dict[str, Any]:
        """The body's fields after the messages."""
        profile = self.profile
        body: dict[str, Any] = {}
        if mode == "tools":
            body["tools"] = msgspec.Raw(encoded_tools(self._tools, specs, self._tool))
            if profile.tool_choice:
                body["tool_choice"] = profile.tool_choice
            if profile.parallel_tool_calls:
                body["parallel_tool_calls"] = False
        else:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {
                    "name": "proposal",
                    "strict": self.strict,
                    "schema": _proposal_schema(specs, self.transition),
                },
            }
        if self.max_tokens is not None:
            body[profile.max_tokens_field] = self.max_tokens
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.stream:
            body["stream"] = True
            if profile.stream_usage:
                body["stream_options"] = {"include_usage": True}
        return body

    def read(
        self, body: bytes, mode: str = "tools"
    ) -> tuple[str, TokenUsage, Violation | None, tuple[tuple[str, str], ...]]:
        completion = self._decoded(_read_completion, body)
        usage = _usage(completion.usage)
        if not completion.choices:
            return "", usage, envelope("the reply has no choices", ONE_TOOL_HINT), ()
        choice = completion.choices[0]
        calls: list[tuple[str, str]] = []
        for call in choice.message.tool_calls or ():
            arguments = bytes(call.function.arguments)
            if arguments[:1] == b'"':
                calls.append((call.function.name, msgspec.json.decode(arguments, type=str)))
            elif self.profile.arguments_as_object:
                calls.append((call.function.name, arguments.decode("utf-8", "replace")))
            else:
                violation = envelope(
                    f"the call of {call.function.name!r} sent arguments as "
                    f"{_kind(arguments)}, not the JSON string the API specifies: "
                    f"{clip(arguments.decode('utf-8', 'replace'))}",
                    "send arguments as a JSON string; for a server that sends objects, use "
                    "profile='generic' (or a Profile with arguments_as_object=True)",
                )
                return "", usage, violation, ()
        return self._judge(
            choice.message.content, choice.message.refusal, choice.finish_reason, calls, usage, mode
        )

    def _judge(
        self,
        content: str | None,
        refusal: str | None,
        finish: str | None,
        calls: list[tuple[str, str]],
        usage: TokenUsage,
        mode: str = "tools",
    ) -> tuple[str, TokenUsage, Violation | None, tuple[tuple[str, str], ...]]:
        profile = self.profile
        text = content or ""
        if mode == "json_schema":
            if refusal:
                return "", usage, envelope(f"the model refused: {clip(refusal)}", ONE_TOOL_HINT), ()
            if finish == "length":
                return "", usage, _cut(finish, text), ()
            return text, usage, None, ()
        if not calls and text and profile.markup_calls:
            calls = _markup(text)
            if calls:
                text = _MARKUP.sub("", text)
        if refusal:
            return "", usage, envelope(f"the model refused: {clip(refusal)}", ONE_TOOL_HINT), ()
        if finish == "length":
            return "", usage, _cut(finish), ()
        if finish == "content_filter":
            return (
                "",
                usage,
                envelope(
                    "the reply was stopped by the content filter (finish_reason 'content_filter')",
                    ONE_TOOL_HINT,
                ),
                (),
            )
        announced = (
            "finish_reason is 'tool_calls' but the reply holds no tool call"
            if finish == "tool_calls"
            else None
        )
        mismatch = None
        if finish not in ("tool_calls", None) and not (
            finish == "stop" and profile.calls_with_stop
        ):
            mismatch = (
                f"the reply holds a tool call but finish_reason is {finish!r}, not 'tool_calls'",
                f"{ONE_TOOL_HINT}; for a server that does this, use profile='generic'",
            )
        return judge_calls(
            calls, text, usage, self.transition, announced=announced, mismatch=mismatch
        )

    def read_stream(
        self, data: list[str], mode: str = "tools"
    ) -> tuple[str, TokenUsage, Violation | None, tuple[tuple[str, str], ...]]:
        calls: list[list[str]] = []  # [id, name, arguments]
        by_index: dict[int, int] = {}
        content: list[str] = []
        refusal: list[str] = []
        finish: str | None = None
        usage = TokenUsage()
        done = False
        for item in data:
            if item == "[DONE]":
                done = True
                break
            chunk = self._decoded(msgspec.json.decode, item)
            if not isinstance(chunk, dict):
                continue
            if isinstance(chunk.get("usage"), dict):
                usage = _usage(msgspec.convert(chunk["usage"], _ChatUsage))
            for choice in chunk.get("choices") or ():
                if not isinstance(choice, dict):
                    continue
                finish = choice.get("finish_reason") or finish
                delta = choice.get("delta") or {}
                if isinstance(delta.get("content"), str):
                    content.append(delta["content"])
                if isinstance(delta.get("refusal"), str):
                    refusal.append(delta["refusal"])
                for call in delta.get("tool_calls") or ():
                    if not isinstance(call, dict):
                        continue
                    index = call.get("index", 0)
                    fn = call.get("function") or {}
                    cid = call.get("id") or ""
                    at = by_index.get(index)
                    if at is None or (self.profile.shared_index and cid and cid != calls[at][0]):
                        at = by_index[index] = len(calls)
                        calls.append([cid, "", ""])
                    entry = calls[at]
                    if isinstance(fn.get("name"), str):
                        entry[1] += fn["name"]
                    arguments = fn.get("arguments")
                    if isinstance(arguments, str):
                        entry[2] += arguments
                    elif arguments is not None and self.profile.arguments_as_object:
                        entry[2] += _encode(arguments).decode()
        if not done:
            raise ProviderError(
                f"{self.api} at {self.base_url}: the stream ended before [DONE]", retryable=True
            )
        return self._judge(
            "".join(content) or None,
            "".join(refusal) or None,
            finish,
            [(name, arguments) for _id, name, arguments in calls],
            usage,
            mode,
        )


_REQUIRED_FIX = (
    "tool_choice \"required\" refused by the server; use profile='llama-cpp-python' "
    'or a Profile(tool_choice="auto")'
)
_NULL_CONTENT_FIX = (
    "content null beside an assistant turn's tool_calls refused by the server; use "
    "profile='llama-cpp-python' or a Profile(null_content=False)"
)
_NEXT_USER = _encode({"role": "user", "content": "Make the next call."})
_NEXT_ITEM = _encode({"type": "message", "role": "user", "content": "Make the next call."})


def _chat_step(step: Exchange, null_content: bool = True, as_user: bool = False) -> bytes:
    """One step of the conversation as Chat messages (joined, no brackets).

    ``null_content`` and ``as_user`` are the profile's flags of the same names (``as_user``:
    ``tool_results_as_user``)."""
    if step.call is None:
        return _encode({"role": "user", "content": step.reply})
    calls = [step.call, *step.extra]
    results = [(step.call, ("error: " if step.error else "") + step.reply)]
    results.extend((call, f"error: {ONE_CALL}") for call in step.extra)
    messages: list[dict[str, Any]] = [
        {
            "role": "assistant",
            "content": None if null_content else "",
            "tool_calls": [
                {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                for cid, name, args in calls
            ],
        }
    ]
    if as_user:
        messages.extend(
            {"role": "user", "content": f"result of {name} ({cid}): {text}"}
            for (cid, name, _args), text in results
        )
    else:
        messages.extend(
            {"role": "tool", "tool_call_id": cid, "content": text}
            for (cid, _name, _args), text in results
        )
    return _encode(messages)[1:-1]


def _chat_renderer(profile: Profile) -> tuple[str, Callable[[Exchange], bytes]]:
    """The memo key and the step renderer for ``profile``'s conversation flags."""
    flags = (profile.null_content, profile.tool_results_as_user)
    if flags == (True, False):
        return "chat", _chat_step
    found = _CHAT_RENDERERS.get(flags)
    if found is None:
        null_content, as_user = flags
        found = _CHAT_RENDERERS[flags] = (
            f"chat:{int(null_content)}{int(as_user)}",
            lambda step: _chat_step(step, null_content, as_user),
        )
    return found


_CHAT_RENDERERS: dict[tuple[bool, bool], tuple[str, Callable[[Exchange], bytes]]] = {}


def _responses_step(step: Exchange) -> bytes:
    """One step of the conversation as Responses input items (joined, no brackets)."""
    if step.call is None:
        return _encode({"type": "message", "role": "user", "content": step.reply})
    items: list[dict[str, Any]] = [
        {"type": "function_call", "call_id": cid, "name": name, "arguments": args}
        for cid, name, args in [step.call, *step.extra]
    ]
    items.append(
        {
            "type": "function_call_output",
            "call_id": step.call[0],
            "output": ("error: " if step.error else "") + step.reply,
        }
    )
    items.extend(
        {"type": "function_call_output", "call_id": cid, "output": f"error: {ONE_CALL}"}
        for cid, _name, _args in step.extra
    )
    return _encode(items)[1:-1]


def _kind(arguments: bytes) -> str:
    first = arguments[:1]
    return {b"{": "an object", b"[": "an array", b"n": "null"}.get(first, "a bare value")


def _cut(finish: str, text: str = "") -> Violation:
    """A reply cut at the output limit; ``text``: a structured-output answer, whose JSON
    defect (what and where) the message names."""
    return envelope(
        with_defect(
            f"the reply was cut at the output limit (finish_reason {finish!r}) before it was whole",
            text,
        ),
        "make the call shorter, or raise max_tokens",
    )


def _markup(text: str) -> list[tuple[str, str]]:
    calls = []
    for match in _MARKUP.finditer(text):
        try:
            call = _read_markup(match.group(1))
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        arguments = bytes(call.arguments)
        if arguments[:1] == b'"':
            calls.append((call.name, msgspec.json.decode(arguments, type=str)))
        else:
            calls.append((call.name, arguments.decode("utf-8", "replace")))
    return calls


def _proposal_schema(specs: tuple[ToolSpec, ...], transition: str) -> dict[str, Any]:
    """The JSON Schema of a proposal in the state: one of its tool calls, or a move."""
    choices: list[dict[str, Any]] = []
    for spec in specs:
        if spec.name == transition:
            choices.append(spec.parameters)
        else:
            choices.append(
                {
                    "type": "object",
                    "properties": {
                        "tool": {"type": "string", "enum": [spec.name]},
                        "args": spec.parameters,
                    },
                    "required": ["tool", "args"],
                    "additionalProperties": False,
                }
            )
    return {"anyOf": choices} if len(choices) != 1 else choices[0]


# -- the Responses API ------------------------------------------------------------------------


class _OutputContent(msgspec.Struct):
    type: str = ""
    text: str | None = None
    refusal: str | None = None


class _OutputItem(msgspec.Struct):
    type: str = ""
    name: str = ""
    call_id: str = ""
    arguments: msgspec.Raw = msgspec.Raw(b'""')
    content: list[_OutputContent] | None = None


class _InputDetails(msgspec.Struct):
    cached_tokens: int | None = 0


class _OutputDetails(msgspec.Struct):
    reasoning_tokens: int | None = 0


class _ResponsesUsage(msgspec.Struct):
    input_tokens: int = 0
    output_tokens: int = 0
    input_tokens_details: _InputDetails | None = None
    output_tokens_details: _OutputDetails | None = None


class _IncompleteDetails(msgspec.Struct):
    reason: str | None = None


class _Response(msgspec.Struct):
    output: list[_OutputItem]
    status: str | None = None
    usage: _ResponsesUsage | None = None
    incomplete_details: _IncompleteDetails | None = None


_read_response = msgspec.json.Decoder(_Response).decode


class _Completed(msgspec.Struct):
    response: _Response


_read_completed = msgspec.json.Decoder(_Completed).decode


def _responses_usage(usage: _ResponsesUsage | None) -> TokenUsage:
    if usage is None:
        return TokenUsage()
    cached = usage.input_tokens_details.cached_tokens if usage.input_tokens_details else 0
    reasoning = usage.output_tokens_details.reasoning_tokens if usage.output_tokens_details else 0
    return TokenUsage(
        max(usage.input_tokens, 0),
        max(usage.output_tokens, 0),
        max(cached or 0, 0),
        max(reasoning or 0, 0),
    )


class OpenAIResponses(HttpProvider):
    """OpenAI's Responses API (``POST {base_url}/responses``): ``function_call`` items
    with ``call_id``, answered with ``function_call_output`` items.

    Takes the options of :class:`OpenAIChat` but ``profile`` and ``output``; requests are
    sent with ``store: false`` (the conversation is rebuilt from the run each call).
    """

    api = "responses"
    path = "/responses"
    key_variable = "OPENAI_API_KEY"
    gen_ai_provider = "openai"
    default_base_url = "https://api.openai.com/v1"

    def auth_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self._key}"} if self._key else {}

    def _opening(self, view: RunView) -> bytes:
        """The body's start up to the input items, kept on the view while the
        instructions and the model stay."""
        text = system_text(view)
        cache = memo(view)
        found = cache.get("responses_head")
        if found is None or found[0] is not text or found[1] != self.model:
            opening = framing({"model": self.model, "instructions": text}, "input", {})[0]
            found = cache["responses_head"] = (text, self.model, opening)
        return found[2]  # type: ignore[no-any-return]

    def _tool(self, spec: ToolSpec) -> dict[str, Any]:
        return {
            "type": "function",
            "name": spec.name,
            "description": spec.description,
            "parameters": spec.parameters,
            "strict": self.strict,
        }

    def request_body(self, view: RunView, specs: tuple[ToolSpec, ...]) -> bytes:
        """The exact body: ``{"model":...,"instructions":...,"input":[steps..., next],
        ...rest}``, joined once from the parts kept on the view and on the provider."""
        options = (self.model, self.max_tokens, self.temperature, self.stream, self.strict)
        closing = cached_closing(
            self._closings,
            specs,
            options,
            lambda: _NEXT_ITEM + framing({"model": self.model}, "input", self._rest(specs))[1],
        )
        steps = parts(view, "responses", _responses_step)
        if not steps:
            return self._opening(view) + closing
        steps[0] = steps[0][1:]  # the first item has no comma before it
        return b"".join([self._opening(view), *steps, b",", closing])

    def _rest(self, specs: tuple[ToolSpec, ...]) -> dict[str, Any]:
        """The body's fields after the input items."""
        body: dict[str, Any] = {
            "tools": msgspec.Raw(encoded_tools(self._tools, specs, self._tool)),
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "store": False,
        }
        if self.max_tokens is not None:
            body["max_output_tokens"] = self.max_tokens
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.stream:
            body["stream"] = True
        return body

    def read(
        self, body: bytes, mode: str = "tools"
    ) -> tuple[str, TokenUsage, Violation | None, tuple[tuple[str, str], ...]]:
        response = self._decoded(_read_response, body)
        return self._judge(response)

    def _judge(
        self, response: _Response
    ) -> tuple[str, TokenUsage, Violation | None, tuple[tuple[str, str], ...]]:
        usage = _responses_usage(response.usage)
        calls: list[tuple[str, str]] = []
        texts: list[str] = []
        refusals: list[str] = []
        for item in response.output:
            if item.type == "function_call":
                arguments = bytes(item.arguments)
                if arguments[:1] != b'"':
                    violation = envelope(
                        f"the call of {item.name!r} sent arguments as {_kind(arguments)}, not "
                        "the JSON string the API specifies",
                        "send arguments as a JSON string",
                    )
                    return "", usage, violation, ()
                calls.append((item.name, msgspec.json.decode(arguments, type=str)))
            elif item.type == "message":
                for part in item.content or ():
                    if part.type == "refusal" and part.refusal:
                        refusals.append(part.refusal)
                    elif part.text:
                        texts.append(part.text)
        if refusals:
            return (
                "",
                usage,
                envelope(f"the model refused: {clip(' '.join(refusals))}", ONE_TOOL_HINT),
                (),
            )
        if response.status == "incomplete":
            reason = response.incomplete_details.reason if response.incomplete_details else None
            return (
                "",
                usage,
                envelope(
                    f"the response is incomplete ({reason or 'no reason given'}) before it was whole",
                    "make the call shorter, or raise max_tokens",
                ),
                (),
            )
        return judge_calls(calls, "".join(texts), usage, self.transition)

    def read_stream(
        self, data: list[str], mode: str = "tools"
    ) -> tuple[str, TokenUsage, Violation | None, tuple[tuple[str, str], ...]]:
        # The last event, response.completed (or .incomplete), holds the whole response.
        for item in reversed(data):
            event, _, payload = item.partition("\n") if "\n" in item else ("", "", item)
            if event in ("response.completed", "response.incomplete", "response.failed"):
                response = self._decoded(_read_completed, payload).response
                return self._judge(response)
        raise ProviderError(
            f"{self.api} at {self.base_url}: the stream ended before response.completed",
            retryable=True,
        )
