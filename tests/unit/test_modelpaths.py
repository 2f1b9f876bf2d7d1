"""Models given by path: the spec a directory's or a GGUF file's own files give, the flags over it,
reasoning markers found in a tokenizer, and one-line errors for what is no model (no process runs:
tests/e2e/test_model_paths.py serves them)."""

import json
import os
import shutil
from pathlib import Path

import msgspec
import pytest
from tokenizers import AddedToken, Tokenizer

from lmsp_core.requests import modelfiles, modelpaths
from lmsp_core.requests.catalog import SMOLLM2, Catalog, ModelSpec
from lmsp_core.requests.modelpaths import ModelRefError, Overrides
from lmsp_core.settings import Settings, load_settings
from tests.support import REASONING_TEMPLATE, tiny_model_dir

CACHE = Path(load_settings().model_cache)
CATALOG = Catalog.from_settings(Settings())
GGUF = modelfiles.package_file(SMOLLM2.source.partition(":")[2])
# Qwen3's way: the template renders past reasoning and closes it, the model opens a section itself
MODEL_OPENS = REASONING_TEMPLATE.replace("'<|im_start|>assistant\\n<think>\\n'", "'<|im_start|>assistant\\n'")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("models") / "tiny-chat", max_position_embeddings=4096)


def resolve(reference: str | Path, overrides: Overrides | None = None, weights: bool = True) -> ModelSpec:
    return modelpaths.resolve(str(reference), CATALOG, overrides or Overrides(), CACHE, weights)


def test_a_directory_serves_under_its_name_with_its_context_window(tiny: Path) -> None:
    spec = resolve(tiny)
    assert spec.id == "tiny-chat" and spec.source == f"hf-dir:{tiny}"
    assert (spec.context_window, spec.max_output_tokens) == (4096, 2048)
    assert spec.capabilities == ["streaming", "tools", "structured_output", "conversations"]
    assert spec.reasoning is None and spec.chat_template is None  # the tokenizer's template
    # the card the API reads from the files is the one a worker would publish
    card = modelfiles.card_from_files(spec, CACHE)
    assert card is not None and card.chat_template == modelfiles.dir_chat_template(tiny)


def test_flags_override_the_files(tiny: Path, tmp_path: Path) -> None:
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    overrides = Overrides(id="mine", context_window=256, max_batch_size=4, dtype="float32",
                          chat_template=modelpaths.read_template(str(template)))
    spec = resolve(tiny, overrides)
    assert (spec.id, spec.context_window, spec.max_output_tokens, spec.max_batch_size, spec.dtype) == (
        "mine", 256, 128, 4, "float32")
    assert spec.chat_template == template.read_text()
    # a catalog id takes the same flags; its output cap stays inside the window
    catalog_spec = resolve("tiny-random", Overrides(context_window=64))
    assert (catalog_spec.source, catalog_spec.context_window, catalog_spec.max_output_tokens) == ("tiny-random", 64, 64)


def test_a_gguf_file_serves_under_its_stem_with_its_metadata() -> None:
    spec = resolve(GGUF)
    assert spec.id == "SmolLM2-135M-Instruct.Q4_1" and spec.source == f"gguf-file:{GGUF}"
    assert (spec.context_window, spec.max_output_tokens) == (8192, 4096)
    fields = modelfiles.gguf_fields(GGUF, lambda key: key.startswith("llama.") or key == "tokenizer.ggml.tokens")
    assert fields["llama.context_length"] == 8192 and fields["llama.block_count"] == 30
    assert len(fields["tokenizer.ggml.tokens"]) == 49152
    # the same tokenizer and template as the packaged default model, whichever files it comes from
    ours, packaged = modelfiles.card_from_files(spec, CACHE), modelfiles.card_from_files(SMOLLM2, CACHE)
    assert ours is not None and packaged is not None
    assert msgspec.structs.replace(ours, model_id=SMOLLM2.id, tokenizer_json="") == msgspec.structs.replace(
        packaged, tokenizer_json="")


def test_a_gguf_file_is_converted_once_per_file(tmp_path: Path) -> None:
    """Two files of one name, or one file replaced, are converted each into a copy of its own."""
    first, second = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    for path in (first, second):
        path.parent.mkdir()
        path.write_bytes(b"GGUF")

    def converted(path: Path) -> Path:
        return modelfiles.converted_dir(ModelSpec(id="same", source=f"gguf-file:{path}", context_window=64,
                                                  max_output_tokens=8, capabilities=[]), CACHE)

    before = converted(first)
    assert before != converted(second) and before.name.startswith("model-")
    os.utime(first, ns=(1, 1))
    assert converted(first) != before


