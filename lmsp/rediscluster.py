"""A local Redis Cluster: real ``redis-server`` processes on free loopback ports, joined by
``redis-cli --cluster create``. ``lmsp up --local-cluster N`` runs one; so do the tests
(``tests/rediscluster.py``)."""

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis
from redis.exceptions import RedisError

from lmsp_core.ports import free_port

# a failover needs the votes of a majority of the primaries, so a cluster of two cannot lose one
MIN_PRIMARIES = 3
SLOTS = 16384
START_SECONDS = 10.0
FORM_SECONDS = 20.0


def start_cluster(directory: Path, primaries: int, replicas: int, children: list[subprocess.Popen[bytes]], *,
                  node_timeout_ms: int = 5000, appendonly: bool = True) -> list[str]:
    """Start ``primaries * (1 + replicas)`` nodes, each appended to ``children`` as soon as it runs
    (so that the caller's ``finally`` stops them whatever fails), make them one cluster with
    ``replicas`` replicas per primary, and wait until every node serves it. Returns every node as
    ``127.0.0.1:PORT``, the primaries first. SystemExit when a node does not start or the cluster
    does not form."""
    if primaries < MIN_PRIMARIES:
        raise ValueError(f"a Redis Cluster needs at least {MIN_PRIMARIES} primaries (a failover needs the votes "
                         f"of a majority of them), not {primaries}")
    server, cli = _binary("redis-server"), _binary("redis-cli")
    directory.mkdir(parents=True, exist_ok=True)
    started: dict[int, subprocess.Popen[bytes]] = {}
    taken: set[int] = set()
    for _ in range(primaries * (1 + replicas)):
        port, bus_port = _free_port(taken), _free_port(taken)
        started[port] = _start_node(server, directory, (port, bus_port), node_timeout_ms, appendonly)
        children.append(started[port])
    for port, child in started.items():
        _wait_listening(port, child, directory)
    ports = list(started)
    _create(cli, ports, replicas)
    roles = _wait_formed(ports, primaries)
    ordered = sorted(ports, key=lambda port: roles[port] != "master")  # stable: creation order within a role
    return [f"127.0.0.1:{port}" for port in ordered]


def clear_nodes(directory: Path) -> None:
    """Remove what nodes started in ``directory`` before left there: their cluster configuration
    names a cluster of ports that are gone, and a node that loads keys or knows other nodes
    refuses to join a new cluster."""
    for path in directory.glob("nodes-*.conf"):
        path.unlink()
    for path in directory.glob("node-*"):
        shutil.rmtree(path, ignore_errors=True)


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SystemExit(f"{name} is not installed; run scripts/bootstrap (a local Redis Cluster needs "
                         "redis-server and redis-cli)")
    return path


def _free_port(taken: set[int]) -> int:
    """A free port that no node started here has taken: nothing listens on those yet, so the kernel
    may offer one again."""
    port = free_port()
    while port in taken:
        port = free_port()
    taken.add(port)
    return port


def _start_node(server: str, directory: Path, ports: tuple[int, int], node_timeout_ms: int,
                appendonly: bool) -> subprocess.Popen[bytes]:
    port, bus_port = ports
    # a directory of its own: every node writes its append-only files under the same names
    own = directory / f"node-{port}"
    own.mkdir(exist_ok=True)
    # the bus port is named because its default, the port + 10000, may be taken or above 65535
    return subprocess.Popen(
        [server, "--cluster-enabled", "yes", "--cluster-config-file", str(directory / f"nodes-{port}.conf"),
         "--cluster-node-timeout", str(node_timeout_ms), "--port", str(port), "--cluster-port", str(bus_port),
         "--bind", "127.0.0.1", "--dir", str(own), "--save", "", "--appendonly", "yes" if appendonly else "no",
         "--daemonize", "no",
         # the other shards go on serving while one has no primary (Redis's default stops them all)
         "--cluster-require-full-coverage", "no",
         # a primary would wait this long for more replicas before it sends the first one its data
         "--repl-diskless-sync-delay", "0",
         "--loglevel", "warning", "--logfile", str(own / "redis.log")],
        stdout=subprocess.DEVNULL,
    )


def _wait_listening(port: int, child: subprocess.Popen[bytes], directory: Path) -> None:
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline and child.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"redis-server on port {port} did not start; its log: {directory / f'node-{port}' / 'redis.log'}")


def _create(cli: str, ports: list[int], replicas: int) -> None:
    # on one host redis-cli warns that replicas share it with their primaries, and goes on
    command = [cli, "--cluster", "create", *(f"127.0.0.1:{port}" for port in ports),
               "--cluster-replicas", str(replicas), "--cluster-yes"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=FORM_SECONDS, check=False)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"redis-cli --cluster create did not end within {FORM_SECONDS:.0f} s") from None
    if result.returncode != 0:
        raise SystemExit(f"redis-cli --cluster create failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")


def _wait_formed(ports: list[int], primaries: int) -> dict[int, str]:
    """Wait until every node knows all the others and serves every slot, and every replica is in
    sync with its primary and has written its append-only file; each node's role (``master`` or
    ``slave``). A replica that writes the first append-only file of what it received ignores
    SIGTERM ("Writing initial AOF, can't exit"), so a cluster returned earlier might not stop."""
    deadline = time.monotonic() + FORM_SECONDS
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            states = {port: _node_state(port) for port in ports}
        except (RedisError, OSError) as exc:
            last = repr(exc)
        else:
            roles = {port: state["role"] for port, state in states.items()}
            if all(_serves(state, len(ports)) for state in states.values()) \
                    and list(roles.values()).count("master") == primaries:
                return roles
            last = repr(states)
        time.sleep(0.1)
    raise SystemExit(f"the Redis Cluster did not form within {FORM_SECONDS:.0f} s; last seen: {last}")


def _node_state(port: int) -> dict[str, str]:
    with redis.Redis(host="127.0.0.1", port=port, socket_timeout=1, decode_responses=True) as client:
        info: dict[str, str] = client.cluster("INFO")
        replication = client.info("replication")
        persistence = client.info("persistence")
    rewriting = persistence["aof_rewrite_in_progress"] or persistence["aof_rewrite_scheduled"]
    return {**info, "role": str(replication["role"]),
            "master_link_status": str(replication.get("master_link_status", "up")),
            "aof_rewriting": "yes" if rewriting else "no"}


def _serves(state: dict[str, str], nodes: int) -> bool:
    return (state["cluster_state"] == "ok" and int(state["cluster_known_nodes"]) == nodes
            and int(state["cluster_slots_ok"]) == SLOTS and state["master_link_status"] == "up"
            and state["aof_rewriting"] == "no")
