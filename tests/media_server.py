"""A local HTTP server on 127.0.0.1 (a free port, its own thread) for image-fetch tests: fixed bodies by path, a
redirect, and a slow body; bounded waits throughout."""
from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class MediaServer:
    def __init__(self, bodies: dict[str, bytes]) -> None:
        self.bodies = dict(bodies)
        served = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/redirect":
                    self.send_response(302)
                    self.send_header("Location", "/" + next(iter(served.bodies)))
                    self.end_headers()
                elif self.path == "/slow":  # a trickle: one byte every 0.2 s for 10 s at most
                    self.send_response(200)
                    self.end_headers()
                    for _ in range(50):
                        try:
                            self.wfile.write(b"x")
                            self.wfile.flush()
                        except OSError:
                            return
                        time.sleep(0.2)
                elif self.path.lstrip("/") in served.bodies:
                    body = served.bodies[self.path.lstrip("/")]
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                else:
                    self.send_error(404)

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> MediaServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)
