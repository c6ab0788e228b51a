"""The transport's HTTP/1.1 response parser against h11's, on generated responses.

The transport reads responses itself (h11 cost most of a loopback exchange's CPU); h11, kept as
a test dependency, is the oracle: any response h11 reads, split anywhere across reads, gives
the same status, headers and body here, and any h11 refuses is refused here too (as a
retryable ProviderError, never another exception).
"""

from __future__ import annotations

import itertools
from typing import Any

import h11
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from interlock import ProviderError
from interlock.providers._http import _UNTIL_CLOSE, Transport, _Connection


class Pieces:
    """A stream that hands out the given byte pieces, then the end."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = list(pieces)

    async def receive_some(self, size: int) -> bytes:
        await trio.lowlevel.checkpoint()
        return self.pieces.pop(0) if self.pieces else b""


async def parse(data: bytes, cuts: list[int]) -> tuple[int, dict[str, str], bytes, bool]:
    """Status, headers, body and keep-alive, as the transport reads ``data`` cut at ``cuts``."""
    bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    pieces = [data[a:b] for a, b in itertools.pairwise(bounds)]
    transport = Transport("http://127.0.0.1:9")
    connection = _Connection(None, Pieces(pieces))  # type: ignore[arg-type]
    status, headers, length, reuse = await transport._response_head(connection, "/x", fresh=False)
    body = b"".join([piece async for piece in transport._body(connection, "/x", length)])
    if connection.buffer:
        reuse = False  # bytes past the response: the connection is not kept
    return status, headers, body, reuse and length != _UNTIL_CLOSE


def h11_parse(data: bytes) -> tuple[int, dict[str, str], bytes]:
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/x", headers=[("host", "a")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(data)
    conn.receive_data(b"")
    headers: dict[str, str] = {}
    body = b""
    status = 0
    while True:
        event = conn.next_event()
        if type(event) is h11.Response:
            status = event.status_code
            for name, value in event.headers:
                key, text = name.decode("latin-1"), value.decode("latin-1")
                headers[key] = f"{headers[key]}, {text}" if key in headers else text
        elif type(event) is h11.Data:
            body += event.data
        elif type(event) is h11.EndOfMessage:
            break
        elif event is h11.NEED_DATA or type(event) is h11.ConnectionClosed:
            raise h11.RemoteProtocolError("incomplete")
    return status, headers, body


names = st.sampled_from(["content-type", "x-request-id", "server", "date", "x-a", "Set-Cookie"])
values = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=20)


@st.composite
def responses(draw: Any) -> tuple[bytes, bool]:
    """A response h11 reads, and whether its connection may be kept for the next request."""
    status = draw(st.sampled_from([200, 201, 204, 400, 401, 404, 429, 500, 503, 529]))
    version = draw(st.sampled_from([b"1.1", b"1.1", b"1.0"]))
    reason = draw(st.sampled_from([b" OK", b" Whatever Reason", b" ", b""]))
    fields = [(draw(names), draw(values)) for _ in range(draw(st.integers(0, 4)))]
    keep = version == b"1.1"
    body = draw(st.binary(max_size=300)) if status != 204 else b""
    framing = draw(st.sampled_from(["length", "chunked", "close"]))
    if draw(st.booleans()):
        option = draw(st.sampled_from(["close", "keep-alive", "Close"]))
        fields.append(("connection", option))
        keep = keep and option.lower() != "close"
    if status == 204:
        framing = "none"
    if framing == "length":
        fields.append(("Content-Length", str(len(body))))
        encoded = body
    elif framing == "chunked":
        fields.append(("Transfer-Encoding", "chunked"))
        encoded = b""
        at = 0
        while at < len(body):
            size = draw(st.integers(1, 120))
            piece = body[at : at + size]
            ext = draw(st.sampled_from([b"", b";name=value"]))
            encoded += b"%x%b\r\n%b\r\n" % (len(piece), ext, piece)
            at += size
        trailer = draw(st.sampled_from([b"", b"x-trailer: 1\r\n"]))
        encoded += b"0\r\n" + trailer + b"\r\n"
    else:
        encoded = body
        keep = keep and framing == "none"
    eol = draw(st.sampled_from([b"\r\n", b"\r\n", b"\n"]))
    head = b"HTTP/" + version + b" %d" % status + reason + eol
    head += b"".join(f"{n}: {v}".encode() + eol for n, v in fields)
    return head + eol + encoded, keep


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(responses(), st.lists(st.integers(0, 2000), max_size=6))
def test_each_response_reads_as_h11_reads_it(response: tuple[bytes, bool], cuts: list[int]) -> None:
    data, keep = response
    status, headers, body, reuse = trio.run(parse, data, cuts)
    assert (status, headers, body) == h11_parse(data)
    assert reuse == keep


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        st.binary(max_size=200),
        responses().map(lambda r: r[0][: len(r[0]) // 2]),  # cut short
        st.builds(
            lambda head, tail: head + tail,
            st.sampled_from(
                [b"HTTP/1.1 200 OK\r\n", b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"]
            ),
            st.binary(max_size=100),
        ),
    ),
    st.lists(st.integers(0, 400), max_size=4),
)
def test_what_h11_refuses_is_refused_as_a_provider_error(data: bytes, cuts: list[int]) -> None:
    try:
        expected: Any = h11_parse(data)
    except h11.RemoteProtocolError:
        expected = None
    refused: ProviderError | None = None
    try:
        got: Any = trio.run(parse, data, cuts)[:3]
    except ProviderError as exc:
        refused, got = exc, None
    if refused is not None:
        assert refused.retryable
        assert str(refused).startswith("POST /x to 127.0.0.1:9: ")
    if expected is not None and got is not None:
        assert got == expected
    elif expected is not None:
        pytest.fail(f"h11 reads {data!r} as {expected!r}; the transport refused it")
    elif got is not None:
        pytest.fail(f"h11 refuses {data!r}; the transport read it as {got!r}")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            b"SSH-2.0-OpenSSH_9.2\r\n\r\n",
            "a status line b'SSH-2.0-OpenSSH_9.2' that is not HTTP/1.x",
        ),
        (
            b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
            "a header line b'no colon here' that is not 'name: value'",
        ),
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: 3, 4\r\n\r\nabc",
            "a content-length of '3, 4', not one number of bytes",
        ),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n",
            "transfer-encoding 'gzip': only 'chunked' is understood (the transport asks for identity)",
        ),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
            "a chunk-size line b'zz' that is not hexadecimal",
        ),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nabc\r\n0\r\n\r\n",
            "a chunk longer than its size says",
        ),
    ],
)
def test_each_refusal_says_what_was_wrong(data: bytes, message: str) -> None:
    with pytest.raises(ProviderError) as excinfo:
        trio.run(parse, data, [])
    assert str(excinfo.value) == (
        f"POST /x to 127.0.0.1:9: sent a response that is not valid HTTP/1.1 ({message})"
    )


@pytest.mark.parametrize(
    "data",
    [
        # a bare-LF blank line before the first CRLF CRLF: the head ends there
        b"HTTP/1.1 200 OK\r\nx-a: 1\n\r\nbody\r\n\r\nmore",
        b"HTTP/1.1 200 OK\nx-a: 1\n\nbody\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nx-a: 1\r\n\nbody\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nx-a: 1\ncontent-length: 4\r\n\r\nbody",
        # CRLF line ends only: the first CRLF CRLF
        b"HTTP/1.1 200 OK\r\nx-a: 1\r\ncontent-length: 4\r\n\r\nbody",
    ],
)
def test_the_head_ends_at_its_first_blank_line_whatever_its_line_ends(data: bytes) -> None:
    for cuts in ([], [5], [17, 18, 19, 20, 21]):
        assert trio.run(parse, data, cuts)[:3] == h11_parse(data)


@pytest.mark.parametrize(
    ("length", "framing"),
    [("12", 12), ("0012", 12), ("0", 0), ("12, 12", 12), ("12 ,12", 12)],
)
def test_a_content_length_reads_as_one_number(length: str, framing: int) -> None:
    from interlock.providers._http import _framing

    assert _framing(200, {"content-length": length}) == framing


@pytest.mark.parametrize("length", ["\u0661\u0662", "1" * 16, "12, 13", "-1", "1e3", ""])
def test_a_content_length_that_is_not_one_ascii_number_is_refused(length: str) -> None:
    from interlock.providers._http import _BadHttp, _framing

    with pytest.raises(_BadHttp, match="content-length"):
        _framing(200, {"content-length": length})
