"""The bundled tool-aware chat template and the vLLM tool-calling flags (plugin engineer's files).

The template is rendered with transformers' own chat-template renderer, the one vLLM uses.
"""

from __future__ import annotations

import json

from transformers.utils.chat_template_utils import render_jinja_template

from trainer_service.config import BUNDLED_TOOL_TEMPLATE, TrainerSettings

SMOLLM2_OWN = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""SmolLM2-135M-Instruct's own chat template (from the bundled model's tokenizer)."""

ADD = {
    "type": "function",
    "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
}


def render(messages: list[dict], template: str, tools: list[dict] | None = None) -> str:
    rendered, _ = render_jinja_template([messages], chat_template=template, tools=tools, add_generation_prompt=True)
    return rendered[0]


def test_without_tools_it_equals_smollm2s_own_template() -> None:
    template = BUNDLED_TOOL_TEMPLATE.read_text()
    for messages in (
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
    ):
        assert render(messages, template) == render(messages, SMOLLM2_OWN)


def test_tools_calls_and_results_render_hermes_style() -> None:
    messages = [
        {"role": "user", "content": "3+4?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 3}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "7"},
        {"role": "tool", "tool_call_id": "c2", "content": "8"},
    ]
    text = render(messages, BUNDLED_TOOL_TEMPLATE.read_text(), tools=[ADD])
    assert "<tools>\n" + json.dumps(ADD) + "\n</tools>" in text
    assert text.endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 3}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n7\n</tool_response>\n<tool_response>\n8\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_tool_calling_flags_default_to_the_bundled_template_and_hermes() -> None:
    assert TrainerSettings().tool_calling_args() == [
        "--chat-template", str(BUNDLED_TOOL_TEMPLATE), "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    ]  # fmt: skip
    assert TrainerSettings(base_model="/models/qwen").tool_calling_args() == []
    assert TrainerSettings(base_model="/models/qwen", tool_call_parser="hermes").tool_calling_args() == [
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    ]  # fmt: skip
    assert TrainerSettings(chat_template="model", tool_call_parser="none").tool_calling_args() == []
    assert TrainerSettings(chat_template="/t.jinja").tool_calling_args()[:2] == ["--chat-template", "/t.jinja"]


def test_structured_outputs_are_compact_unless_any_whitespace_is_asked() -> None:
    flag, value = TrainerSettings().structured_output_args()
    assert flag == "--structured-outputs-config"
    assert json.loads(value) == {"backend": "xgrammar", "disable_any_whitespace": True}
    assert TrainerSettings(json_whitespace="any").structured_output_args() == []
