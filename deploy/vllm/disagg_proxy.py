"""A disaggregated-serving proxy for two vLLM OpenAI servers sharing kvd.

    python3 disagg_proxy.py --port 8000 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

Each POST to /v1/completions or /v1/chat/completions goes first to the prefill instance with
max_tokens 1 (it computes the prompt and its connector saves the prompt's chunks into kvd), then,
unchanged, to the decode instance (its connector loads those chunks instead of computing them);
the decode instance's answer, streamed or not, is the client's. Other requests go to the decode
instance. Standard library only; one thread per connection."""

import argparse
import http.client
import http.server
import json
import sys
import urllib.parse

HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length"}


def _connection(base, timeout):
    u = urllib.parse.urlsplit(base)
    return http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)


def prefill_body(body, path):
    """The request for the prefill instance: one generated token, not streamed."""
    p = dict(body)
    p["max_tokens"] = 1
    if path.endswith("/chat/completions"):
        p["max_completion_tokens"] = 1
    p["stream"] = False
    p.pop("stream_options", None)
    return p


class Proxy(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    prefill = decode = ""
    timeout = 600.0

    def log_message(self, fmt, *args):  # one line per request on stderr
        sys.stderr.write("[proxy] " + (fmt % args) + "\n")

    def do_GET(self):
        self._forward(self.server.decode, "GET", self.path, None)

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path in ("/v1/completions", "/v1/chat/completions"):
            try:
                body = json.loads(raw)
            except ValueError as e:
                self._reply(400, {"error": f"the request body is not JSON: {e}"})
                return
            status, answer = self._call(self.server.prefill, self.path, prefill_body(body,
                                                                                  self.path))
            if status != 200:
                self._reply(502, {"error": f"prefill instance answered {status}",
                                  "prefill": answer.decode(errors="replace")})
                return
        self._forward(self.server.decode, "POST", self.path, raw)

    def _call(self, base, path, body):
        conn = _connection(base, self.timeout)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, r.read()
        except OSError as e:
            return 599, str(e).encode()
        finally:
            conn.close()

    def _forward(self, base, method, path, raw):
        conn = _connection(base, self.timeout)
        try:
            headers = {"Content-Type": self.headers.get("Content-Type", "application/json")}
            conn.request(method, path, raw, headers)
            r = conn.getresponse()
            self.send_response(r.status)
            for k, v in r.getheaders():
                if k.lower() not in HOP_HEADERS:
                    self.send_header(k, v)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while True:  # relay as it comes: streamed tokens reach the client at once
                piece = r.read1(65536)
                if not piece:
                    break
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except OSError as e:
            self._reply(502, {"error": f"decode instance: {e}"})
        finally:
            conn.close()

    def _reply(self, status, obj):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--prefill", required=True, help="base URL of the kv_producer instance")
    ap.add_argument("--decode", required=True, help="base URL of the kv_consumer instance")
    a = ap.parse_args()
    server = http.server.ThreadingHTTPServer((a.host, a.port), Proxy)
    server.prefill, server.decode = a.prefill, a.decode
    print(f"[proxy] http://{a.host}:{a.port} -> prefill {a.prefill} -> decode {a.decode}",
          file=sys.stderr, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
