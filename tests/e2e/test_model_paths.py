"""Models given by path or Hugging Face name to `lmsp worker` and `lmsp api` (`lmsp up` with a GGUF
file: tests/e2e/test_cli.py), and the one-line refusal of what is no model."""

import os
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import pytest_asyncio

from lmsp_core.requests import modelfiles
from lmsp_core.requests.catalog import SMOLLM2
from lmsp_core.settings import load_settings
from tests.support import ROOT, Api, RedisServer, Worker, body, hf_cache, start_all, tiny_model_dir

CACHE = Path(load_settings().model_cache)
REPO = "test-org/tiny-chat"  # as huggingface_hub's cache holds it, never asked of the Hub


@pytest.fixture(scope="module")
def models() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="lmsp-models-") as directory:
        yield Path(directory)


@pytest.fixture(scope="module")
def hub(models: Path) -> dict[str, str]:
    """The environment of processes that find ``hf:test-org/tiny-chat`` offline in a prepared cache."""
    cache = hf_cache(models / "hub", REPO, tiny_model_dir(models / "tiny-chat"))
    return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


@pytest_asyncio.fixture(scope="module")
async def hub_model(redis_server: RedisServer, hub: dict[str, str]) -> AsyncIterator[str]:
    """An API and a worker, each given ``hf:test-org/tiny-chat`` and the same flags, as two hosts would be."""
    flags = ["--model", f"hf:{REPO}", "--context-window", "512", "--dtype", "float32"]
    worker, api = Worker(redis_server.url, []), Api(redis_server.url)
    worker.args += flags
    api.args += flags
    for process in (worker, api):
        process.env |= hub
    try:
        await start_all(worker, api)  # side by side
        yield api.url
    finally:
        worker.stop()
        api.stop()


async def test_a_model_from_the_hugging_face_cache_serves_under_its_name(hub_model: str) -> None:
    """Served as ``ORG/NAME``, as vLLM serves it: the model routes take the slash, the openai client too."""
    async with httpx.AsyncClient(base_url=hub_model, timeout=60) as client:
        model = (await client.get(f"/lmsp/v1/models/{REPO}")).json()
        assert (model["id"], model["status"], model["context_window"], model["max_output_tokens"]) == (
            REPO, "available", 512, 256)
        response = await client.post("/lmsp/v1/responses", json=body(REPO, max_output_tokens=4))
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["output_tokens"] == 4
        # what the API counted from the tokenizer it read is what the worker was given
        chat = await client.post("/v1/chat/completions", json={
            "model": REPO, "max_tokens": 4, "messages": [{"role": "user", "content": "Hello there"}]})
        assert chat.json()["usage"]["prompt_tokens"] == response.json()["usage"]["input_tokens"]
        missing = await client.get("/v1/models/test-org/none")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    sdk = openai.AsyncOpenAI(base_url=f"{hub_model}/v1", api_key="unused", max_retries=0)
    try:
        assert (await sdk.models.retrieve(REPO)).id == REPO
    finally:
        await sdk.close()


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    """The default model as a Hugging Face directory: the copy a worker converts from its GGUF (made here
    on a machine where no worker has yet)."""
    target = modelfiles.converted_dir(SMOLLM2, CACHE)
    if not (target / "model.safetensors").exists():
        script = ("import sys; from pathlib import Path; from workers.model import loader; "
                  "from lmsp_core.requests.catalog import SMOLLM2; loader.converted_gguf(SMOLLM2, Path(sys.argv[1]))")
        subprocess.run([sys.executable, "-c", script, str(CACHE)], cwd=ROOT, check=True, timeout=600)
    return target


