"""The containers' healthcheck: 0 for a 2xx answer, 1 with a reason otherwise."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pruneops.serving.healthcheck import main


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self.send_response(200 if self.path == "/healthz" else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_healthcheck_exit_codes(capsys, monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_address[1]
    try:
        monkeypatch.setenv("PRUNEOPS_PORT", str(port))
        assert main([]) == 0  # default URL follows PRUNEOPS_PORT
        assert main([f"http://127.0.0.1:{port}/other"]) == 1
        assert "503" in capsys.readouterr().err
    finally:
        server.shutdown()
        server.server_close()
    assert main([f"http://127.0.0.1:{port}/healthz"]) == 1
    assert "unhealthy" in capsys.readouterr().err
