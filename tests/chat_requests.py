"""Chat request parts the Python tests share: a function tool and a conversation that called it
(OpenAI's shapes), for tool round trips through the fronts."""

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}

# The user's question, the assistant's call of get_weather, the tool's answer.
TOOL_ROUND_TRIP = [
    {"role": "user", "content": "What is the weather in Jerusalem?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Jerusalem"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
]
