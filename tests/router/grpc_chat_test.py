#!/usr/bin/env python3
"""The chat surface of issue 29 through the router's gRPC front (pdserve.v1.Generation) of a real
`pdserve up` cluster (router, prefill and decode processes, CPU backend, the bundled model), with
grpcio and message classes built from the router's reflection (tests/grpc_generation.py). Every
answer is compared with the HTTP front's answer to the same request (same seed):

- response_format json_schema (strict), streamed: the joined text parses and validates with
  Python's jsonschema, and equals the HTTP front's content; json_object gives an object; a schema
  keyword pdserve cannot enforce is INVALID_ARGUMENT carrying the HTTP front's 400 error JSON.
- thinking mode: reasoning and text split as the HTTP front's reasoning_content / content, usage's
  reasoning_tokens equal to its completion_tokens_details; reasoning_effort "max" lengthens the
  prompt by DeepSeek's instruction as on HTTP.
- tools: a tool round trip (assistant tool_calls, a tool message) with tool_choice "none" answers
  as on HTTP; tool_choice "required", a named function and "auto" put DeepSeek's tools section
  in the prompt, which the bundled model's 512-token context cannot hold: INVALID_ARGUMENT
  context_length_exceeded, the HTTP front's error. (The parse of a model's tool calls through the
  gRPC front is tested on DeepSeek-encoded token streams in tests/router/grpc_front_chat_test.cc.)

Exits 77 (ctest SKIP) when grpcio, grpcio-reflection or jsonschema is missing (scripts/
install-deps.sh installs them into the test venv).
"""
import argparse
import json
import os
import sys
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from chat_requests import TOOL_ROUND_TRIP, WEATHER_TOOL  # noqa: E402  (tests/chat_requests.py)
from up_cluster import running_up  # noqa: E402  (tests/up_cluster.py)
from checks import FAILURES, check  # noqa: E402  (tests/checks.py)

try:
    import grpc
    import jsonschema
    from grpc_generation import generation_call, join_choice  # tests/grpc_generation.py
except ImportError as e:
    print(f"SKIP: {e} (pip packages grpcio, grpcio-reflection, jsonschema)")
    sys.exit(77)

# Schemas of tests/structured/schemas.json: an object with required fields, escapes in enums and
# consts, anyOf of objects.
SCHEMAS = ["person", "escapes", "shape"]
SEEDS = [11, 12]


def http_chat(port, body):
    """(HTTP status, JSON body) of a non-streamed /v1/chat/completions."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class Front:
    """Both fronts of one router, for one model."""

    def __init__(self, channel, http_port, model):
        self.request_class, self.call = generation_call(channel)
        self.http_port = http_port
        self.model = model

    def grpc(self, **fields):
        """Choice 0 joined (grpc_generation.join_choice), or the RpcError the call ended with."""
        request = self.request_class(model=self.model, **fields)
        try:
            return join_choice(self.call(request, timeout=120))
        except grpc.RpcError as e:
            return e

    def http(self, **body):
        return http_chat(self.http_port, dict(model=self.model, **body))


def grpc_messages(messages):
    """OpenAI chat messages as pdserve.v1 ChatMessage fields."""
    out = []
    for m in messages:
        calls = [{"id": c["id"], "name": c["function"]["name"],
                  "arguments": c["function"]["arguments"]} for c in m.get("tool_calls", [])]
        out.append({"role": m["role"], "content": m.get("content") or "", "tool_calls": calls,
                    "tool_call_id": m.get("tool_call_id", "")})
    return {"messages": out}


def same_error(front_name, got, status, body, code):
    """`got` (gRPC) is INVALID_ARGUMENT with the HTTP front's 400 `body` as its details."""
    if not isinstance(got, grpc.RpcError):
        check(False, f"{front_name}: expected INVALID_ARGUMENT, got an answer {got}")
        return
    details = json.loads(got.details())
    check(got.code() == grpc.StatusCode.INVALID_ARGUMENT and status == 400 and details == body
          and (code is None or details["error"]["code"] == code),
          f"{front_name}: {got.code().name} with the HTTP front's {status} error: "
          f"{details['error']['message'][:120]}")


