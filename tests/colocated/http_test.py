#!/usr/bin/env python3
"""Integration test of the real `pdserve serve` process on the bundled model.

Starts the server on a free loopback port and checks, with curl and with the OpenAI python client:
non-streamed and streamed completions and chat completions, that streamed text equals the
non-streamed text for the same seed, usage and finish_reason, 400 context_length_exceeded (a chat
prompt over the context names "messages"), a conversation ending with an assistant message (400
naming continue_final_message; with it, or DeepSeek's "prefix", the open turn's greedy
completion), inconsistent histories and image parts (400 naming the message), /v1/models
listing the model once (its path still accepted as an alias), /v1/completions' top_logprobs dicts
ordered most likely first, and /metrics:
every family it exports is in docs/metrics.md with that type, pdserve_build_info has role "serve",
and `promtool check metrics` accepts it (where promtool is installed); `pdserve check` with a
prompt set over the model's context says so in its first line and exits 2.
Exits 77 (ctest SKIP) when curl is missing, and also, after the curl part has run and passed,
when `openai` cannot be imported (so ctest shows the OpenAI client part as not run).
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "tests", "ops"))
from prometheus_scrape_test import documented_metrics  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from child_process import popen  # noqa: E402  (tests/child_process.py)


def curl(url, body, stream=False):
    args = ["curl", "-sS", "-N" if stream else "-s", "-H", "Content-Type: application/json",
            "-d", json.dumps(body), "-w", "\n%{http_code}", url]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    text, code = out.rsplit("\n", 1)
    return int(code), text


def get(url):
    out = subprocess.run(["curl", "-sS", "-w", "\n%{http_code}", url], check=True,
                         capture_output=True, text=True).stdout
    text, code = out.rsplit("\n", 1)
    return int(code), text


def sse_choices(body):
    """The choices of every data event of an SSE body, in order."""
    return [choice for line in body.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"
            for choice in json.loads(line[len("data: "):]).get("choices", [])]


def ranked(top_logprobs):
    """True when every {token: logprob} dict lists its entries by logprob, best first."""
    return all(list(d.values()) == sorted(d.values(), reverse=True) for d in top_logprobs)


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
    server = popen([args.pdserve, "serve", "--model", args.model, "--port", "0",
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

        # A conversation ending with an assistant message: 400 naming the field to use; with it,
        # the turn is left open (no EOS) and the answer continues it, as the same prompt through
        # /v1/completions does (greedy). docs/chat-format.md, "Continuing an assistant message".
        ends = {"model": model, "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": "hi"},
                             {"role": "assistant", "content": "And God"}]}
        code, body = curl(base + "/v1/chat/completions", ends)
        check(code == 400 and "continue_final_message" in json.loads(body)["error"]["message"],
              f"a last assistant message without continue_final_message: {code} {body}")
        for extra in ({"continue_final_message": True}, {"add_generation_prompt": False,
                                                         "continue_final_message": True}):
            code, body = curl(base + "/v1/chat/completions", dict(ends, **extra))
            check(code == 200, f"continue_final_message: HTTP {code} {body}")
            cont = json.loads(body)
            ids = subprocess.run(
                [args.pdserve, "tokenize", "--model", args.model, "--allow-special", "--text",
                 "<｜User｜>hi<｜Assistant｜></think>And God"],
                capture_output=True, text=True, check=True).stdout.replace(",", " ").split()
            code, body = curl(base + "/v1/completions", {
                "model": model, "max_tokens": 8, "temperature": 0, "prompt": [int(i) for i in ids]})
            same = json.loads(body)
            check(cont["usage"]["prompt_tokens"] == same["usage"]["prompt_tokens"] == 8
                  and cont["choices"][0]["message"]["content"] == same["choices"][0]["text"],
                  f"the continuation is the open turn's completion: {cont} {same}")
        prefixed = dict(ends, messages=[ends["messages"][0],
                                        dict(ends["messages"][1], prefix=True)])
        code, body = curl(base + "/v1/chat/completions", prefixed)
        check(code == 200 and json.loads(body)["choices"][0]["message"]["content"] ==
              cont["choices"][0]["message"]["content"], f"DeepSeek's prefix: true: {code} {body}")
        for messages, wanted in (
                ([{"role": "user", "content": "x"},
                  {"role": "tool", "content": "42", "tool_call_id": "nope"}], "messages[1]: "),
                ([{"role": "tool", "content": "42", "tool_call_id": "a"}], "messages[0]: "),
                ([{"role": "user", "content": "x"}, {"role": "assistant", "content": None},
                  {"role": "user", "content": "y"}], "messages[1]: an assistant message needs"),
                ([{"role": "user", "content": []}],
                 "messages[0].content must not be an empty array"),
                ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                 "accepts text only")):
            code, body = curl(base + "/v1/chat/completions", {"model": model, "messages": messages})
            message = json.loads(body).get("error", {}).get("message", "")
            check(code == 400 and wanted in message,
                  f"inconsistent history is 400: {code} {message}")

        code, body = curl(base + "/v1/completions", dict(prompt, max_tokens=100000))
        check(code == 400 and "context_length_exceeded" in body, f"too long: HTTP {code}")
        long_chat = {"model": model, "messages": [{"role": "user", "content": "And " * 600}]}
        code, body = curl(base + "/v1/chat/completions", long_chat)
        error = json.loads(body).get("error", {})
        check(code == 400 and error.get("param") == "messages"
              and "your messages resulted in" in error.get("message", ""),
              f"chat over the context without max_tokens names the messages: {code} {error}")

        code, body = get(base + "/v1/models")
        ids = [m["id"] for m in json.loads(body)["data"]]
        check(code == 200 and ids == [model], f"/v1/models lists the model once: {ids}")
        code, body = curl(base + "/v1/completions", dict(prompt, model=args.model))
        check(code == 200, f"the model's path is accepted as its name: HTTP {code}")

        with_logprobs = dict(prompt, logprobs=5, max_tokens=8)
        code, body = curl(base + "/v1/completions", with_logprobs)
        top = json.loads(body)["choices"][0]["logprobs"]["top_logprobs"]
        check(code == 200 and len(top) == 8 and all(len(d) >= 2 for d in top) and ranked(top),
              f"top_logprobs most likely first: {top[:2]}")
        code, body = curl(base + "/v1/completions", dict(with_logprobs, stream=True), stream=True)
        top = [d for c in sse_choices(body) if c.get("logprobs")
               for d in c["logprobs"]["top_logprobs"]]
        check(code == 200 and len(top) == 8 and ranked(top),
              f"streamed top_logprobs most likely first: {top[:2]}")

        code, metrics = get(base + "/metrics")
        exported = dict(re.findall(r"^# TYPE (\S+) (\S+)$", metrics, re.M))
        documented = documented_metrics(ROOT)
        wrong = {name: kind for name, kind in exported.items() if documented.get(name) != kind}
        check(code == 200 and exported and not wrong,
              f"/metrics: {len(exported)} families, each in docs/metrics.md with its type "
              f"(not: {wrong})")
        check(re.search(r'^pdserve_build_info\{role="serve",version="[0-9.]+"\} 1$', metrics, re.M),
              "/metrics: pdserve_build_info{role=\"serve\"}")
        check(re.search(r"^pdserve_serve_generation_tokens_total [1-9]", metrics, re.M),
              "/metrics: generated tokens counted")
        promtool = shutil.which("promtool")
        if promtool:
            lint = subprocess.run([promtool, "check", "metrics"], input=metrics, text=True,
                                  capture_output=True)
            # promtool exits 3 for lint warnings only (e.g. naming advice); 1 for parse errors.
            check(lint.returncode in (0, 3), f"promtool check metrics: {lint.stdout}{lint.stderr}")
        else:
            print("SKIP (promtool part): promtool is not installed")

        # pdserve check with a prompt set that does not fit the 512-token context: one line says
        # so first, and the exit status is 2 (cannot judge), not 1. (Without --prompts it picks
        # the default set that fits, from /v1/models' max_model_len.)
        long_prompts = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "deploy", "check", "prompts.jsonl")
        run = subprocess.run([args.pdserve, "check", "--endpoint", base, "--samples", "1",
                              "--prompts", long_prompts],
                             capture_output=True, text=True, timeout=120)
        first = (run.stderr.splitlines() or [""])[0]
        check(run.returncode == 2 and first.startswith("error: 5 of 5 prompts do not fit the "
                                                       "model's context")
              and "--prompts deploy/check/kjv-prompts.jsonl" in first,
              f"check with prompts over the context: exit {run.returncode}, {first[:160]}")

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
