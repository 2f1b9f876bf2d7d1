"""Problem documents (RFC 9457) as every refusal of the API must be."""

from typing import Any

import httpx

PROBLEM = "application/problem+json"


def assert_problem(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    assert response.headers["lmsp-version"] == "1.0"
    problem: dict[str, Any] = response.json()
    assert {"type", "title", "status", "detail", "code"} <= set(problem)
    assert problem["status"] == status and problem["code"] == code
    assert problem["type"] == f"urn:lmsp:problem:{code}"
    assert "Traceback" not in response.text
    return problem
