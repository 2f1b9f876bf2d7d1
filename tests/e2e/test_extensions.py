"""Request extensions (6.1 ``extensions``): x-seed, x-top_p, x-stop; unknown names; bad values.

Priorities (``x-priority``) are in test_priority.py, the reasoning budget in test_reasoning.py.
"""

from typing import Any

import httpx
import pytest

from tests.support import assert_problem, body, collect

SAMPLED = {"temperature": 1.0, "max_output_tokens": 24}


async def text_of(client: httpx.AsyncClient, **fields: Any) -> str:
    response = await client.post("/lmsp/v1/responses", json=body(**fields))
    assert response.status_code == 200, response.text
    text: str = response.json()["output"][0]["content"][0]["text"]
    return text


async def stream_text(client: httpx.AsyncClient, **fields: Any) -> tuple[str, dict[str, Any]]:
    """The concatenated text deltas and the final event's data."""
    events = await collect(client, "POST", "/lmsp/v1/responses", json=body(stream=True, **fields))
    done = [e.data["item"] for e in events if e.event == "response.output_item.done"]
    text = "".join(e.data["delta"] for e in events if e.event == "response.output_text.delta")
    assert done[0]["content"][0]["text"] == text
    return text, events[-1].data


async def test_seed_reproduces_sampling(client: httpx.AsyncClient) -> None:
    first = await text_of(client, extensions={"x-seed": 1234}, **SAMPLED)
    again = await text_of(client, extensions={"x-seed": 1234}, **SAMPLED)
    other = await text_of(client, extensions={"x-seed": 4321}, **SAMPLED)
    assert first == again
    assert other != first
    streamed, _ = await stream_text(client, extensions={"x-seed": 1234}, **SAMPLED)
    assert streamed == first


async def test_tiny_top_p_is_greedy(client: httpx.AsyncClient) -> None:
    """With top_p near 0 only the most likely token is left, whatever the seed."""
    greedy = await text_of(client, max_output_tokens=24)
    for seed in (1, 2):
        assert await text_of(client, extensions={"x-top_p": 1e-9, "x-seed": seed}, **SAMPLED) == greedy


async def test_stop_cuts_before_the_stop_string(client: httpx.AsyncClient) -> None:
    full = await text_of(client, text="Stop me", max_output_tokens=40)
    assert len(full) > 30
    for stop in (full[12:17], [full[25:27], "never-generated", full[14:16]]):
        stops = [stop] if isinstance(stop, str) else stop
        cut = min(index for s in stops if (index := full.find(s)) >= 0)
        extensions = {"x-stop": stop}
        response = await client.post("/lmsp/v1/responses", json=body(text="Stop me", max_output_tokens=40,
                                                                       extensions=extensions))
        data = response.json()
        assert data["status"] == "completed" and data["incomplete_details"] is None
        assert data["output"][0]["content"][0]["text"] == full[:cut]
        assert data["usage"]["output_tokens"] < 40
        streamed, final = await stream_text(client, text="Stop me", max_output_tokens=40, extensions=extensions)
        assert streamed == full[:cut]
        assert final["status"] == "completed"
        assert final["usage"]["output_tokens"] == data["usage"]["output_tokens"]


async def test_stop_string_never_generated(client: httpx.AsyncClient) -> None:
    """Text held back as a possible stop string is released when generation ends otherwise."""
    full = await text_of(client, text="Stop me", max_output_tokens=40)
    stop = full[-3:] + "\u2603"  # the text ends with the start of this stop string
    streamed, final = await stream_text(client, text="Stop me", max_output_tokens=40, extensions={"x-stop": stop})
    assert streamed == full and final["status"] == "incomplete"


async def test_unknown_extensions_are_ignored_and_reported(client: httpx.AsyncClient) -> None:
    extensions = {"x-seed": 5, "x-unknown": {"a": 1}, "acme.cache": True, "x-caf\u00e9,%": 1}
    reported = "x-unknown, acme.cache, x-caf%C3%A9%2C%25"
    response = await client.post("/lmsp/v1/responses", json=body(max_output_tokens=3, extensions=extensions))
    assert response.status_code == 200
    assert response.headers["LMSP-Ignored-Extensions"] == reported
    task = await client.post("/lmsp/v1/tasks", json=body(max_output_tokens=3, extensions=extensions))
    assert task.status_code == 202 and task.headers["LMSP-Ignored-Extensions"] == reported
    async with client.stream("POST", "/lmsp/v1/responses",
                             json=body(max_output_tokens=3, stream=True, extensions=extensions)) as stream:
        assert stream.status_code == 200 and stream.headers["LMSP-Ignored-Extensions"] == reported
        await stream.aread()
    known = await client.post("/lmsp/v1/responses", json=body(max_output_tokens=3, extensions={"x-seed": 5}))
    assert "LMSP-Ignored-Extensions" not in known.headers


@pytest.mark.parametrize("extensions", [
    {"x-seed": "12"}, {"x-seed": -1}, {"x-seed": True}, {"x-seed": 2**64},
    {"x-top_p": 0}, {"x-top_p": 1.5}, {"x-top_p": "0.9"},
    {"x-stop": ""}, {"x-stop": []}, {"x-stop": ["a", "b", "c", "d", "e"]}, {"x-stop": "x" * 65}, {"x-stop": [1]},
    {"x-priority": "urgent"}, {"x-priority": 1},
])
async def test_bad_values_are_refused(client: httpx.AsyncClient, extensions: dict[str, Any]) -> None:
    for path, fields in (("/lmsp/v1/responses", {}), ("/lmsp/v1/responses", {"stream": True}),
                         ("/lmsp/v1/tasks", {})):
        problem = assert_problem(await client.post(path, json=body(extensions=extensions, **fields)),
                                 400, "invalid_extension")
        assert problem["errors"][0]["key"] == f"extensions.{next(iter(extensions))}"


async def test_extension_map_limits(client: httpx.AsyncClient) -> None:
    many = {f"x-{n}": n for n in range(65)}
    assert_problem(await client.post("/lmsp/v1/responses", json=body(extensions=many)), 400, "invalid_request")
    long_name = {"x-" + "n" * 127: 1}
    assert_problem(await client.post("/lmsp/v1/responses", json=body(extensions=long_name)), 400, "invalid_request")
