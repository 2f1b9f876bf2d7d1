"""The shared prompt renderer matches transformers' apply_chat_template token for token."""

from pathlib import Path

import msgspec
from transformers import AutoTokenizer

from lmsp_core import wire
from lmsp_core.requests.catalog import SMOLLM2
from lmsp_core.requests.chat import PromptRenderer
from lmsp_core.settings import load_settings
from workers.model import loader


def test_renderer_matches_transformers_for_smollm2() -> None:
    tokenizer = AutoTokenizer.from_pretrained(loader.converted_gguf(SMOLLM2, Path(load_settings().model_cache)))
    card = loader.make_card(SMOLLM2, tokenizer, tokenizer.eos_token_id)
    items = msgspec.convert([
        {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Héllo 😀 "},
                                                       {"type": "input_text", "text": "world"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi!"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Again <|im_end|>"}]},
    ], list[wire.InputItem])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo 😀 world"},
                {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "Again <|im_end|>"}]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    renderer = PromptRenderer(card)
    assert renderer.render(items) == expected
    request = wire.ResponseRequest(model=SMOLLM2.id, input=items)
    assert renderer.prompt_ids(request) == tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert card.stop_token_ids == [tokenizer.eos_token_id]


# the tool handling of Qwen2.5's chat template (Hermes convention), abridged
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for tool_call in message.tool_calls %}
<tool_call>
{"name": "{{ tool_call.function.name }}", "arguments": {{ tool_call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_templates_that_know_tools_render_them_natively() -> None:
    tokenizer = AutoTokenizer.from_pretrained(loader.converted_gguf(SMOLLM2, Path(load_settings().model_cache)))
    card = msgspec.structs.replace(loader.make_card(SMOLLM2, tokenizer, tokenizer.eos_token_id),
                                   chat_template=HERMES_TEMPLATE)
    renderer = PromptRenderer(card)
    assert renderer.native_tools
    request = msgspec.convert({"model": "m", "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Lima?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Lima"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": '{"temperature_c": 21}'},
    ], "tools": [{"type": "function", "name": "get_weather", "description": "Weather.",
                  "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]},
        wire.ResponseRequest)
    prompt = renderer.render(request.input, request.tools)
    assert '"name": "get_weather"' in prompt.split("</tools>")[0]  # the definitions, by the template
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>' in prompt
    assert '<tool_response>\n{"temperature_c": 21}\n</tool_response>' in prompt
    assert "You can call functions" not in prompt  # no service-format block
    # a template without tools gets the service format
    plain = PromptRenderer(loader.make_card(SMOLLM2, tokenizer, tokenizer.eos_token_id))
    assert not plain.native_tools
    service = plain.render(request.input, request.tools)
    assert "You can call functions" in service
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Lima"}}</tool_call>' in service
    assert "<|im_start|>tool\n{\"temperature_c\": 21}<|im_end|>" in service
