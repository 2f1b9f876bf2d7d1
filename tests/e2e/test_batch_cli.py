"""`lmsp batch` as a user runs it, and the Python client's batches, against the session's service
(docs/protocol.md, "Batches")."""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from lmsp.client import AsyncClient, BadRequestError, Batch, NotFoundError, RequestCounts
from tests.support import ROOT, Api, Worker, run_lmsp, service_env

CHAT = "/v1/chat/completions"


def chat_line(custom_id: str, model: str = "tiny-random") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"model": model, "messages": [{"role": "user", "content": f"Say {custom_id}"}],
                     "max_tokens": 4}}


def jsonl(lines: list[Any]) -> bytes:
    return b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)


def custom_ids(content: bytes) -> list[str]:
    return sorted(json.loads(line)["custom_id"] for line in content.splitlines() if line.strip())


def command(api: Api, *args: str) -> list[str]:
    return [sys.executable, "-m", "lmsp.cli", *args, "--url", api.url]


def lmsp(api: Api, *args: str) -> subprocess.CompletedProcess[str]:
    return run_lmsp(*args, "--url", api.url, env=service_env("redis://unused"))


def in_progress(api: Api, batch_id: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(f"{api.url}/v1/batches/{batch_id}").json()["status"] != "in_progress":
        assert time.monotonic() < deadline, f"{batch_id} never started"
        time.sleep(0.05)


def test_batch_create_waits_and_saves_the_output(api: Api, tiny_worker: Worker, tmp_path: Path) -> None:
    source = tmp_path / "requests.jsonl"
    source.write_bytes(jsonl([chat_line(f"req-{n}") for n in range(20)]))
    created = lmsp(api, "batch", "create", str(source), "--endpoint", CHAT)
    assert created.returncode == 0, created.stderr
    summary = re.search(r"^(batch_\w+) completed: 20 completed, 0 failed of 20$", created.stdout, re.M)
    assert summary, created.stdout
    batch_id = summary.group(1)
    output = tmp_path / "requests.output.jsonl"
    assert f"output: {output}" in created.stdout
    assert custom_ids(output.read_bytes()) == sorted(f"req-{n}" for n in range(20))
    assert not (tmp_path / "requests.errors.jsonl").exists()
    # stderr is not a terminal: a plain line a change, the last one the batch's end
    assert created.stderr.splitlines()[-1] == f"{batch_id} completed: 20/20 done, 0 failed"

    listed = lmsp(api, "batch", "list", "--limit", "100")
    assert listed.returncode == 0 and listed.stdout.startswith("ID ")
    assert re.search(rf"^{batch_id}\s+completed\s+{CHAT}\s+20/20\s+0\s", listed.stdout, re.M), listed.stdout
    shown = lmsp(api, "batch", "show", batch_id)
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"^status\s+completed$", shown.stdout, re.M)
    assert re.search(r"^requests\s+20 total, 20 completed, 0 failed$", shown.stdout, re.M)
    assert re.search(r"^completed_at\s+\d{4}-", shown.stdout, re.M)
    missing = lmsp(api, "batch", "show", "batch_00000000000000000000000000")
    assert missing.returncode == 1 and "error: batch_not_found:" in missing.stderr


def _interruptible() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_leaves_the_batch_running_until_cancelled(api: Api, tmp_path: Path) -> None:
    # tiny-unserved never gets a worker: the batch's lines wait in the queue until it is cancelled
    source = tmp_path / "waiting.jsonl"
    source.write_bytes(jsonl([chat_line(f"w-{n}", model="tiny-unserved") for n in range(3)]))
    # Ctrl-C as from a terminal: a suite started in the background (`cmd &`) hands its children
    # SIGINT ignored, and Python then leaves it so
    with subprocess.Popen(command(api, "batch", "create", str(source), "--endpoint", CHAT), text=True,
                          env=service_env("redis://unused"), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          preexec_fn=_interruptible) as waiting:
        assert waiting.stderr is not None
        batch_id = re.search(r"^batch (batch_\w+) ", waiting.stderr.readline()).group(1)  # type: ignore[union-attr]
        assert waiting.stderr.readline().startswith(f"{batch_id} ")  # the first progress line: it is waiting
        in_progress(api, batch_id)  # its lines are tasks now (a batch cancelled while validating has none)
        waiting.send_signal(signal.SIGINT)
        try:
            _, err = waiting.communicate(timeout=30)
        finally:
            waiting.kill()
    assert waiting.returncode == 130 and f"lmsp batch show {batch_id}" in err

    shown = lmsp(api, "batch", "show", batch_id)
    assert re.search(r"^status\s+(validating|in_progress)$", shown.stdout, re.M), shown.stdout
    cancelled = lmsp(api, "batch", "cancel", batch_id)
    assert re.fullmatch(rf"{batch_id} (cancelling|cancelled)\n", cancelled.stdout), cancelled.stderr
    errors = tmp_path / "cancelled.errors.jsonl"
    waited = lmsp(api, "batch", "wait", batch_id, "--output", str(tmp_path / "none.jsonl"), "--errors", str(errors))
    assert waited.returncode == 1 and f"{batch_id} cancelled: 0 completed" in waited.stdout, waited.stderr
    assert custom_ids(errors.read_bytes()) == ["w-0", "w-1", "w-2"]
    assert {json.loads(line)["error"]["code"] for line in errors.read_bytes().splitlines()} == {"batch_cancelled"}


async def test_the_async_client_runs_a_batch(api: Api, tiny_worker: Worker) -> None:
    seen: list[Batch] = []
    lines = jsonl([chat_line(f"a-{n}") for n in range(5)] + [{**chat_line("wrong-url"), "url": "/v1/embeddings"}])
    async with AsyncClient(api.url) as client:
        result = await client.batches.run(lines, endpoint=CHAT, poll=0.2, on_progress=seen.append)
        # errors on /v1 are OpenAI's error objects: the same exceptions and codes as problem documents
        with pytest.raises(NotFoundError) as missing:
            await client.batches.get("batch_00000000000000000000000000")
        assert missing.value.code == "batch_not_found"
        with pytest.raises(BadRequestError) as refused:
            await client.batches.create(input_file_id=result.batch.input_file_id, endpoint="/v1/embeddings")
        assert (refused.value.code, refused.value.param) == ("unsupported_value", "endpoint")
        assert (await client.files.get(result.batch.input_file_id)).purpose == "batch"
    batch = result.batch
    assert batch.status == "completed" and batch.completed_at is not None
    assert batch.request_counts == RequestCounts(total=6, completed=5, failed=1)
    assert custom_ids(result.output) == [f"a-{n}" for n in range(5)]
    assert [json.loads(line)["error"]["code"] for line in result.errors.splitlines()] == ["invalid_url"]
    # each change was reported once, the last one the final batch
    assert seen[-1] == batch and len(seen) == len({(b.status, b.request_counts) for b in seen})
