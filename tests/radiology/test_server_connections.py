"""The reward server against hostile or broken clients, over real sockets: a body of deeply nested
JSON is a 400 and the server goes on; a request line or headers that never finish arriving (sent
at once and abandoned, or trickled a byte at a time) get a 408 and the connection is closed."""

from __future__ import annotations

import json
import socket
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from grouprl.domains.radiology.server import app as server  # noqa: E402

HEADER_TIMEOUT = 1.0
WAIT = 30  # the longest a test waits for the server to act; a bound, not a timing assertion
PARTIAL_HEADERS = b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: applic"
FORMAT_ONLY = {"hyps": ["No effusion."], "refs": ["No effusion."], "type": "free_form",
               "requested_reward_components": ["format"]}


@pytest.fixture(scope="module")
def app():
    return server.create_app(entity_embeddings="ngram")


@pytest.fixture
def live(app, serve_app):
    """The app served with ``serve()``'s HTTP protocol, its header deadline cut to 1 s."""
    with serve_app(app, http=server.header_timeout_protocol(HEADER_TIMEOUT)) as port:
        yield port


def read_until_closed(conn: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (the socket's timeout bounds each wait)."""
    chunks = []
    while chunk := conn.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_a_deeply_nested_body_is_a_400_and_the_server_goes_on(live):
    url = f"http://127.0.0.1:{live}/predict"
    for body in (b"[" * 100_000, b'{"hyps": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"):
        r = httpx.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=WAIT)
        assert r.status_code == 400, r.text
        assert r.json() == {"result": "error",
                            "data": {"message": "malformed JSON: arrays or objects nested too deeply to parse"}}
    r = httpx.post(url, json=FORMAT_ONLY, timeout=WAIT)
    assert r.status_code == 200, r.text
    assert len(r.json()["data"]["predictions"]["final_scores"]) == 1


def test_decode_json_body_refuses_deep_nesting_as_a_request_error():
    with pytest.raises(server.RequestError, match="nested too deeply") as caught:
        server.decode_json_body(b"[" * 100_000)
    assert caught.value.status == 400


def test_abandoned_headers_get_408_and_the_connection_is_closed(live):
    with socket.create_connection(("127.0.0.1", live), timeout=WAIT) as conn:
        conn.sendall(PARTIAL_HEADERS)  # and nothing more
        answer = read_until_closed(conn)  # returns because the server closes, not because we gave up
    assert answer.startswith(b"HTTP/1.1 408"), answer
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower()
    assert json.loads(body) == {"result": "error",
                                "data": {"message": "request line and headers not received within 1 s"}}
    assert httpx.get(f"http://127.0.0.1:{live}/health", timeout=WAIT).json()["status"] == "ok"


def test_a_connection_that_sends_nothing_is_closed(live):
    with socket.create_connection(("127.0.0.1", live), timeout=WAIT) as conn:
        assert read_until_closed(conn).startswith(b"HTTP/1.1 408")


def test_trickled_headers_do_not_extend_the_deadline(live):
    """A byte every 50 ms keeps the connection busy but never finishes the headers: the deadline
    runs from the request's first byte, so the server closes the connection anyway."""
    request = PARTIAL_HEADERS + b"x" * 100_000  # far more bytes than can trickle in before the wait ends
    received, closed = b"", False
    with socket.create_connection(("127.0.0.1", live)) as conn:
        conn.settimeout(0.05)
        deadline = time.monotonic() + WAIT
        for byte in request:
            assert time.monotonic() < deadline, "the server did not close the trickling connection"
            try:
                chunk = conn.recv(65536)
            except TimeoutError:
                chunk = None  # nothing yet: send the next byte
            except ConnectionResetError:  # closed while our last byte was on its way
                closed = True
                break
            if chunk is not None:
                received += chunk
                if not chunk:  # closed
                    closed = True
                    break
                continue
            try:
                conn.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
    assert closed
    assert not received or received.startswith(b"HTTP/1.1 408"), received
    assert httpx.get(f"http://127.0.0.1:{live}/health", timeout=WAIT).json()["status"] == "ok"


def test_a_kept_alive_connections_next_request_has_the_deadline_too(live):
    """After a full answer the connection stays open for the next request; that request's headers
    are bounded as the first one's were (uvicorn's keep-alive timer ends at its first byte)."""
    with socket.create_connection(("127.0.0.1", live), timeout=WAIT) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += conn.recv(65536)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        while len(body) < length:
            body += conn.recv(65536)
        assert json.loads(body)["status"] == "ok"
        conn.sendall(PARTIAL_HEADERS)  # the next request, never finished
        assert read_until_closed(conn).startswith(b"HTTP/1.1 408")


def test_header_timeout_must_be_a_positive_number():
    for bad in (0, -1, float("inf"), True, "30"):
        with pytest.raises(ValueError, match="header_timeout must be a positive number"):
            server.header_timeout_protocol(bad)


def test_serve_rewards_takes_header_timeout(capsys):
    """``--header-timeout`` reaches ``serve()``: a bad one is refused before any port is bound (a
    bad port would be refused too, after it, with another message)."""
    from grouprl.cli import main

    assert main(["serve", "rewards", "--header-timeout", "0", "--port", "70000"]) == 2
    err = capsys.readouterr().err
    assert "header_timeout must be a positive number of seconds, got 0.0" in err
