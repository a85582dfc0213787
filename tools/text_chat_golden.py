#!/usr/bin/env python3
"""Writes golden DeepSeek-V4 chat prompts computed by DeepSeek's own encoding module.

DeepSeek-V4 checkpoints ship encoding/encoding_dsv4.py instead of a Jinja chat template. This
script imports that file from a model directory (or any copy of it, --encoding) and records
encode_messages(messages, thinking_mode, drop_thinking=True, add_default_bos_token=True,
reasoning_effort) for a set of conversations, in "chat" and "thinking" mode, some with tools,
assistant tool calls and tool results, some with reasoning_effort "max". Request-level tools go
on the leading system message, and a system message holding only the tools is added in front when
the conversation has none (what pdserve and vLLM do with the OpenAI request's "tools").
tests/text/chat_format_test.cc checks DeepSeekV4ChatFormat against the file, and
tests/text/chat_output_parser_test.cc parses the assistant turns back. Nothing of the module is
copied into pdserve.

Usage: tools/text_chat_golden.py --encoding MODEL_DIR/encoding/encoding_dsv4.py \
           [--out tests/fixtures/text/deepseek_v4_chat_golden.json]
"""

import argparse
import importlib.util
import json

CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "What is 1+1?"}],
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "Hello! How can I help?", "reasoning_content": "greet"},
     {"role": "user", "content": "Tell me a joke."}],
    [{"role": "user", "content": "first"}, {"role": "user", "content": "second"}],
    [{"role": "user", "content": "q1"},
     {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
     {"role": "user", "content": "q2"},
     {"role": "assistant", "content": "a2", "reasoning_content": "r2"},
     {"role": "user", "content": "q3"}],
    [{"role": "user", "content": "Continue this"},
     {"role": "assistant", "content": "Partial answer", "reasoning_content": "plan"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": ""}],
    [{"role": "user", "content": "Ignore <｜User｜> and </think> please <｜end▁of▁sentence｜>"}],
    [{"role": "system", "content": "系统提示 🚀"},
     {"role": "user", "content": "你好，世界！ 👨‍👩‍👧‍👦 café\n\n  indented"}],
    [{"role": "system", "content": "one"}, {"role": "system", "content": "two"},
     {"role": "user", "content": "three"}],
]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city, in °C",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1},
        "detail": {"type": "number", "default": 0.5}},
        "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "now", "description": "",
                                          "parameters": {"type": "object", "properties": {}}}}


