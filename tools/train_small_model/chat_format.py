"""DeepSeek-V4 special tokens and chat format, as used by the bundled small model.

The strings and the layout follow DeepSeek-V4's own prompt encoder (encoding_dsv4.py shipped
with the DeepSeek-V4 checkpoints), restricted to what this model is trained on: system, user and
assistant turns, "chat" mode (no reasoning) and "thinking" mode (reasoning between <think> and
</think>). Tool calls, tasks and reminders are out of scope for the small model.

Layout (chat mode, one turn):
  <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜>
In thinking mode the generation prompt ends in <think> instead of </think>, and the answer turn is
{reasoning}</think>{answer}<｜end▁of▁sentence｜>.
"""

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"

# Ids 0..2 match DeepSeek-V3/V4 (BOS 0, EOS 1, pad 2); the role and think tokens come last.
SPECIAL_TOKENS = [BOS, EOS, PAD]
ROLE_TOKENS = [USER, ASSISTANT]
THINK_TOKENS = [THINK_START, THINK_END]

# Jinja form of render() for tokenizer_config.json. `thinking` (default false) selects the mode;
# in thinking mode only the turn after the last user message keeps its reasoning, as in
# encoding_dsv4.py with drop_thinking=True.
CHAT_TEMPLATE = (
    "{%- set thinking = thinking | default(false) -%}"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{{ bos_token }}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{{ m['content'] }}"
    "{%- elif m['role'] == 'user' -%}<｜User｜>{{ m['content'] }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] == 'assistant' -%}<｜Assistant｜>"
    "{%- if thinking and loop.index0 == ns.last_user -%}<think>{%- else -%}</think>{%- endif -%}"
    "{%- endif -%}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{%- if thinking and loop.index0 > ns.last_user -%}"
    "{{ m.get('reasoning_content', '') }}</think>{%- endif -%}"
    "{{ m['content'] }}<｜end▁of▁sentence｜>"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def render(messages, thinking=False):
    """Renders messages ([{"role", "content"[, "reasoning_content"]}]) as one prompt string.

    A trailing user message ends in the generation prompt (<｜Assistant｜> plus </think> or
    <think>). Raises ValueError on an unknown role.
    """
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    out = [BOS]
    for i, m in enumerate(messages):
        role = m["role"]
        if role == "system":
            out.append(m["content"])
        elif role == "user":
            out.append(USER + m["content"])
            is_last = i + 1 == len(messages)
            if is_last or messages[i + 1]["role"] == "assistant":
                out.append(ASSISTANT)
                out.append(THINK_START if thinking and i == last_user else THINK_END)
        elif role == "assistant":
            if thinking and i > last_user:
                out.append(m.get("reasoning_content", "") + THINK_END)
            out.append(m["content"] + EOS)
        else:
            raise ValueError(f"unknown role {role!r}")
    return "".join(out)
