#!/usr/bin/env python3
"""A tool round trip through `pdserve up` (issue 29, proof): router, prefill and decode workers
(CPU backend) on the model given with --model, driven by two clients that nobody here wrote:

(a) the OpenAI python client's classic loop: `tools` + tool_choice "required" -> an assistant
    message with tool_calls -> the tool runs here -> its result goes back as a `tool` message ->
    a second request (tool_choice "auto") -> a text answer (finish_reason stop or length). Also
    SAMPLES seeds of tool_choice "required" at temperature 1.0 (every call names the declared
    function and its arguments validate with Python's jsonschema), a named function with
    parallel_tool_calls false (exactly one call of it), a streamed answer whose tool-call deltas
    join to the non-streamed calls of the same seed, and a schema pdserve cannot enforce
    ("minimum") refused with a 400 naming it.
(b) the OpenAI Agents SDK (openai-agents): Runner.run of an Agent with one function tool, its
    OpenAIChatCompletionsModel pointed at the router, ModelSettings(tool_choice="required"), and
    the SDK's default reset of tool_choice after a tool call, so its second request lets the
    model answer: the tool ran with arguments that validate against the schema the SDK sent, and
    the run ends with a final text output.

The model needs a context that holds DeepSeek's tools preamble (~570 tokens with the bundled
tokenizer): models/kjv-v4-wide. Exits 77 (ctest SKIP) when the model directory is missing or
openai, jsonschema or agents cannot be imported.
"""
import argparse
import asyncio
import json
import os
import sys
import tempfile
from typing import Literal

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from up_cluster import start_up, stop_up  # noqa: E402  (tests/up_cluster.py)
from checks import FAILURES, check  # noqa: E402  (tests/checks.py)

SAMPLES = 8
MAX_TOKENS = 400  # the block alone is ~250 bytes; the bundled tokenizer spells ｜ in 3 tokens

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "the city"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city", "parameters": WEATHER_SCHEMA}}]
QUESTION = [{"role": "user", "content": "What is the weather in Jerusalem?"}]


def get_weather(city, unit, days=1):
    """The tool, run here."""
    return f"{city}: 21 degrees {unit} for {days} day(s), clear sky"


def valid_calls(jsonschema, calls, names=("get_weather",)):
    """(all calls name a declared function with arguments that validate, why not)."""
    if not calls:
        return False, "no tool calls"
    for call in calls:
        if call.function.name not in names:
            return False, f"undeclared function {call.function.name!r}"
        try:
            jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
        except Exception as e:  # json.JSONDecodeError or jsonschema.ValidationError
            return False, f"{type(e).__name__}: {str(e)[:160]}: {call.function.arguments!r}"
    return True, ""


def required_samples(client, model, jsonschema):
    bad = []
    for seed in range(SAMPLES):
        r = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS,
                                           tool_choice="required", temperature=1.0,
                                           max_tokens=MAX_TOKENS, seed=100 + seed)
        choice = r.choices[0]
        ok, why = valid_calls(jsonschema, choice.message.tool_calls)
        if not ok or choice.finish_reason != "tool_calls" or choice.message.content:
            bad.append(f"seed {seed}: {choice.finish_reason} {why} {choice.message.content!r}")
    check(not bad, f"openai: {SAMPLES - len(bad)} / {SAMPLES} answers to tool_choice required at "
                   f"temperature 1.0 are tool calls whose arguments validate"
                   + "".join("\n    " + b for b in bad))


def classic_loop(client, model, jsonschema):
    messages = list(QUESTION)
    r = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                       tool_choice="required", temperature=1.0,
                                       max_tokens=MAX_TOKENS, seed=7)
    message = r.choices[0].message
    ok, why = valid_calls(jsonschema, message.tool_calls)
    check(ok and r.choices[0].finish_reason == "tool_calls",
          f"openai: the first answer is a tool call ({r.choices[0].finish_reason}) {why}")
    if not ok:
        return
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        result = get_weather(**json.loads(call.function.arguments))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    r = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                       tool_choice="auto", temperature=0.6,
                                       max_tokens=MAX_TOKENS, seed=7)
    choice = r.choices[0]
    check(choice.finish_reason in ("stop", "length") and bool(choice.message.content)
          and not choice.message.tool_calls and "｜DSML｜" not in choice.message.content,
          f"openai: after the tool result the answer is text ({choice.finish_reason}): "
          f"{(choice.message.content or '')[:80]!r}")


