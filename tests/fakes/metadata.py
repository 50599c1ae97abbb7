"""A cloud's instance metadata server for agent/spot.py's tests: AWS's IMDSv2 token and
spot/instance-action (404 until ``notice``), GCP's instance/preempted (FALSE until ``notice``)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Metadata(BaseHTTPRequestHandler):
    notice = False
    seen: list = []

    def _send(self, code, body=""):
        self.send_response(code)
        self.end_headers()
        self.wfile.write(body.encode())

    def do_PUT(self):  # noqa: N802 - http.server's names
        self.seen.append(("PUT", self.path, self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")))
        self._send(200, "tok")

    def do_GET(self):  # noqa: N802
        self.seen.append(("GET", self.path, self.headers.get("X-aws-ec2-metadata-token"),
                          self.headers.get("Metadata-Flavor")))
        if self.path == "/latest/meta-data/spot/instance-action":
            self._send(200, json.dumps({"action": "terminate", "time": "2026-12-01T18:40:00Z"})) if self.notice \
                else self._send(404)
        elif self.path == "/computeMetadata/v1/instance/preempted":
            self._send(200, "TRUE" if self.notice else "FALSE")
        else:
            self._send(404)

    def log_message(self, *args):
        pass


def serve() -> tuple[ThreadingHTTPServer, str]:
    """A fresh server (no notice yet) in a daemon thread, and its base URL; ``.shutdown()`` it."""
    Metadata.notice, Metadata.seen = False, []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Metadata)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"
