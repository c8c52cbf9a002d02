"""Requests bounded in time: a client that never finishes its request loses its connection."""

import socket
import threading
import time

import pytest

pytest.importorskip("uvicorn", reason="uvicorn is not installed")
import uvicorn  # noqa: E402

from pruneops.serving.limits import read_timeout_protocol  # noqa: E402
from pruneops.serving.receiver import create_receiver  # noqa: E402
from tests.conftest import free_port, wait_http  # noqa: E402

READ_TIMEOUT_S = 1.0


@pytest.fixture()
def server():
    port = free_port()
    app = create_receiver("t", lambda alert: "run")
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="error", http=read_timeout_protocol(READ_TIMEOUT_S)
    )
    running = uvicorn.Server(config)
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    wait_http(f"http://127.0.0.1:{port}/healthz")
    yield port
    running.should_exit = True
    thread.join(timeout=10)


def _closed_by_server(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_slow_and_silent_clients_are_disconnected_and_the_server_keeps_answering(server):
    slow = {
        "nothing sent": b"",
        "half the headers": b"POST /alerts HTTP/1.1\r\nHost: x\r\n",
        "a 1 MB body declared, never sent": (
            b"POST /alerts HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n{"
        ),
    }
    sockets = {}
    for case, first in slow.items():
        for n in range(60):  # 180 half-open connections
            s = socket.create_connection(("127.0.0.1", server))
            s.sendall(first)
            sockets[(case, n)] = s
    started = time.perf_counter()
    deadline = started + READ_TIMEOUT_S + 4
    closed = {key: _closed_by_server(s, max(deadline - time.perf_counter(), 0.01)) for key, s in sockets.items()}
    for s in sockets.values():
        s.close()
    held = sorted({case for (case, _), was_closed in closed.items() if not was_closed})
    assert held == [], f"connections still held: {held}"
    wait_http(f"http://127.0.0.1:{server}/healthz", timeout=5)


def test_a_request_that_arrives_in_time_is_not_cut(server):
    with socket.create_connection(("127.0.0.1", server)) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        time.sleep(READ_TIMEOUT_S / 2)
        s.sendall(b"\r\n")
        s.settimeout(5)
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
