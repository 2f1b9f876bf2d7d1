"""compose.yaml: its structure, and `docker compose config` (or `docker-compose config`) where a
compose client is installed (`scripts/bootstrap --test` installs Debian's docker-compose)."""

import ipaddress
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import ROOT

COMPOSE = ROOT / "compose.yaml"


def compose_command() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


def check(config: dict[str, Any]) -> None:
    services = config["services"]
    redis = services["redis"]
    assert "--appendonly" in redis["command"] and "yes" in redis["command"]
    assert any(":/data" in str(volume) or "'/data'" in str(volume) for volume in redis["volumes"])
    assert services["api"]["deploy"]["replicas"] >= 2
    workers = [name for name in services if name.startswith("worker-gpu")]
    assert workers
    for name in workers:
        worker = services[name]
        [device] = worker["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["device_ids"]
        assert any("/cache" in str(volume) for volume in worker["volumes"])
        assert worker["command"][:2] == ["lmsp", "worker"]
    assert {"redis-data", "model-cache"} <= set(config["volumes"])
    check_sentinel_profile(services)
    check_cluster_profile(services, config["networks"])
    check_observability_profile(services)


def check_sentinel_profile(services: dict[str, Any]) -> None:
    """``--profile sentinel``: a replica of ``redis`` and three sentinels watching it, under the
    primary name the services ask for; the services take the sentinels from the environment."""
    in_profile = {name for name, service in services.items() if "sentinel" in service.get("profiles", [])}
    replica = services["redis-replica"]
    assert "redis-replica" in in_profile and replica["command"][:4] == ["redis-server", "--replicaof", "redis", "6379"]
    sentinels = sorted(name for name in in_profile if name.startswith("sentinel-"))
    assert sentinels == ["sentinel-1", "sentinel-2", "sentinel-3"]
    master = services["api"]["environment"]["LMSP_REDIS_MASTER"]
    for name in sentinels:
        script = " ".join(services[name]["command"])
        assert f"sentinel monitor {master} redis 6379 2" in script and "--sentinel" in script
        assert services[name]["environment"]["SENTINEL_HOST"] == name
        assert any(":/data" in str(volume) for volume in services[name]["volumes"])
    for name in ("api", *[n for n in services if n.startswith("worker-gpu")]):
        assert "LMSP_REDIS_SENTINELS" in services[name]["environment"]
        assert services[name]["environment"]["LMSP_REDIS_MASTER"] == master
    assert not in_profile & {"redis", "api", "worker-gpu0"}  # the default services run without the profile


def check_cluster_profile(services: dict[str, Any], networks: dict[str, Any]) -> None:
    """``--profile cluster``: six Redis Cluster nodes at fixed addresses of their own network, a
    one-shot service that joins them (three primaries, a replica each), and an API and a worker
    that name every node and start once the cluster is formed."""
    in_profile = {name for name, service in services.items() if "cluster" in service.get("profiles", [])}
    [subnet] = [ipaddress.ip_network(block["subnet"]) for block in networks["cluster"]["ipam"]["config"]]
    nodes = sorted(name for name in in_profile if name.startswith("redis-cluster-") and name != "redis-cluster-init")
    assert len(nodes) == 6
    addresses = []
    for name in nodes:
        node = services[name]
        command = node["command"]
        assert command[0] == "redis-server" and command[command.index("--cluster-enabled") + 1] == "yes"
        assert command[command.index("--appendonly") + 1] == "yes"
        assert command[command.index("--cluster-config-file") + 1].startswith("/data/")
        assert any(":/data" in str(volume) for volume in node["volumes"])
        address = node["networks"]["cluster"]["ipv4_address"]
        assert ipaddress.ip_address(address) in subnet
        addresses.append(f"{address}:6379")
    assert len(set(addresses)) == 6
    init = services["redis-cluster-init"]
    script = " ".join(init["command"])
    assert "--cluster create" in script and "--cluster-replicas 1" in script
    assert all(address in script for address in addresses)
    assert set(init["depends_on"]) == set(nodes) and "redis-cluster-init" in in_profile
    for name in ("api-cluster", "worker-cluster"):
        service = services[name]
        assert name in in_profile and "cluster" in set(service["networks"])
        assert set(service["environment"]["LMSP_REDIS_CLUSTER"].split(",")) == set(addresses)
        assert "LMSP_REDIS_SENTINELS" not in service["environment"]  # the two exclude each other
        assert service["depends_on"]["redis-cluster-init"]["condition"] == "service_completed_successfully"
    assert services["worker-cluster"]["command"][:2] == ["lmsp", "worker"]
    assert services["api-cluster"]["command"][:2] == ["lmsp", "api"]
    assert not in_profile & {"redis", "api", "worker-gpu0"}


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """A service's bind mounts, target -> the source's path under the repository (either spelling:
    ``src:dst[:mode]``, or the long form)."""
    found = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            source, target = str(volume.get("source", "")), str(volume["target"])
        else:
            source, target = str(volume).split(":")[:2]
        if source.startswith(("./", str(ROOT))):
            found[target] = str(Path(source.removeprefix(str(ROOT)).lstrip("./")))
    return found


def check_observability_profile(services: dict[str, Any]) -> None:
    """``--profile observability``: Prometheus with our scrape configuration and alert rules, Grafana
    with the dashboard provisioned, and Jaeger taking OTLP; the services export traces where
    OTEL_EXPORTER_OTLP_ENDPOINT says (empty: not at all)."""
    in_profile = {name for name, service in services.items() if "observability" in service.get("profiles", [])}
    assert in_profile == {"prometheus", "grafana", "jaeger"}
    prometheus = mounts(services["prometheus"])
    assert prometheus["/etc/prometheus"] == "observability/prometheus"
    config = yaml.safe_load((ROOT / "observability/prometheus/prometheus.yml").read_text())
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]
    [job] = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and job["dns_sd_configs"][0]["names"] == ["api"]
    assert job["dns_sd_configs"][0]["port"] == 8000 and job["authorization"]["credentials_file"].startswith(
        "/etc/prometheus/")
    grafana = mounts(services["grafana"])
    provisioning = ROOT / grafana["/etc/grafana/provisioning"]
    [provider] = yaml.safe_load((provisioning / "dashboards/lmsp.yaml").read_text())["providers"]
    dashboards = ROOT / grafana[provider["options"]["path"]]
    assert (dashboards / "lmsp.json").is_file()
    [source, *_] = yaml.safe_load((provisioning / "datasources/prometheus.yaml").read_text())["datasources"]
    assert source["uid"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert services["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    for name in ("api", "api-cluster", *[n for n in services if n.startswith("worker-")]):
        assert "OTEL_EXPORTER_OTLP_ENDPOINT" in services[name]["environment"]
    assert not in_profile & {"redis", "api", "worker-gpu0"}


def test_compose_file_structure() -> None:
    check(yaml.safe_load(COMPOSE.read_text()))
    # the image has what the services run
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "LMSP_MODEL_CACHE=/cache" in dockerfile and ".[api,worker]" in dockerfile


def test_docker_compose_config_validates(tmp_path: Path) -> None:
    command = compose_command()
    if command is None:
        pytest.skip("no docker compose client (`scripts/bootstrap --test` installs docker-compose)")
    result = subprocess.run([*command, "-f", str(COMPOSE), "-p", "lmsp", "config"], capture_output=True, text=True,
                            cwd=ROOT, timeout=120, env={"PATH": "/usr/bin:/bin:/usr/local/bin", "HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    check(yaml.safe_load(result.stdout))
