"""The client commands (`lmsp run`, `chat`, `tasks`, `models`) as a user runs them, against the
session's service."""

import re
import subprocess
import sys

import httpx

from tests.support import ROOT, Api, Worker, run_lmsp, service_env


def lmsp(api: Api, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return run_lmsp(*args, env=service_env("redis://unused") | {"LMSP_URL": api.url}, stdin=stdin)


def stored_text(api: Api, task_id: str) -> str:
    task = httpx.get(f"{api.url}/lmsp/v1/tasks/{task_id}").json()
    return "".join(part["text"] for item in task["response"]["output"] for part in item["content"])


def test_run_streams_text_to_stdout_and_stats_to_stderr(api: Api, tiny_worker: Worker) -> None:
    direct = lmsp(api, "run", "-m", "tiny-random", "--max-output-tokens", "12", "Say", "hello")
    assert direct.returncode == 0, direct.stderr
    assert direct.stdout.strip() and "tok/s" not in direct.stdout
    stats = r"\[12 tokens in [\d.]+ s, [\d.]+ tok/s, first token after [\d.]+ s, prompt \d+ tokens"
    assert re.search(stats, direct.stderr)

    as_task = lmsp(api, "run", "--task", "-m", "tiny-random", "--max-output-tokens", "12", "-", stdin="Say hello")
    assert as_task.returncode == 0, as_task.stderr
    task_id = re.search(r"task (task_\w+)", as_task.stderr).group(1)  # type: ignore[union-attr]
    assert as_task.stdout == stored_text(api, task_id) + "\n"
    # greedy decoding: the same prompt gives the same text either way
    assert as_task.stdout == direct.stdout

    followed = lmsp(api, "tasks", "follow", task_id)
    assert followed.stdout == as_task.stdout
    listed = lmsp(api, "tasks", "list", "--limit", "5")
    assert listed.returncode == 0 and task_id in listed.stdout and listed.stdout.startswith("ID ")
    shown = lmsp(api, "tasks", "show", task_id)
    assert f'"id": "{task_id}"' in shown.stdout and '"status": "incomplete"' in shown.stdout


def test_run_shows_the_queue_position_and_cancel(api: Api, tiny_worker: Worker) -> None:
    waiting = subprocess.Popen([sys.executable, "-m", "lmsp.cli", "run", "--task", "-m", "tiny-unserved", "Hi"],
                               env=service_env("redis://unused") | {"LMSP_URL": api.url}, cwd=ROOT, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert waiting.stderr is not None
    first = waiting.stderr.readline()
    task_id = re.search(r"task (task_\w+)", first).group(1)  # type: ignore[union-attr]
    assert re.fullmatch(r"queued: position \d+\n", waiting.stderr.readline())
    cancelled = lmsp(api, "tasks", "cancel", task_id)
    assert cancelled.stdout == f"{task_id} cancelled\n"
    out, err = waiting.communicate(timeout=60)
    assert waiting.returncode == 1 and out == "" and "cancelled" in err


def test_errors_are_problem_codes_on_stderr(api: Api, tiny_worker: Worker) -> None:
    missing = lmsp(api, "run", "-m", "no-such-model", "Hi")
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr == "error: model_not_found: Model 'no-such-model' does not exist.\n"
    unknown = lmsp(api, "tasks", "show", "task_01J8M6Q4W2T7N5R3V9X1Z8B0DF")
    assert unknown.returncode == 1 and unknown.stderr.startswith("error: task_not_found:")
    down = lmsp(api, "models", "--url", "http://127.0.0.1:9")
    assert down.returncode == 1 and down.stderr.startswith("error: connection:")


def test_models_table(api: Api, tiny_worker: Worker) -> None:
    listed = lmsp(api, "models")
    assert listed.returncode == 0
    rows = {line.split()[0]: line.split() for line in listed.stdout.splitlines()[1:]}
    assert rows["tiny-random"][1:3] == ["available", "1"] and rows["tiny-unserved"][1:3] == ["unavailable", "0"]


def test_chat_keeps_the_conversation(api: Api, tiny_worker: Worker) -> None:
    chat = lmsp(api, "chat", "-m", "tiny-random", "--max-output-tokens", "6",
                stdin="First question\n\n/reset\nFirst question\nSecond question\n/exit\nnever sent\n")
    assert chat.returncode == 0, chat.stderr
    prompts = [int(n) for n in re.findall(r"prompt (\d+) tokens", chat.stderr)]
    assert len(prompts) == 3
    # after /reset the context starts over; the next turn carries the first one (full context)
    assert prompts[0] == prompts[1] and prompts[2] > prompts[1] + 4
