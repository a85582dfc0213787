#!/usr/bin/env python3
"""Writes golden DeepSeek-V4 chat prompts computed by DeepSeek's own encoding module.

DeepSeek-V4 checkpoints ship encoding/encoding_dsv4.py instead of a Jinja chat template. This
script imports that file from a model directory (or any copy of it, --encoding) and records
encode_messages(messages, thinking_mode, drop_thinking=True, add_default_bos_token=True) for a
set of conversations, in "chat" and "thinking" mode. tests/text/chat_format_test.cc checks
DeepSeekV4ChatFormat against the file. Nothing of the module is copied into pdserve.

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
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"cases": cases}, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {args.out}: {len(cases)} prompts")


if __name__ == "__main__":
    main()
