"""The playground page at `/` in headless Chromium (Debian's `chromium`, driven by Playwright):
it streams a task, resumes after its connection is cut or dropped, and ends with the stored text."""

import shutil
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.proxy import CuttingProxy
from tests.support import Api, Worker

playwright_api = pytest.importorskip("playwright.async_api")

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
pytestmark = pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian's chromium is not installed")


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Any]:
    async with playwright_api.async_playwright() as playwright:
        chromium = await playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        yield chromium
        await chromium.close()


def stored_text(api: Api, task_id: str) -> str:
    task = httpx.get(f"{api.url}/lmsp/v1/tasks/{task_id}").json()
    return "".join(part["text"] for item in task["response"]["output"] for part in item["content"])


async def start(page: Any, url: str, tokens: int, model: str = "tiny-random") -> None:
    await page.goto(url)
    await page.wait_for_selector(f"#model option[value='{model}']", state="attached")
    await page.select_option("#model", model)
    await page.fill("#prompt", "Tell me about queues.")
    await page.fill("#max-tokens", str(tokens))
    await page.click("#send")


async def finished(page: Any) -> str:
    await page.wait_for_function("['completed', 'incomplete'].includes(document.querySelector('#state').dataset.state)",
                                 timeout=120_000)
    task_id: str = await page.evaluate("document.body.dataset.taskId")
    return task_id


async def test_page_streams_through_a_connection_cut_mid_stream(browser: Any, api: Api, eager_worker: Worker) -> None:
    with CuttingProxy(api.port, cut_after=6000) as proxy:  # many small events: cut in several places
        page = await browser.new_page()
        await start(page, proxy.url + "/", 250, model="tiny-eager")
        task_id = await finished(page)
        assert proxy.cuts >= 2
        output = await page.text_content("#output")
        log = await page.text_content("#log")
        reconnects = int(await page.text_content("#reconnects") or 0)
        await page.screenshot(path="/tmp/lmsp-playground.png", full_page=True)
        await page.close()
    assert output == stored_text(api, task_id)
    assert reconnects >= 2 and "resuming with Last-Event-ID" in (log or "")


async def test_page_resumes_after_a_forced_drop_and_shows_the_service(browser: Any, api: Api, tiny_worker: Worker,
                                                                      variant_worker: Worker) -> None:
    page = await browser.new_page()
    # long enough to be running still when the page drops it (400 tokens of tiny-random at times ended
    # before the click, which then waited for a button that stays disabled)
    await start(page, api.url + "/", 4000, model="tiny-serial")
    await page.wait_for_function("Number(document.querySelector('#last-id').textContent) >= 5")
    await page.click("#drop")  # the page closes its stream; it must resume from the last id
    task_id = await finished(page)
    assert await page.text_content("#output") == stored_text(api, task_id)
    assert int(await page.text_content("#reconnects") or 0) >= 1
    assert "connection dropped after event" in (await page.text_content("#log") or "")
    # the service panel: tiny-random has a live worker, the worker list names it
    await page.wait_for_selector("#queues tr[data-model='tiny-random']")
    assert (await page.text_content("#queues tr[data-model='tiny-random'] td:nth-child(2)")) != "0"
    assert "tiny-random" in (await page.text_content("#workers") or "")
    await page.close()


async def test_page_shows_the_queue_position_from_the_comment_line(browser: Any, api: Api,
                                                                   tiny_worker: Worker) -> None:
    page = await browser.new_page()
    await page.goto(api.url + "/")
    await page.wait_for_selector("#model option[value='tiny-unserved']", state="attached")
    await page.select_option("#model", "tiny-unserved")  # no worker: the task waits in its queue
    await page.fill("#prompt", "Wait for me.")
    await page.click("#send")
    await page.wait_for_function("/^queued \\(position [1-9][0-9]*\\)$/.test(document.querySelector('#state')"
                                 ".dataset.state)")
    assert await page.text_content("#last-id") == "0"  # a comment is no event: the cursor did not move
    await page.click("#cancel")
    await page.wait_for_function("document.querySelector('#state').dataset.state === 'cancelled'")
    assert await page.text_content("#last-id") == "1"
    await page.close()