@pytest.mark.parametrize(("template", "opened_by"), [(REASONING_TEMPLATE, "template"), (MODEL_OPENS, "model")])
def test_reasoning_markers_in_the_vocabulary_make_a_reasoning_model(tiny: Path, tmp_path: Path, template: str,
                                                                    opened_by: str) -> None:
    reasoning = shutil.copytree(tiny, tmp_path / "thinker")
    tokenizer = Tokenizer.from_file(str(reasoning / "tokenizer.json"))
    assert resolve(reasoning, Overrides(chat_template=template)).reasoning is None  # no such tokens yet
    tokenizer.add_special_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tokenizer.save(str(reasoning / "tokenizer.json"))
    config = json.loads((reasoning / "tokenizer_config.json").read_text())
    (reasoning / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": template}))
    found = resolve(reasoning).reasoning
    assert found is not None and (found.start, found.end, found.opened_by) == ("<think>", "</think>", opened_by)


def test_the_api_needs_no_weights(tiny: Path, tmp_path: Path) -> None:
    tokenizer_only = shutil.copytree(tiny, tmp_path / "tiny-chat", ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(ModelRefError, match=r"no weights \(\*\.safetensors\)$"):
        resolve(tokenizer_only)
    assert resolve(tokenizer_only, weights=False).id == "tiny-chat"


def test_what_is_no_model_is_said_in_one_line(tiny: Path, tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("not a model")
    bare = shutil.copytree(tiny, tmp_path / "bare")
    (bare / "tokenizer_config.json").write_text("{}")
    config = json.loads((tiny / "config.json").read_text())
    windowless = shutil.copytree(tiny, tmp_path / "windowless")
    (windowless / "config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                        if k != "max_position_embeddings"}))
    cases = {
        str(tmp_path / "missing"): "no such file or directory, and no model of the catalog has this id",
        str(tmp_path): "a directory without config.json, so not a Hugging Face model directory",
        str(text): "not a GGUF file",
        str(bare): "no chat template",
        str(windowless): "its files give no context window; give one with --context-window N",
    }
    for reference, message in cases.items():
        with pytest.raises(ModelRefError) as raised:
            resolve(reference)
        assert message in str(raised.value) and "\n" not in str(raised.value), reference
    assert resolve(windowless, Overrides(context_window=512)).context_window == 512
    with pytest.raises(ModelRefError, match="Expected `int` >= 16"):
        resolve(tiny, Overrides(context_window=8))
    with pytest.raises(ModelRefError, match="--model-id names one model"):
        modelpaths.resolve_all([str(tiny), "tiny-random"], CATALOG, Overrides(id="x"), CACHE)
    with pytest.raises(ModelRefError, match="two models would be served as 'tiny-chat'"):
        modelpaths.resolve_all([str(tiny), str(shutil.copytree(tiny, tmp_path / "copy" / "tiny-chat"))], CATALOG,
                               Overrides(), CACHE)


def test_the_specs_reach_every_process_through_the_settings(tiny: Path) -> None:
    settings = Settings()
    assert modelpaths.with_specs(settings, CATALOG, [resolve("tiny-random")]) is settings  # nothing new
    named = modelpaths.with_specs(settings, CATALOG, [resolve(tiny), resolve("tiny-random", Overrides(dtype="float32",
                                                                                                   max_batch_size=2))])
    # what a child process (lmsp up's worker) reads from its environment
    catalog = Catalog.from_settings(load_settings(named.models_env()))
    assert catalog.get("tiny-chat") == resolve(tiny)
    assert catalog.get("tiny-random").max_batch_size == 2 and catalog.get(SMOLLM2.id) == SMOLLM2


def test_the_listings_show_the_models_given_or_run(tmp_path: Path) -> None:
    """docs/protocol.md, "Which models are listed": the built-in models only while a worker runs them,
    the specs given to the API always, and what LMSP_LISTED_MODELS names."""
    bare = Catalog.from_settings(Settings())
    assert bare.listed(set()) == []
    assert [spec.id for spec in bare.listed({"tiny-random", "not-in-this-catalog"})] == ["tiny-random"]
    models = tmp_path / "models.json"
    models.write_text(json.dumps([{"id": "tiny-given", "source": "tiny-random", "context_window": 64,
                                   "max_output_tokens": 8, "capabilities": []}]))
    given = Catalog.from_settings(Settings(models_file=str(models), listed_models=" llama-8b-random,"))
    assert [spec.id for spec in given.listed(set())] == ["llama-8b-random", "tiny-given"]
    assert [spec.id for spec in given.listed({SMOLLM2.id})] == [SMOLLM2.id, "llama-8b-random", "tiny-given"]
    assert len(Catalog.from_settings(Settings(listed_models="*")).listed(set())) == 3
    with pytest.raises(ValueError, match="the catalog does not have: nope"):
        Catalog.from_settings(Settings(listed_models="tiny-random,nope"))
