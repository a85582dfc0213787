#!/usr/bin/env python3
"""Integration test of the real `pdserve serve` process on the bundled model.

Starts the server on a free loopback port and checks, with curl and with the OpenAI python client:
non-streamed and streamed completions and chat completions, that streamed text equals the
non-streamed text for the same seed, usage and finish_reason, and a 400 context_length_exceeded.
Exits 77 (ctest SKIP) when curl is missing, and also, after the curl part has run and passed,
when `openai` cannot be imported (so ctest shows the OpenAI client part as not run).
"""
import argparse
import json
import shutil
import subprocess
import sys


def curl(url, body, stream=False):
    args = ["curl", "-sS", "-N" if stream else "-s", "-H", "Content-Type: application/json",
            "-d", json.dumps(body), "-w", "\n%{http_code}", url]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    text, code = out.rsplit("\n", 1)
    return int(code), text


def sse_text(body, chat):
    pieces, finish, done = [], None, False
    for line in body.splitlines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            continue
        for choice in json.loads(data).get("choices", []):
            if chat:
                pieces.append(choice.get("delta", {}).get("content") or "")
            else:
                pieces.append(choice.get("text") or "")
            finish = choice.get("finish_reason") or finish
    assert done, "stream did not end with [DONE]"
    return "".join(pieces), finish


def check(cond, message):
    if not cond:
        print("FAIL:", message)
        sys.exit(1)
    print("ok:", message)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pdserve", required=True)
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    if shutil.which("curl") is None:
        print("SKIP: curl is not installed")
        return 77
    server = subprocess.Popen([args.pdserve, "serve", "--model", args.model, "--port", "0",
                               "--max-batch", "8"], stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        check("listening on" in line, f"server started: {line.strip()}")
        base = line.strip().rsplit(" ", 1)[1]
        model = "kjv-v4-tiny"

        prompt = {"model": model, "prompt": "And God said", "max_tokens": 24, "seed": 7,
                  "temperature": 0.6, "top_p": 0.95}
        code, body = curl(base + "/v1/completions", prompt)
        check(code == 200, f"curl completion: HTTP {code}")
        full = json.loads(body)
        text = full["choices"][0]["text"]
        check(len(text.strip()) > 0, f"completion text is not empty: {text!r}")
        check(full["usage"]["completion_tokens"] <= 24 and full["usage"]["prompt_tokens"] > 0,
              f"usage {full['usage']}")
        code, body = curl(base + "/v1/completions", dict(prompt, stream=True), stream=True)
        streamed, finish = sse_text(body, chat=False)
        check(streamed == text, "curl: streamed completion text == non-streamed text")
        check(finish == full["choices"][0]["finish_reason"], f"same finish_reason {finish}")

        chat = {"model": model, "max_tokens": 32, "seed": 3,
                "messages": [{"role": "developer", "content": "Answer briefly."},
                             {"role": "user", "content": "Who was Moses?"}]}
        code, body = curl(base + "/v1/chat/completions", chat)
        check(code == 200, f"curl chat: HTTP {code}")
        chat_text = json.loads(body)["choices"][0]["message"]["content"]
        code, body = curl(base + "/v1/chat/completions", dict(chat, stream=True), stream=True)
        check(sse_text(body, chat=True)[0] == chat_text, "curl: streamed chat == non-streamed chat")

        code, body = curl(base + "/v1/completions", dict(prompt, max_tokens=100000))
        check(code == 400 and "context_length_exceeded" in body, f"too long: HTTP {code}")

        try:
            import openai
        except ImportError as e:
            print(f"SKIP (OpenAI client part): cannot import openai: {e}; the curl part passed; "
                  "scripts/install-deps.sh makes the venv with it")
            return 77
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
        c = client.completions.create(**prompt)
        check(c.choices[0].text == text, "openai: completion equals curl's for the same seed")
        s = client.completions.create(**dict(prompt, stream=True))
        check("".join(ch.choices[0].text for ch in s if ch.choices) == text,
              "openai: streamed completion == non-streamed")
        r = client.chat.completions.create(**chat)
        check(r.choices[0].message.content == chat_text, "openai: chat equals curl's")
        s = client.chat.completions.create(**dict(chat, stream=True))
        check("".join(ch.choices[0].delta.content or "" for ch in s if ch.choices) == chat_text,
              "openai: streamed chat == non-streamed chat")
        n2 = client.completions.create(**dict(prompt, n=2, seed=11))
        check(len(n2.choices) == 2 and n2.choices[0].text != n2.choices[1].text,
              "openai: n=2 gives two distinct choices")
        return 0
    finally:
        server.terminate()
        rc = server.wait(timeout=30)
        print("server exit status", rc)


if __name__ == "__main__":
    sys.exit(main())
