#!/usr/bin/env python3
"""A minimal OpenAI-compatible streaming server for the `pdserve bench` / `pdserve check` CLI
tests: GET /v1/models, streamed POST /v1/completions and /v1/chat/completions (HTTP/1.0, body
ends at connection close, as many small servers do). Prints its port on stdout, then serves.

--mode varied: token t is " w<t>"; --mode repeat: every token is "<div>" (a degenerate server).
"""
import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def make_handler(mode):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def send_json(self, obj):
            body = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/v1/models":
                return self.send_json({"object": "list", "data": [{"id": "stub", "object": "model"}]})
            self.send_error(404)

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            chat = self.path == "/v1/chat/completions"
            if self.path not in ("/v1/completions", "/v1/chat/completions") or not req.get("stream"):
                return self.send_error(400)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            n = int(req.get("max_tokens", 16))
            for t in range(n):
                text = "<div>" if mode == "repeat" else f" w{t}"
                choice = {"index": 0, "finish_reason": "length" if t == n - 1 else None}
                if chat:
                    choice["delta"] = {"content": text}
                    if req.get("logprobs"):
                        choice["logprobs"] = {"content": [{"token": text, "logprob": -1.0}]}
                else:
                    choice["text"] = text
                chunk = {"object": "chat.completion.chunk" if chat else "text_completion",
                         "choices": [choice]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}}
            self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())

    return Handler


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["varied", "repeat"], default="varied")
    args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(args.mode))
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
