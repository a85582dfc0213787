#!/usr/bin/env python3
"""Writes the seed corpora of the chat fuzzers from the DeepSeek-V4 chat golden file.

tests/frontend/fuzz/chat_request_fuzzer.cc gets one OpenAI chat request body per golden
conversation (messages, tools, reasoning_effort, thinking) plus bodies with every tool_choice
form; tests/text/fuzz/chat_output_fuzzer.cc gets each golden completion (without its EOS) behind
an options byte (bit 0 thinking, bit 1 tools). ctest replays both corpora.

Usage: tools/chat_fuzz_seeds.py [--golden tests/fixtures/text/deepseek_v4_chat_golden.json]
"""

import argparse
import json
import os

EOS = "<｜end▁of▁sentence｜>"


def request_bodies(cases):
    bodies = []
    for c in cases:
        body = {"model": "kjv-v4-tiny", "messages": c["messages"], "max_tokens": 8,
                "chat_template_kwargs": {"thinking": c["thinking"]}}
        if c.get("tools"):
            body["tools"] = c["tools"]
        if c.get("reasoning_effort"):
            body["reasoning_effort"] = c["reasoning_effort"]
        bodies.append(body)
    tool = cases[-1]["tools"][0] if cases[-1].get("tools") else None
    user = [{"role": "user", "content": "hi"}]
    for choice in ["auto", "none", "required",
                   {"type": "function", "function": {"name": tool["function"]["name"]}}]:
        bodies.append({"model": "kjv-v4-tiny", "messages": user, "tools": [tool],
                       "tool_choice": choice, "parallel_tool_calls": False,
                       "stream": True, "stream_options": {"include_usage": True},
                       "user": "u", "metadata": {"k": "v"}, "store": False,
                       "service_tier": "auto", "logprobs": True, "top_logprobs": 2, "n": 2,
                       "max_completion_tokens": 4, "some_new_sdk_field": 1})
    return bodies


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--golden", default="tests/fixtures/text/deepseek_v4_chat_golden.json")
    parser.add_argument("--requests", default="tests/fixtures/frontend/chat_request_corpus")
    parser.add_argument("--outputs", default="tests/fixtures/text/chat_output_corpus")
    args = parser.parse_args()
    with open(args.golden, encoding="utf-8") as f:
        golden = json.load(f)
    os.makedirs(args.requests, exist_ok=True)
    os.makedirs(args.outputs, exist_ok=True)
    for i, body in enumerate(request_bodies(golden["cases"])):
        with open(os.path.join(args.requests, f"seed_{i:02d}.json"), "w", encoding="utf-8") as f:
            json.dump(body, f, ensure_ascii=False)
    count = 0
    for c in golden["completions"]:
        text = c["completion"]
        if text.endswith(EOS):
            text = text[:-len(EOS)]
        for tools in (0, 2):
            flags = (1 if c["thinking"] else 0) | tools
            with open(os.path.join(args.outputs, f"seed_{count:02d}.bin"), "wb") as f:
                f.write(bytes([flags]) + text.encode("utf-8"))
            count += 1
    print(f"wrote {args.requests} and {args.outputs} ({count} outputs)")


if __name__ == "__main__":
    main()
