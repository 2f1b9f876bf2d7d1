"""The benchmark's report: one table of figures against their baselines, and small helpers shared by
its sections."""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

TOPICS = ["a lighthouse keeper", "a lost violin", "the first winter on Mars", "a clockmaker's apprentice",
          "a river that ran backwards", "a library at the bottom of the sea", "a robot learning to paint",
          "two rival bakers"]


def prompt_text(i: int) -> str:
    return f"Write a long story about {TOPICS[i % len(TOPICS)]} (number {i}). Use many details."


def fresh_prompt_text(i: int) -> str:
    """A README-length question that no earlier one begins like (after the chat template's start)."""
    return f"{i}: describe a local model service in one sentence."


def user_input(text: str) -> list[dict[str, Any]]:
    return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}]


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


@dataclass
class Table:
    rows: list[tuple[str, str, str, str, str]] = field(default_factory=list)
    head: tuple[str, str, str, str, str] = ("measure", "service", "baseline", "ratio", "target")
    echo: bool = True  # print each row as it is added (a long run's progress)

    def add(self, measure: str, service: str, baseline: str = "", ratio: str = "", target: str = "") -> None:
        self.rows.append((measure, service, baseline, ratio, target))
        if self.echo:
            print(f"  {measure}: {service}  {baseline}  {ratio}", flush=True)

    def render(self) -> str:
        head = self.head
        widths = [max(len(row[i]) for row in [head, *self.rows]) for i in range(5)]
        lines = [" | ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
                 for row in [head, *self.rows]]
        lines.insert(1, "-+-".join("-" * width for width in widths))
        return "\n".join(lines)


def ratio(service: float, baseline: float) -> str:
    return f"{service / baseline:.2f}" if baseline else "-"


@dataclass
class Measured:
    """What later sections compare with: TTFT p50 (ms), aggregate tokens/s (the comparison with
    llama.cpp measures its own one-stream rate, alternating with llama.cpp's)."""

    ttft_ms: float = 0.0  # the same prompt again (all of it but its last token cached)
    ttft_fresh_ms: float = 0.0  # a new prompt each time (the chat template's start cached)
    rates: dict[int, float] = field(default_factory=dict)