def named_and_streamed(client, model, jsonschema):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS,
                                       tool_choice=named, parallel_tool_calls=False,
                                       temperature=1.0, max_tokens=MAX_TOKENS, seed=11)
    calls = r.choices[0].message.tool_calls or []
    ok, why = valid_calls(jsonschema, calls)
    check(ok and len(calls) == 1, f"openai: a named function with parallel_tool_calls false is "
                                  f"one valid call ({len(calls)}) {why}")
    joined = {}
    finish = None
    for chunk in client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS,
                                                tool_choice="required", temperature=1.0,
                                                max_tokens=MAX_TOKENS, seed=12, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                entry = joined.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += (d.function.name or "") if d.function else ""
                entry["arguments"] += (d.function.arguments or "") if d.function else ""
    r = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS,
                                       tool_choice="required", temperature=1.0,
                                       max_tokens=MAX_TOKENS, seed=12)
    whole = [{"name": c.function.name, "arguments": c.function.arguments}
             for c in r.choices[0].message.tool_calls or []]
    check(finish == "tool_calls" and [joined[i] for i in sorted(joined)] == whole and whole,
          f"openai: streamed tool-call deltas join to the non-streamed calls ({len(whole)})")


def refused(client, model, openai):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}}}}]
    try:
        client.chat.completions.create(model=model, messages=QUESTION, tools=tools,
                                       tool_choice="required", max_tokens=8)
        check(False, "openai: a keyword the grammar cannot enforce is refused")
    except openai.BadRequestError as e:
        check("'minimum'" in str(e) and "#/properties/n" in str(e),
              f"openai: a keyword the grammar cannot enforce is a 400 naming it: {str(e)[:160]}")


def agents_run(base, model, openai, jsonschema, agents):
    agents.set_tracing_disabled(True)
    ran = []

    @agents.function_tool
    def lookup_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """The weather of a city.

        Args:
            city: the city.
            unit: celsius or fahrenheit.
        """
        ran.append({"city": city, "unit": unit})
        return get_weather(city, unit)

    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0,
                                timeout=300)
    agent = agents.Agent(
        name="weather", instructions="Answer with the weather.", tools=[lookup_weather],
        model=agents.OpenAIChatCompletionsModel(model=model, openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", temperature=1.0,
                                            max_tokens=MAX_TOKENS))
    result = asyncio.run(agents.Runner.run(agent, QUESTION[0]["content"], max_turns=4))
    schema = lookup_weather.params_json_schema
    ok = bool(ran)
    for args in ran:
        try:
            jsonschema.validate(args, schema)
        except jsonschema.ValidationError:
            ok = False
    check(ok, f"agents: Runner.run called the tool with arguments that validate: {ran}")
    final = result.final_output
    check(isinstance(final, str) and bool(final) and "｜DSML｜" not in final,
          f"agents: the run ends with a text answer: {str(final)[:80]!r}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pdserve", required=True)
    parser.add_argument("--model", required=True, help="model directory (4096-token context)")
    args = parser.parse_args()
    if not os.path.isdir(args.model):
        print(f"SKIP: {args.model} does not exist (the round trip needs a model whose context "
              "holds the tools preamble: models/kjv-v4-wide)")
        return 77
    try:
        import agents
        import jsonschema
        import openai
    except ImportError as e:
        print(f"SKIP: {e} (scripts/install-deps.sh installs openai, openai-agents and jsonschema "
              "into the venv)")
        return 77
    model = os.path.basename(os.path.normpath(args.model))
    with tempfile.TemporaryDirectory() as workdir:
        up, log, ports, line = start_up(args.pdserve, os.path.abspath(args.model), model, workdir)
        try:
            check("ready on" in line, f"pdserve up: {line.strip()}")
            base = f"http://127.0.0.1:{ports['http']}"
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0,
                                   timeout=300)
            classic_loop(client, model, jsonschema)
            required_samples(client, model, jsonschema)
            named_and_streamed(client, model, jsonschema)
            refused(client, model, openai)
            agents_run(base, model, openai, jsonschema, agents)
        finally:
            stop_up(up, log, show_log=bool(FAILURES))
    if FAILURES:
        print(f"{len(FAILURES)} failures")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
