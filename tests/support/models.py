"""The test models: tiny-random's variants as the models file gives them, the reasoning template of
the reasoning variant, the prompt a worker renders for them, and tiny model directories on disk as a
newcomer would point at (tests/e2e/test_model_paths.py, tests/unit/test_modelpaths.py)."""

import json
import shutil
from pathlib import Path
from typing import Any

import msgspec
import redis.asyncio as aioredis

from lmsp_core import wire
from lmsp_core.requests.chat import PromptRenderer
from lmsp_core.settings import load_settings
from lmsp_core.store import registry

# ChatML whose generation prompt opens a reasoning section (as DeepSeek-R1's does), and which renders
# the reasoning of an assistant turn that has some (as Qwen3's does for the current turn)
REASONING_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and message.get('reasoning_content') %}"
    "{{ '<|im_start|>assistant\\n<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n'"
    " + message['content'] + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}"
)
REASONING_BUDGET = 16


def tiny_spec(model_id: str, **fields: Any) -> dict[str, Any]:
    """A model spec with tiny-random's weights (the same seed, so the same greedy text), in float32 and
    uncompiled as every test model: the same tokens on any CPU, and no wait for a compiler."""
    return {"id": model_id, "source": "tiny-random", "context_window": 2048, "max_output_tokens": 1024,
            "capabilities": ["streaming"], "dtype": "float32", "compile": False} | fields


async def render(redis: aioredis.Redis, model: str, items: list[dict[str, Any]],
                 tools: list[dict[str, Any]] | None = None) -> tuple[str, int]:
    """The prompt the worker must have built for these items, and its length in tokens."""
    card = await registry.load_card(redis, model)
    assert card is not None
    request = msgspec.convert({"model": model, "input": items, "tools": tools}, wire.ResponseRequest)
    renderer = PromptRenderer(card)
    return renderer.render(request.input, request.tools), len(renderer.prompt_ids(request))


# models given by path
TINY_LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2}


def tiny_model_dir(path: Path, seed: int = 0, **config: Any) -> Path:
    """A transformers model directory as a newcomer would point at: tiny random Llama weights in
    safetensors (written with numpy: no torch in the test process) and the default model's tokenizer
    and chat template (as the API reads them from its files); ``config`` adds to config.json."""
    import numpy as np
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer

    from lmsp_core.requests import modelfiles
    from lmsp_core.requests.catalog import SMOLLM2

    card = modelfiles.card_from_files(SMOLLM2, Path(load_settings().model_cache))
    assert card is not None
    vocabulary = Tokenizer.from_str(card.tokenizer_json)
    size = vocabulary.get_vocab_size(with_added_tokens=True)
    settings = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": size,
                "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "hidden_act": "silu",
                "bos_token_id": vocabulary.token_to_id(card.bos_token or ""),
                "eos_token_id": vocabulary.token_to_id(card.eos_token or ""),
                **TINY_LLAMA, **config}
    hidden, inner = settings["hidden_size"], settings["intermediate_size"]
    kv = hidden // settings["num_attention_heads"] * settings["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (size, hidden), "model.norm.weight": (hidden,)}
    for i in range(settings["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        shapes |= {layer + "self_attn.q_proj.weight": (hidden, hidden), layer + "self_attn.k_proj.weight": (kv, hidden),
                   layer + "self_attn.v_proj.weight": (kv, hidden), layer + "self_attn.o_proj.weight": (hidden, hidden),
                   layer + "mlp.gate_proj.weight": (inner, hidden), layer + "mlp.up_proj.weight": (inner, hidden),
                   layer + "mlp.down_proj.weight": (hidden, inner), layer + "input_layernorm.weight": (hidden,),
                   layer + "post_attention_layernorm.weight": (hidden,)}
    random = np.random.default_rng(seed)
    # wide weights, as tiny-random's: peaked logits, greedy choices far from ties
    weights = {name: (np.ones(shape) if len(shape) == 1 else random.normal(0, 0.5, shape)).astype(np.float32)
               for name, shape in shapes.items()}
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(settings))
    (path / "tokenizer.json").write_text(card.tokenizer_json)
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "TokenizersBackend", "bos_token": card.bos_token, "eos_token": card.eos_token,
        "pad_token": card.eos_token, "chat_template": card.chat_template}))
    return path


def hf_cache(root: Path, repo: str, model: Path, revision: str = "0" * 40) -> Path:
    """``root`` laid out as huggingface_hub's cache (``HF_HUB_CACHE``) holding ``model``'s files as
    the snapshot ``revision`` of ``repo``, its main branch."""
    storage = root / f"models--{repo.replace('/', '--')}"
    shutil.copytree(model, storage / "snapshots" / revision)
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(revision)
    return root
