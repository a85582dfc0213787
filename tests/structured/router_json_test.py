#!/usr/bin/env python3
"""Constrained JSON output through the router (issue 29, proof): `pdserve up` on
deploy/local.yaml (its ports replaced by free ones, the model path made absolute: real router,
prefill and decode processes, CPU backend, the bundled model), and the colocated `pdserve serve`.

- For each of the 20 schemas in tests/structured/schemas.json, 8 samples at temperature 1.0 via
  the OpenAI python client with response_format json_schema (strict): every output parses and
  validates with Python's jsonschema. In PD mode the prefill worker samples the first token and
  the decode worker the rest, so both apply the mask.
- json_object: the output parses to an object; a streamed json_schema answer's deltas join to a
  valid document.
- A schema with a keyword pdserve cannot enforce ("pattern") gets a 400 naming it.
- The colocated server: each schema twice, same checks.

Exits 77 (ctest SKIP) when openai or jsonschema cannot be imported.
"""
import argparse
import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from child_process import popen  # noqa: E402  (tests/child_process.py)
from test_ports import free_port  # noqa: E402  (tests/test_ports.py)
from checks import FAILURES, check  # noqa: E402  (tests/checks.py)

SAMPLES = 8
MAX_TOKENS = 128


def local_config(repo, model_dir, workdir):
    """deploy/local.yaml with free ports and an absolute model path."""
    with open(os.path.join(repo, "deploy", "local.yaml")) as f:
        text = f.read()
    ports = {}
    text = re.sub(r"(\b(?:http_port|port|metrics_port): )(\d+)",
                  lambda m: m.group(1) + str(ports.setdefault(m.group(2), free_port())), text)
    text = re.sub(r"(\n  path: ).*", lambda m: m.group(1) + model_dir, text)
    path = os.path.join(workdir, "local.yaml")
    with open(path, "w") as f:
        f.write(text)
    http = int(re.search(r"http_port: (\d+)", text).group(1))
    return path, http


def wait_ready(proc, marker, seconds):
    deadline = time.time() + seconds
    line = ""
    while time.time() < deadline and marker not in line:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
    return line


def sample(client, model, entry, seed, stream=False):
    fmt = {"type": "json_schema",
           "json_schema": {"name": entry["name"], "schema": entry["schema"], "strict": True}}
    messages = [{"role": "user", "content": f"Answer as JSON: {entry['name']} of the story"}]
    if not stream:
        r = client.chat.completions.create(model=model, messages=messages, response_format=fmt,
                                           temperature=1.0, max_tokens=MAX_TOKENS, seed=seed)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(model=model, messages=messages,
                                                response_format=fmt, temperature=1.0,
                                                max_tokens=MAX_TOKENS, seed=seed, stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


def validates(jsonschema, schema, text):
    try:
        jsonschema.validate(json.loads(text), schema)
        return True, ""
    except Exception as e:  # json.JSONDecodeError or jsonschema.ValidationError
        return False, f"{type(e).__name__}: {str(e)[:200]}"


def run_schemas(openai, jsonschema, base, model, schemas, samples, label):
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
    jobs = [(entry, seed) for entry in schemas for seed in range(samples)]
    bad = []
    finishes = {}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = pool.map(lambda job: (job, sample(client, model, job[0], 1000 + job[1])), jobs)
        for (entry, seed), (text, finish) in results:
            ok, why = validates(jsonschema, entry["schema"], text)
            finishes[finish] = finishes.get(finish, 0) + 1
            if not ok:
                bad.append(f"{entry['name']} seed {seed}: {why}: {text!r}")
    check(not bad, f"{label}: {len(jobs) - len(bad)} / {len(jobs)} outputs of {len(schemas)} "
                   f"schemas parse and validate (finish reasons {finishes})"
                   + ("".join("\n    " + b for b in bad[:10])))
    return client


def run_extras(openai, jsonschema, client, model, schemas, label):
    text, finish = sample(client, model, schemas[17], 5, stream=True)
    ok, why = validates(jsonschema, schemas[17]["schema"], text)
    check(ok, f"{label}: a streamed answer joins to a valid document ({finish}) {why}")
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "JSON please"}],
        response_format={"type": "json_object"}, temperature=1.0, max_tokens=MAX_TOKENS, seed=3)
    text = r.choices[0].message.content
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        parsed = None
    check(isinstance(parsed, dict), f"{label}: json_object gives an object: {text[:80]!r}")
    try:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {
                "name": "p", "schema": {"type": "object", "properties": {
                    "id": {"type": "string", "pattern": "^[a-z]+$"}}}}})
        check(False, f"{label}: an unsupported keyword is refused")
    except openai.BadRequestError as e:
        message = str(e)
        check("'pattern'" in message and "#/properties/id" in message,
              f"{label}: an unsupported keyword is a 400 naming it: {message[:160]}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pdserve", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--repo", required=True)
    args = parser.parse_args()
    try:
        import jsonschema
        import openai
    except ImportError as e:
        print(f"SKIP: {e} (scripts/install-deps.sh installs openai and jsonschema into the venv)")
        return 77
    with open(os.path.join(args.repo, "tests", "structured", "schemas.json")) as f:
        schemas = json.load(f)
    model = "kjv-v4-tiny"
    with tempfile.TemporaryDirectory() as workdir:
        config, http = local_config(args.repo, os.path.abspath(args.model), workdir)
        log = open(os.path.join(workdir, "up.log"), "w+")
        up = popen([args.pdserve, "up", "--config", config], stdout=subprocess.PIPE, stderr=log,
                   text=True)
        try:
            line = wait_ready(up, "ready on", 120)
            check("ready on" in line, f"pdserve up: {line.strip()}")
            base = f"http://127.0.0.1:{http}"
            client = run_schemas(openai, jsonschema, base, model, schemas, SAMPLES, "router")
            run_extras(openai, jsonschema, client, model, schemas, "router")
        finally:
            up.send_signal(signal.SIGINT)  # `pdserve up` stops its children on Ctrl-C
            up.wait(60)
            if FAILURES:
                log.seek(0)
                print("pdserve up log (tail):\n" + log.read()[-3000:])
        server = popen([args.pdserve, "serve", "--model", args.model, "--port", "0",
                        "--max-batch", "8"], stdout=subprocess.PIPE, text=True)
        try:
            line = wait_ready(server, "listening on", 60)
            check("listening on" in line, f"pdserve serve: {line.strip()}")
            base = line.strip().rsplit(" ", 1)[1]
            client = run_schemas(openai, jsonschema, base, model, schemas, 2, "colocated")
            run_extras(openai, jsonschema, client, model, schemas, "colocated")
        finally:
            server.terminate()
            server.wait(30)
    if FAILURES:
        print(f"{len(FAILURES)} failures")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
