"""The patterns the OpenAPI document gives for values the server checks itself agree with those
checks: every value a pattern allows is accepted (schemathesis' "schema-valid request rejected"),
and the server refuses what it does not allow (its "schema-violating request accepted")."""

import re

from api.openai import batches as ob
from lmsp_core.wire.errors import InvalidRequest


def test_the_completion_window_pattern_is_what_a_batch_accepts() -> None:
    pattern = re.compile(ob.WINDOW_PATTERN)
    for unit in "smh":
        for number in range(100_000):
            for window in (f"{number}{unit}", f"0{number}{unit}"):
                try:
                    ob.window_seconds(window)
                    accepted = True
                except InvalidRequest:
                    accepted = False
                assert accepted == bool(pattern.fullmatch(window)), window
