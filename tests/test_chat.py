"""The shared prompt renderer matches transformers' apply_chat_template token for token."""

from pathlib import Path

import msgspec
from transformers import AutoTokenizer

from lmsp_core import wire
from lmsp_core.catalog import SMOLLM2
from lmsp_core.chat import PromptRenderer
from lmsp_core.settings import load_settings
from workers import loader


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
