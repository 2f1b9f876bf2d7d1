"""The client and the CLI's client commands install without the service's packages: Litestar, arq,
redis, llguidance, jinja2, tokenizers and torch are extras (``api``, ``worker``)."""

import subprocess
import sys
import tomllib

from tests.support import ROOT

SERVICE_ONLY = ("litestar", "arq", "redis", "llguidance", "jinja2", "tokenizers", "torch", "transformers", "uvicorn",
                "prometheus_client")

# a Python that cannot import any of them, as on a machine where only the client is installed
WITHOUT_SERVICE = f"""
import importlib.abc, sys
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {SERVICE_ONLY!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Missing())
"""


def without_service(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", WITHOUT_SERVICE + code], capture_output=True, text=True, cwd=ROOT,
                          timeout=60)


def test_the_base_install_needs_none_of_the_service_packages() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = " ".join(project["dependencies"]).lower()
    assert not [name for name in SERVICE_ONLY if name.replace("_", "-") in base]
    extras = project["optional-dependencies"]
    assert {"api", "worker"} <= set(extras)


def test_the_client_and_its_commands_import_without_them() -> None:
    result = without_service("import lmsp.client, lmsp.cli, lmsp.clientcommands.chat, lmsp.clientcommands.run, "
                             "lmsp.clientcommands.tasks, lmsp.clientcommands.batches, lmsp.clientcommands.models\n"
                             "print('imported')")
    assert result.returncode == 0 and "imported" in result.stdout, result.stderr


def test_a_service_command_says_which_extra_it_needs() -> None:
    result = without_service("import lmsp.cli\nraise SystemExit(lmsp.cli.main(['token', 'list']))")
    assert result.returncode == 2, result.stderr
    assert "pip install 'lmsp-service[api]'" in result.stderr