def call(call_id, name, arguments):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# (messages, tools, reasoning_effort): conversations with tools and tool results.
TOOL_CONVERSATIONS = [
    ([{"role": "user", "content": "Weather in Paris?"}], [WEATHER], None),
    ([{"role": "system", "content": "You are terse."},
      {"role": "user", "content": "Weather in Paris and the time?"}], [WEATHER, CLOCK], None),
    ([{"role": "system", "content": "You are terse."},
      {"role": "user", "content": "Weather in Paris and Oslo, 3 days?"},
      {"role": "assistant", "content": "", "reasoning_content": "Two cities: two calls.",
       "tool_calls": [call("call_a", "get_weather", "{\"city\": \"Paris\", \"days\": 3}"),
                      call("call_b", "get_weather",
                           "{\"city\": \"Oslo\", \"days\": 3, \"detail\": 1e-05, "
                           "\"tags\": [\"a\", {\"k\": null}], \"ok\": true}")]},
      {"role": "tool", "tool_call_id": "call_b", "content": "Oslo: 4°C, rain"},
      {"role": "tool", "tool_call_id": "call_a", "content": "Paris: 12°C \"sunny\""}],
     [WEATHER], None),
    ([{"role": "user", "content": "What time is it?"},
      {"role": "assistant", "content": "Let me look.", "reasoning_content": "Use the clock.",
       "tool_calls": [call("c1", "now", "{}")]},
      {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
      {"role": "assistant", "content": "It is noon.", "reasoning_content": "Answer it."},
      {"role": "user", "content": "And in an hour?"}], [CLOCK], None),
    ([{"role": "user", "content": "time?"},
      {"role": "assistant", "content": None,
       "tool_calls": [call("c1", "now", "not json {")]},
      {"role": "tool", "tool_call_id": "c1", "content": ""},
      {"role": "user", "content": "thanks"}], [CLOCK], None),
    ([{"role": "system", "content": "Think hard."},
      {"role": "user", "content": "Prove that 2 is prime."}], [], "max"),
    ([{"role": "user", "content": "q1"},
      {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
      {"role": "user", "content": "q2"}], [], "max"),
    ([{"role": "user", "content": "Weather in Rome?"}], [WEATHER], "max"),
]

# Assistant turns whose completion text (what the model writes after the generation prompt) is
# parsed back by the module's parse_message_from_completion_text.
ANSWERS = [
    {"role": "assistant", "content": "Plain answer.", "reasoning_content": "Short thought."},
    {"role": "assistant", "content": "", "reasoning_content": "Need the weather.",
     "tool_calls": [call("x", "get_weather", "{\"city\": \"Zürich\", \"days\": 2}")]},
    {"role": "assistant", "content": "Checking both.", "reasoning_content": "",
     "tool_calls": [call("x", "get_weather",
                         "{\"city\": \"a\\\"b\\n<c>\", \"detail\": 2.5, \"extra\": "
                         "{\"list\": [1, 2, {\"x\": \"y\"}]}}"),
                    call("y", "now", "{}")]},
    {"role": "assistant", "content": "multi\nline <b>html</b>", "reasoning_content": "a < b"},
]


def completions(module):
    """(completion text, thinking, parsed message) for each answer in both modes."""
    out = []
    system = {"role": "system", "content": "", "tools": [WEATHER, CLOCK]}
    user = {"role": "user", "content": "go"}
    for answer in ANSWERS:
        for mode in ("chat", "thinking"):
            prefix = module.encode_messages([system, user], thinking_mode=mode)
            full = module.encode_messages([system, user, answer], thinking_mode=mode)
            assert full.startswith(prefix)
            text = full[len(prefix):]
            parsed = module.parse_message_from_completion_text(text, thinking_mode=mode)
            out.append({"completion": text, "thinking": mode == "thinking",
                        "content": parsed["content"],
                        "reasoning_content": parsed["reasoning_content"],
                        "tool_calls": [{"name": c["function"]["name"],
                                        "arguments": c["function"]["arguments"]}
                                       for c in parsed["tool_calls"]]})
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--encoding", required=True, help="path of encoding_dsv4.py")
    parser.add_argument("--out", default="tests/fixtures/text/deepseek_v4_chat_golden.json")
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location("encoding_dsv4", args.encoding)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cases = []
    for messages in CONVERSATIONS:
        for mode in ("chat", "thinking"):
            prompt = module.encode_messages([dict(m) for m in messages], thinking_mode=mode,
                                            drop_thinking=True, add_default_bos_token=True)
            cases.append({"messages": messages, "thinking": mode == "thinking",
                          "prompt": prompt})
    for messages, tools, effort in TOOL_CONVERSATIONS:
        for mode in ("chat", "thinking"):
            encoded = [dict(m) for m in messages]
            if tools and encoded[0]["role"] == "system":
                encoded[0]["tools"] = tools
            elif tools:
                encoded.insert(0, {"role": "system", "tools": tools})
            prompt = module.encode_messages(encoded, thinking_mode=mode, drop_thinking=True,
                                            add_default_bos_token=True,
                                            reasoning_effort=effort)
            cases.append({"messages": messages, "tools": tools, "reasoning_effort": effort,
                          "thinking": mode == "thinking", "prompt": prompt})
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"cases": cases, "completions": completions(module)}, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {args.out}: {len(cases)} prompts")


if __name__ == "__main__":
    main()
