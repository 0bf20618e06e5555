"""Every refusal the server answers is an OpenAI error object with a real `code`, checked with
raw sockets against a live uvicorn on 127.0.0.1: oversized and malformed request heads (which
the HTTP layer sees before the app), unknown routes and methods, and bodies that break a
documented limit. After each one the server still serves."""

from __future__ import annotations

import json
import socket
import time

import pytest

from flashtree.sampling import MAX_STOP_CHARS
from flashtree.server.limits import MAX_HEADER_BYTES
from tests.test_server import live_server, model_pair

MAX_BATCH = 4


@pytest.fixture(scope="module")
def address(tmp_path_factory):
    pair = model_pair(tmp_path_factory.mktemp("limits_models"))
    with live_server(pair, max_batch=MAX_BATCH) as (url, _, _):
        host, port = url.removeprefix("http://").split(":")
        yield host, int(port)


def exchange(address, pieces: list[bytes], pause: float = 0.0) -> tuple[int, dict, bytes]:
    """Send the pieces (pausing between them), read one response: (status, headers, body)."""
    with socket.create_connection(address, timeout=30) as sock:
        for piece in pieces:
            try:
                sock.sendall(piece)
            except (BrokenPipeError, ConnectionResetError):  # refused before the rest was sent
                break
            time.sleep(pause)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536) or b"\0"  # "\0": closed without a head
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict((k.lower(), v.strip()) for k, _, v in (line.partition(":") for line in lines[1:]))
        while len(body) < int(headers.get("content-length", 0)):
            body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, body


def request(method: str, path: str, body: bytes = b"", extra: bytes = b"") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n").encode() + extra + b"\r\n" + body


def post(payload: dict) -> bytes:
    return request("POST", "/v1/completions", json.dumps(payload).encode())


def error_of(status: int, headers: dict, body: bytes) -> dict:
    assert headers["content-type"] == "application/json", (status, body[:200])
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["code"], str) and error["code"], error
    return error


HOSTILE_STOPS = {"prompt": list(range(5, 205)), "echo": True, "max_tokens": 40, "stream": True,
                 "stop": ["x" * 100_000] * 16}
FILLER = b"X-Filler: " + b"f" * 50 + b"\r\n"
CASES = [  # (name, pieces, pause between them, status, code, words in the message, param)
    ("100 KiB head in one write", [request("GET", "/health", extra=b"X-Big: " + b"a" * (100 << 10) + b"\r\n")], 0,
     431, "headers_too_large", "16 KiB", None),
    ("32 KiB head in pieces", [request("GET", "/health", extra=b"X-Big: " + b"a" * (32 << 10) + b"\r\n")[i: i + 1024]
                               for i in range(0, 34 << 10, 1024)], 0.002, 431, "headers_too_large", "16 KiB", None),
    ("300 headers", [request("GET", "/health", extra=FILLER * 300)], 0, 431, "headers_too_large", "16 KiB", None),
    ("garbage request line", [b"\x16\x03\x01 nonsense\r\n\r\n"], 0, 400, "invalid_http_request", "malformed HTTP",
     None),
    ("Content-Length -1", [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n"], 0, 400,
     "invalid_http_request", "malformed HTTP", None),
    ("broken chunked body", [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                             b"Content-Type: application/json\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"], 0, 400,
     "invalid_http_request", "malformed HTTP", None),
    ("unknown route", [request("GET", "/v1/nothing")], 0, 404, "unknown_url", "/v1/nothing", None),
    ("WebSocket upgrade", [request("GET", "/v1/realtime", extra=b"Connection: Upgrade\r\nUpgrade: websocket\r\n"
                                   b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n")],
     0, 404, "unknown_url", "/v1/realtime", None),
    ("wrong method", [request("GET", "/v1/completions")], 0, 405, "method_not_allowed", "POST", None),
    ("n above --max-batch", [post({"prompt": "hi", "n": MAX_BATCH + 1})], 0, 400, "integer_above_max_value",
     f"at most {MAX_BATCH}", "n"),
    ("stream_options without stream", [post({"prompt": "hi", "stream_options": {"include_usage": True}})], 0, 400,
     "invalid_value", "only allowed when stream is true", "stream_options"),
    ("16 stops of 100,000 characters", [post(HOSTILE_STOPS)], 0, 400, "invalid_value", f"at most {MAX_STOP_CHARS}",
     "stop"),
]


@pytest.mark.parametrize("name,pieces,pause,status,code,words,param", CASES, ids=[c[0] for c in CASES])
def test_refusals_are_openai_errors_and_the_server_keeps_serving(address, name, pieces, pause, status, code, words,
                                                                  param):
    got, headers, body = exchange(address, pieces, pause)
    assert got == status, body[:300]
    error = error_of(got, headers, body)
    assert error["code"] == code and words in error["message"] and error["param"] == param, error
    assert exchange(address, [request("GET", "/health")])[0] == 200


def test_a_head_just_under_the_limit_is_served(address):
    """The 431 starts where the docs say: a head of MAX_HEADER_BYTES - 64 bytes is answered."""
    base = request("GET", "/health", extra=b"X-Pad: \r\n")
    pad = MAX_HEADER_BYTES - 64 - len(base)
    status, _, body = exchange(address, [request("GET", "/health", extra=b"X-Pad: " + b"p" * pad + b"\r\n")])
    assert status == 200 and json.loads(body) == {"status": "ok"}


def test_negative_timeouts_are_one_line_errors(tmp_path):
    """The Python API refuses what the CLI refuses: a negative grace period or read timeout."""
    from flashtree.errors import FlashtreeError
    from flashtree.server.graceful import GracefulServer
    from flashtree.server.limits import check_seconds

    with pytest.raises(FlashtreeError, match="grace: expected a non-negative finite number of seconds, got -1"):
        check_seconds("grace", -1.0, zero_ok=True)
    app = type("App", (), {"state": type("State", (), {"engine_loop": None})()})()
    with pytest.raises(FlashtreeError, match="read_timeout: expected a positive"):
        GracefulServer(app, grace=5.0, read_timeout=-3.0)