def test_json_schema(front, schemas):
    messages = [{"role": "user", "content": "Answer as JSON"}]
    for entry in schemas:
        for seed in SEEDS:
            schema_text = json.dumps(entry["schema"])
            got = front.grpc(chat=grpc_messages(messages), temperature=1.0, max_tokens=128,
                             seed=seed, response_format={"type": "json_schema", "json_schema": {
                                 "name": entry["name"], "schema_json": schema_text,
                                 "strict": True}})
            if isinstance(got, grpc.RpcError):
                check(False, f"json_schema {entry['name']}: {got.code()} {got.details()}")
                continue
            try:
                jsonschema.validate(json.loads(got["text"]), entry["schema"])
                why = ""
            except Exception as e:  # json.JSONDecodeError or jsonschema.ValidationError
                why = f"{type(e).__name__}: {str(e)[:160]}"
            status, body = front.http(messages=messages, temperature=1.0, max_tokens=128,
                                      seed=seed, response_format={
                                          "type": "json_schema", "json_schema": {
                                              "name": entry["name"], "schema": entry["schema"],
                                              "strict": True}})
            http_text = body["choices"][0]["message"]["content"] if status == 200 else None
            check(not why and got["text"] == http_text and got["messages"] > 2 and
                  got["finish_reason"] == body["choices"][0]["finish_reason"],
                  f"json_schema {entry['name']} seed {seed}: {got['messages']} messages join to "
                  f"a valid document equal to HTTP's ({got['finish_reason']}) {why} "
                  f"{got['text'][:80]!r}")
    got = front.grpc(chat=grpc_messages(messages), temperature=1.0, max_tokens=128, seed=3,
                     response_format={"type": "json_object"})
    try:
        parsed = json.loads(got["text"])
    except (TypeError, json.JSONDecodeError):
        parsed = None
    check(isinstance(parsed, dict), f"json_object gives an object: {str(got)[:100]}")
    schema = {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-z]+$"}}}
    got = front.grpc(chat=grpc_messages(messages), max_tokens=8, response_format={
        "type": "json_schema", "json_schema": {"name": "p", "schema_json": json.dumps(schema)}})
    status, body = front.http(messages=messages, max_tokens=8, response_format={
        "type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    same_error("an unenforceable keyword ('pattern')", got, status, body, None)
    check("'pattern'" in body["error"]["message"], f"the error names it: {body['error']}")


def test_thinking(front):
    messages = [{"role": "user", "content": "Who was Moses?"}]
    got = front.grpc(chat=grpc_messages(messages), thinking=True, max_tokens=24, seed=4)
    status, body = front.http(messages=messages, max_tokens=24, seed=4,
                              chat_template_kwargs={"thinking": True})
    message = body["choices"][0]["message"]
    details = body["usage"].get("completion_tokens_details") or {}
    check(status == 200 and got["reasoning"] != "" and
          got["reasoning"] == message.get("reasoning_content") and
          got["text"] == (message.get("content") or "") and
          got["usage"]["reasoning_tokens"] > 0 and
          got["usage"]["reasoning_tokens"] == details.get("reasoning_tokens"),
          f"thinking: reasoning {got['reasoning'][:60]!r}, text {got['text'][:40]!r}, "
          f"{got['usage']} equal HTTP's reasoning_content / content / {details}")
    effort = front.grpc(chat=grpc_messages(messages), reasoning_effort="max", max_tokens=4, seed=4)
    status, body = front.http(messages=messages, max_tokens=4, seed=4, reasoning_effort="max")
    check(effort["usage"]["prompt_tokens"] == body["usage"]["prompt_tokens"] >
          got["usage"]["prompt_tokens"],
          f"reasoning_effort max: prompt {effort['usage']['prompt_tokens']} tokens (HTTP "
          f"{body['usage']['prompt_tokens']}) > thinking's {got['usage']['prompt_tokens']}")


def test_tools(front):
    messages = TOOL_ROUND_TRIP
    weather = WEATHER_TOOL["function"]
    tool = {"name": weather["name"], "description": weather["description"],
            "parameters_json": json.dumps(weather["parameters"])}
    http_tools = [WEATHER_TOOL]
    got = front.grpc(chat=grpc_messages(messages), tools=[tool], tool_choice="none",
                     max_tokens=16, seed=3)
    status, body = front.http(messages=messages, tools=http_tools, tool_choice="none",
                              max_tokens=16, seed=3)
    check(not isinstance(got, grpc.RpcError) and status == 200 and not got["tool_calls"] and
          got["text"] == body["choices"][0]["message"]["content"] and
          got["finish_reason"] in ("stop", "length"),
          f"tool round trip, tool_choice none: {str(got)[:120]} equals HTTP's answer")
    forced = {
        "required": ({"tool_choice": "required"}, {"tool_choice": "required"}),
        "a named function": ({"tool_choice_function": "get_weather"},
                             {"tool_choice": {"type": "function",
                                              "function": {"name": "get_weather"}}}),
        "auto": ({}, {}),
    }
    for name, (grpc_fields, http_fields) in forced.items():
        got = front.grpc(chat=grpc_messages(messages[:1]), tools=[tool], thinking=False,
                         max_tokens=16, **grpc_fields)
        status, body = front.http(messages=messages[:1], tools=http_tools, max_tokens=16,
                                  chat_template_kwargs={"thinking": False}, **http_fields)
        same_error(f"tool_choice {name} over the 512-token context", got, status, body,
                   "context_length_exceeded")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pdserve", required=True)
    parser.add_argument("--model", required=True, help="model directory")
    parser.add_argument("--repo", required=True)
    args = parser.parse_args()
    with open(os.path.join(args.repo, "tests", "structured", "schemas.json")) as f:
        schemas = [s for s in json.load(f) if s["name"] in SCHEMAS]
    model = os.path.basename(os.path.normpath(args.model))
    with running_up(args.pdserve, args.model, model, check, FAILURES, grpc=True) as (_, _, p):
        if p:
            with grpc.insecure_channel(f"127.0.0.1:{p['grpc']}") as channel:
                front = Front(channel, p["http"], model)
                test_json_schema(front, schemas)
                test_thinking(front)
                test_tools(front)
    print(f"{len(FAILURES)} failure(s)" if FAILURES else "all passed")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
