"""The local Redis Cluster (``lmsp.rediscluster``, ``tests/rediscluster.py``): it forms with every slot
served and a replica per primary, fails over when a primary dies, and stops every process it
started; and ``lmsp up --local-cluster N`` takes and checks its flag."""

import itertools
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmsp.cli import _parser
from lmsp.up import check_local_cluster, needs_local_redis
from lmsp_core.settings import Settings
from tests.rediscluster import LocalCluster

SLOTS = 16384


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    cluster = LocalCluster(primaries=3, replicas=1)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def test_a_local_cluster_serves_every_slot_with_a_replica_per_primary(cluster: LocalCluster) -> None:
    assert len(cluster.nodes) == 6 and all(node.startswith("127.0.0.1:") for node in cluster.nodes)
    primaries, replicas = cluster.ports[:3], cluster.ports[3:]
    for port in cluster.ports:
        with cluster.client(port) as client:
            info = client.cluster("INFO")
        assert info["cluster_state"] == "ok" and int(info["cluster_known_nodes"]) == 6, info
    ranges = sorted(cluster.slot_map())
    assert {owner for _, _, owner in ranges} == set(primaries)
    # contiguous from slot 0 to the last one
    assert ranges[0][0] == 0 and ranges[-1][1] == SLOTS - 1
    assert all(previous[1] + 1 == following[0] for previous, following in itertools.pairwise(ranges))
    masters_of_replicas = []
    for port in replicas:
        with cluster.client(port) as client:
            replication = client.info("replication")
        assert replication["role"] == "slave" and replication["master_link_status"] == "up"
        masters_of_replicas.append(int(replication["master_port"]))
    assert sorted(masters_of_replicas) == sorted(primaries)  # one replica each
    assert cluster.settings["redis_cluster"] == ",".join(cluster.nodes[:3])
    Settings(**cluster.settings)  # valid settings


def test_stopping_a_local_cluster_ends_every_node() -> None:
    cluster = LocalCluster()
    try:
        cluster.start()
        processes = list(cluster.processes.values())
        assert len(processes) == 6 and all(process.poll() is None for process in processes)
    finally:
        cluster.stop()
    assert all(process.returncode is not None for process in processes)
    assert not cluster.dir.exists()


def test_a_replica_takes_over_the_slots_of_a_killed_primary(cluster: LocalCluster) -> None:
    port, process = cluster.primary_of("lmsp:key")
    with cluster.client(port) as client:
        client.set("lmsp:key", "kept")
        assert client.wait(1, 5000) == 1  # on the replica before the primary dies
    cluster.kill(port, signal.SIGKILL)
    assert process.returncode == -signal.SIGKILL
    new = cluster.wait_promoted(port)
    assert new != port and new in cluster.ports[3:]
    assert cluster.primary_of("lmsp:key")[0] == new
    with cluster.client(new) as client:
        assert client.get("lmsp:key") == "kept"


def test_lmsp_up_takes_local_cluster_and_refuses_it_with_another_redis() -> None:
    assert _parser().parse_args(["up", "--local-cluster", "3"]).local_cluster == 3
    assert _parser().parse_args(["up"]).local_cluster == 0
    with pytest.raises(SystemExit, match="3 primaries or more"):
        check_local_cluster(Settings(), {}, 2)
    check_local_cluster(Settings(), {}, 3)
    for given in (Settings(redis_cluster="10.0.0.2:6379"), Settings(redis_sentinels="10.0.0.3:26379"),
                  Settings(redis_url="redis://10.0.0.2:6379/0")):
        with pytest.raises(SystemExit, match="--local-cluster starts its own Redis"):
            check_local_cluster(given, {}, 3)
    # a cluster is a Redis of its own: no local redis-server then
    assert not needs_local_redis(Settings(redis_cluster="10.0.0.2:6379,10.0.0.3:6379"), {})


def test_lmsp_up_clears_the_last_local_cluster(tmp_path: Path) -> None:
    from lmsp.rediscluster import clear_nodes

    (tmp_path / "nodes-7000.conf").write_text("stale")
    (tmp_path / "node-7000").mkdir()
    (tmp_path / "node-7000" / "appendonly.aof").write_text("stale")
    (tmp_path / "other").write_text("kept")
    clear_nodes(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["other"]
