"""The patterns the OpenAPI document gives for values the server checks itself agree with those
checks: every value a pattern allows is accepted (schemathesis' "schema-valid request rejected"),
and the server refuses what it does not allow (its "schema-violating request accepted")."""

import ipaddress
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.openai import batches as ob
from lmsp_core.requests import webhooks as checks
from lmsp_core.wire.errors import InvalidRequest

EXAMPLES = settings(max_examples=300, deadline=None, database=None, derandomize=True)


def test_the_completion_window_pattern_is_what_a_batch_accepts() -> None:
    pattern = re.compile(ob.WINDOW_PATTERN)
    # every number up to 2000, then a sample up to five digits, and the bounds of seconds
    numbers = [*range(2000), *range(2000, 100_000, 97), 85999, 86000, 86399, 86400, 86401, 99999]
    for unit in "smh":
        for number in numbers:
            for window in (f"{number}{unit}", f"0{number}{unit}"):
                try:
                    ob.window_seconds(window)
                    accepted = True
                except InvalidRequest:
                    accepted = False
                assert accepted == bool(pattern.fullmatch(window)), window


@EXAMPLES
@given(st.from_regex(checks.URL_PATTERN, fullmatch=True))
def test_every_url_the_pattern_allows_is_accepted(url: str) -> None:
    assert checks.check_url(url) == url


@EXAMPLES
@given(st.from_regex(r"^\[[0-9A-Fa-f:.]{2,45}\]$", fullmatch=True))
def test_the_pattern_allows_the_ipv6_literals_that_urlsplit_takes(host: str) -> None:
    try:
        ipaddress.IPv6Address(host[1:-1])
    except ValueError:
        valid = False
    else:
        valid = True
    assert valid == bool(re.fullmatch(checks.URL_PATTERN, f"http://{host}/x")), host


@pytest.mark.parametrize("url", ["http://[::]/", "http://[1:2:3:4:5:6:7:8]:8080/x", "http://[::ffff:1.2.3.4]/",
                                 "http://[1::]/", "https://receiver.example:00443/a?b=c", "http://a:/"])
def test_urls_of_every_form_are_allowed(url: str) -> None:
    assert re.fullmatch(checks.URL_PATTERN, url) and checks.check_url(url) == url
