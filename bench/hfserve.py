"""HF's own server, ``transformers serve --continuous-batching``, on the same model: the comparison
for concurrent streams. Used only when its dependencies are installed (``pip install -e .[bench]``)."""

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

from transformers.utils.import_utils import is_serve_available

from bench.sse import SseStream
from bench.stack import wait_port
from lmsp_core.ports import free_port
from lmsp_core.requests.catalog import SMOLLM2
from workers.model import loader

HOST = "127.0.0.1"


def available() -> bool:
    return bool(is_serve_available())


def model_dir(loaded: loader.LoadedModel, cache: Path, scratch: Path) -> Path:
    """A directory transformers can load the model from: the converted cache copy or a fresh save."""
    kind, _, location = loaded.spec.source.partition(":")
    if kind in ("gguf-package", "gguf-file"):
        return loader.converted_gguf(loaded.spec, cache)
    if kind == "hf-dir":
        return Path(location)
    from transformers import AutoTokenizer

    loaded.model.save_pretrained(scratch)
    AutoTokenizer.from_pretrained(loader.converted_gguf(SMOLLM2, cache)).save_pretrained(scratch)
    return scratch


class HfServe:
    def __init__(self, loaded: loader.LoadedModel, cache: Path, threads: int) -> None:
        self.scratch = Path(tempfile.mkdtemp(prefix="lmsp-bench-hf-"))
        self.path = model_dir(loaded, cache, self.scratch)
        self.port = free_port()
        self.threads = threads
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> "HfServe":
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads)}
        binary = Path(sys.executable).parent / "transformers"
        self.log = open(self.scratch / "serve.log", "wb")  # closed in __exit__
        self.process = subprocess.Popen(
            [str(binary), "serve", str(self.path), "--continuous-batching", "--host", HOST, "--port", str(self.port)],
            env=env, stdout=self.log, stderr=subprocess.STDOUT)
        wait_port(self.port, self.process, timeout=300)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()
        shutil.rmtree(self.scratch, ignore_errors=True)

    async def stream(self, text: str, max_tokens: int) -> int:
        """One streamed chat completion; its completion tokens."""
        body = json.dumps({"model": str(self.path), "messages": [{"role": "user", "content": text}],
                           "max_tokens": max_tokens, "temperature": 0, "stream": True}).encode()
        stream = SseStream(HOST, self.port, "POST", "/v1/chat/completions", body)
        tokens = 0
        async for _, events in stream.batches():
            for event in events:
                if event.data.startswith("{"):
                    usage = json.loads(event.data).get("usage")
                    tokens = usage["completion_tokens"] if usage else tokens
        return tokens

    async def aggregate(self, prompts: list[str], max_tokens: int) -> float:
        """Aggregate tokens/s of the prompts streamed at once."""
        start = time.perf_counter()
        counts = await asyncio.gather(*(self.stream(text, max_tokens) for text in prompts))
        return sum(counts) / (time.perf_counter() - start)