@pytest.mark.smollm2
async def test_a_model_directory_serves_with_the_flags_over_its_files(redis_server: RedisServer,
                                                                      smollm2_dir: Path) -> None:
    flags = ["--model", str(smollm2_dir), "--model-id", "smol-dir", "--context-window", "4096"]
    worker, api = Worker(redis_server.url, []), Api(redis_server.url)
    worker.args += flags
    api.args += flags
    try:
        await start_all(worker, api, timeout=300)  # side by side
        async with httpx.AsyncClient(base_url=api.url, timeout=120) as client:
            model = (await client.get("/lmsp/v1/models/smol-dir")).json()
            assert (model["status"], model["context_window"]) == ("available", 4096), model
            response = await client.post("/lmsp/v1/responses", json=body(
                "smol-dir", "What is the capital of France?", max_output_tokens=16, temperature=0))
            assert response.status_code == 200, response.text
            assert "Paris" in response.json()["output"][0]["content"][0]["text"]
    finally:
        worker.stop()
        api.stop()


def refusal(command: str, reference: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lmsp.cli", command, "--model", reference], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("command", ["worker", "up", "api"])
def test_what_is_no_model_is_refused_in_one_line(command: str, models: Path, hub: dict[str, str]) -> None:
    not_gguf = models / "notes.gguf"
    not_gguf.write_text("not a model")
    (models / "empty").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMSP_")} | hub
    env["XDG_DATA_HOME"] = str(models / "data")  # lmsp up's Redis, were it started
    cases = {
        str(models / "missing"): "no such file or directory, and no model of the catalog has this id",
        str(models / "empty"): "a directory without config.json, so not a Hugging Face model directory",
        str(not_gguf): "not a GGUF file",
        "hf:test-org/absent": "outgoing traffic has been disabled",  # offline, and not in the cache
    }
    for reference, message in cases.items():
        ran = refusal(command, reference, env)
        assert ran.returncode == 2, ran.stderr
        assert ran.stderr.startswith(f"lmsp {command}: ") and message in ran.stderr, ran.stderr
        assert ran.stderr.count("\n") == 1 and ran.stdout == "", ran.stderr
    assert not (models / "data").exists()  # refused before anything started


@pytest.mark.parametrize("command", ["worker", "up"])
def test_a_truncated_gguf_file_is_refused_in_one_line(command: str, models: Path, hub: dict[str, str]) -> None:
    """A download cut short: its header whole, its tensors not; refused before anything starts or is cached."""
    cut = models / "cut.gguf"
    cut.write_bytes(modelfiles.gguf_file(SMOLLM2).read_bytes()[:20_000_000])
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMSP_")} | hub
    env["XDG_DATA_HOME"], env["LMSP_MODEL_CACHE"] = str(models / "data"), str(models / "cache")
    ran = refusal(command, str(cut), env)
    assert ran.returncode == 2, ran.stderr
    assert ran.stderr.startswith(f"lmsp {command}: {cut}: the file ends inside tensor ") and "truncated" in ran.stderr
    assert ran.stderr.count("\n") == 1 and ran.stdout == "", ran.stderr
    assert not (models / "data").exists() and not (models / "cache").exists()


async def test_a_k_quant_gguf_file_serves_on_its_blocks(redis_server: RedisServer, models: Path) -> None:
    """`--model FILE.gguf` of Q4_K_M's mix end to end: the worker maps the file and answers; nothing but
    the tokenizer and config lands in the model cache."""
    from tests.engine import ggufmodels

    path = ggufmodels.write(models / "tiny-q4_k_m.gguf", types={"attn_v": ggufmodels.Q.Q6_K,
                                                                 "ffn_down": ggufmodels.Q.Q6_K})
    flags = ["--model", str(path), "--context-window", "512"]
    worker, api = Worker(redis_server.url, []), Api(redis_server.url)  # the session's cache: its kernels built
    worker.args += flags
    api.args += flags
    try:
        await start_all(worker, api, timeout=300)  # side by side
        async with httpx.AsyncClient(base_url=api.url, timeout=120) as client:
            response = await client.post("/lmsp/v1/responses", json=body(
                "tiny-q4_k_m", "Hello", max_output_tokens=8, temperature=0))
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["output_tokens"] >= 1
    finally:
        worker.stop()
        api.stop()
    assert "served on the blocks of tiny-q4_k_m.gguf" in worker.output()
    kept = next(Path(load_settings().model_cache, "models").glob("tiny-q4_k_m-*"))
    assert (kept / "tokenizer.json").exists() and not list(kept.glob("*.safetensors"))
