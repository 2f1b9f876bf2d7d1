"""Which of the session's processes each test uses, and the groups of tests that share them.

``scripts/test`` runs the suite in three pytest processes (pytest-xdist ``--dist loadgroup``), each a
session with its own Redis and stack (``conftest.Stack``). Most of a test's time is spent waiting for
the processes it drives, so three runs keep two cores busy. The tests that use the single Redis's
stack form one group, those on the cluster's stack another, and every other file is a group of its
own (its module fixtures then start once): each group runs in one pytest process, so each stack
starts once, with only the processes its group's tests use.
"""

from pathlib import Path

import pytest

SINGLE = ("api", "secure_api", "second_api", "limited_api", "small_api", "tenant_api", "tiny_worker",
          "variant_worker", "eager_worker", "patient_worker", "fair_worker", "smollm2_worker")
# the same stack on the Redis Cluster, for the modules that use ``tests.backends``
ON_CLUSTER = ("api", "secure_api", "tiny_worker", "eager_worker")
STACK_GROUP, CLUSTER_GROUP = "stack", "cluster-stack"
TESTS = Path(__file__).parent


def needed(items: list[pytest.Item]) -> set[str]:
    """The session's processes (``SINGLE``'s names, ``cluster_`` before those on the cluster) and
    ``redis_cluster`` that ``items`` use: directly, or through ``tests.backends``, whose fixtures
    look the backend's stack up at run time."""
    found: set[str] = set()
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        callspec = getattr(item, "callspec", None)
        backend = callspec.params.get("backend") if callspec is not None else None
        if backend is not None:
            prefix = "" if backend == "redis" else "cluster_"
            found |= {f"{prefix}{name}" for name in ("api", "secure_api", "tiny_worker") if "served" in names}
            found |= {f"{prefix}eager_worker"} if "eager_worker" in names else set()
            found |= {"redis_cluster"} if backend == "cluster" else set()
            names.discard("eager_worker")
        names |= {"eager_worker"} if "single_eager_worker" in names else set()
        found |= names & ({*SINGLE, *(f"cluster_{name}" for name in ON_CLUSTER), "redis_cluster"})
    if any(name.startswith("cluster_") for name in found):
        found.add("redis_cluster")
    return found


def group(item: pytest.Item) -> str:
    """The group ``item`` runs in: the stack it uses, or its file."""
    processes = needed([item])
    if "redis_cluster" in processes:
        return CLUSTER_GROUP
    if processes:
        return STACK_GROUP
    return str(item.path.relative_to(TESTS))


def process_group(name: str) -> str:
    """The group whose stack holds the session's process ``name``."""
    return CLUSTER_GROUP if name.startswith("cluster_") or name == "redis_cluster" else STACK_GROUP


def mark_groups(items: list[pytest.Item]) -> None:
    """Give each test its group as pytest-xdist's ``xdist_group`` (``--dist loadgroup``)."""
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group(item)))
