"""The benchmark command runs end to end (its short form, on tiny-random); its figures are not
judged here: speed is measured by running it (docs/performance.md), never in tests."""

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT


def test_throughput_benchmark_runs_and_reports_every_figure() -> None:
    result = subprocess.run([sys.executable, "-m", "bench.throughput", "--quick", "--model", "tiny-random",
                             "--threads", "1"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = result.stdout.split("\n\n")[-1]
    for row in ("1 stream: tokens/s end to end", "1 stream: TTFT p50, the same prompt again (service",
                "1 stream: TTFT p50, a new prompt each time", "1 stream: TTFT p50, nothing cached",
                "4 streams: aggregate tokens/s",
                "fan-out: 50 readers x 22 events, gapless", "fan-out: write-to-receipt delay",
                "fan-out: API CPU per 1,000 delivered events", "API memory per idle open stream",
                "resume: Last-Event-ID to first replayed event", "Redis bytes per stored event",
                "transformers serve", "1 stream: vs llama.cpp", "long generation (", "one step at 100 / 300 positions",
                "reading those steps' bytes alone (",
                "prompt joins: inter-token delay p99", "then another long prompt"):
        assert row in table, table
    assert "GAPS" not in table and "STREAMS ENDED" not in table
    assert re.search(r"gapless +\| 50/50 ", table)


def test_replication_benchmark_runs_and_reports_every_figure() -> None:
    result = subprocess.run([sys.executable, "-m", "bench.throughput", "--replication", "--quick", "--model",
                             "tiny-random", "--threads", "1"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = result.stdout.split("\n\n")[-1]
    for phase in ("replica up", "replica away"):
        for row in ("1 streams tokens/s, events on a replica (WAIT 1)", "4 streams tokens/s",
                    "TTFT p50, events on a replica", "writer flush round trip p50 / p99"):
            assert f"{phase}: {row}" in table, table
    assert "GAPS" not in table


def test_engine_benchmark_runs_and_reports_every_figure() -> None:
    result = subprocess.run([sys.executable, "-m", "bench.engine", "--model", "tiny-random", "--streams", "1", "2",
                             "--tokens", "8", "--rounds", "1", "--compile", "off", "--weights", "both",
                             "--launch-ahead", "both", "--baseline-tokens", "8"],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for row in ("transformers generate, 1 stream:", "eager, dense weights, steps one at a time: warmed up",
                "eager, auto weights, steps launched ahead: warmed up"):
        assert row in result.stdout, result.stdout
    assert result.stdout.count("1 streams:") == result.stdout.count("2 streams:") == 4, result.stdout
    assert "FAILED" not in result.stdout


def test_event_plane_benchmark_runs_and_reports_every_figure(tmp_path: Path) -> None:
    figures = tmp_path / "eventplane.json"
    # paced only: four streams unpaced end before a window opens on a small machine, and each part
    # starts a stack per backend
    result = subprocess.run([sys.executable, "-m", "bench.eventplane", "--redis", "single", "cluster", "--streams", "4",
                             "--followers", "1", "--seconds", "1", "--rounds", "1", "--capacity",
                             "--json", str(figures)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = result.stdout.split("\n\n")[-1]
    assert re.match(r"measure +\| single +\| cluster +\| cluster/single +\| target", table), table
    for row in ("4 streams x 1 follower at 150 tokens/s each: tokens/s", "worker CPU a token (host path)",
                "Redis CPU a token (all shards)", "tokens/s per Redis core: tokens / Redis CPU-s, all shards",
                "tokens/s per Redis core: tokens / Redis CPU-s, the busiest shard", "API CPU a token, per follower"):
        # a figure for each backend, and their ratio
        assert re.search(rf"{re.escape(row)}[^|\n]*\| [^ |][^|]*\| [^ |][^|]*\| \d+\.\d\d ", table), table
    for row in ("Redis calls (scripts) and bytes a token", "delivery lag, model to client: p50 / p99"):
        assert re.search(rf"{re.escape(row)}[^|\n]*\| [^ |][^|]*\| [^ |][^|]*\|", table), table
    # the spread of the events over the cluster's shards (four tasks may leave a shard without any)
    assert re.search(r"events a shard, most / fewest, of the mean +\| - +\| \d\.\d\d / \d\.\d\d", table), table
    assert "INCOMPLETE" not in table  # every follower got every token's text, gapless, and the final event
    data = json.loads(figures.read_text())
    assert data["backends"] == ["single", "cluster"]
    runs = data["runs"]
    assert [(run["backend"], run["streams"], run["followers"], run["rate"]) for run in runs] == [
        ("single", 4, 1, 150), ("cluster", 4, 1, 150)]
    assert all(run["tokens"] > 0 and run["lag_ms"]["p99"] > 0 for run in runs)
    assert [len(run["shard_cpu_s"]) for run in runs] == [1, 3]
    assert runs[0]["shard_events"] == [] and len(runs[1]["shard_events"]) == 3 and sum(runs[1]["shard_events"]) > 0


def test_fair_share_benchmark_runs_and_reports_every_figure(tmp_path: Path) -> None:
    figures = tmp_path / "fairshare.json"
    result = subprocess.run([sys.executable, "-m", "bench.fairshare", "--quick", "--json", str(figures)],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = result.stdout.split("\n\n")[-1]
    for row in ("1 principal, 16 streams x 16 tokens: tokens/s, fair share on / off", "tasks/s, on / off",
                "worker CPU a task, on / off", "API CPU a task, on / off", "Redis CPU a task, on / off",
                "Redis calls a task (scripts), on / off",
                "2 principals: B's 2 tasks after A's 16, wait to start: median (max)",
                "A's tasks still waiting when B queued, on / off", "A's backlog, first queued to last ended"):
        assert row in table, table
    data = json.loads(figures.read_text())
    assert [run["fair"] for run in data["saturated"]] == [run["fair"] for run in data["late_comer"]] == ["on", "off"]
    assert all(run["tasks"] > 0 and run["tokens"] > 0 for run in data["saturated"])
    assert all(len(run["b_wait_ms"]) == 2 for run in data["late_comer"])
    assert data["commit"] and data["cpu"]


def test_tracing_benchmark_runs_and_reports_every_figure(tmp_path: Path) -> None:
    figures = tmp_path / "tracing.json"
    result = subprocess.run([sys.executable, "-m", "bench.tracing", "--quick", "--json", str(figures)],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = result.stdout.split("\n\n")[-1]
    for row in ("one stream: tokens/s, tracing on / off", "time to first token, ms", "api CPU a token, us",
                "worker CPU a token, us", "spans received a stream (on)", "spans' CPU a task (in process, exported)",
                "a token of a 16-token stream, share of its CPU off"):
        assert row in table, table
    data = json.loads(figures.read_text())
    assert [run["mode"] for run in data["runs"]] == ["off", "on"]
    off, on = data["runs"]
    assert off["spans"] == 0 and on["spans"] == 6 * 3  # the warm-up and two streams: six spans each
    assert data["spans_received_in_span_cost"] == 6 * 50 and data["span_cpu_us_a_task"] > 0
