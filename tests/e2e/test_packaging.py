"""How the project is built and installed: package metadata without deprecations, and no package
index address in the code (pip's own configuration chooses the index; README)."""

import re
import subprocess
import tomllib
import warnings

from packaging.requirements import Requirement
from packaging.version import Version
from setuptools.config.pyprojecttoml import apply_configuration
from setuptools.dist import Distribution

from tests.support import ROOT

# what would pin an index in a command: pip's options and the one index this project ever needed
INDEX_ADDRESS = re.compile(r"--(extra-)?index-url|--find-links|download\.pytorch\.org|/simple/?\b", re.IGNORECASE)


def test_metadata_builds_without_warnings() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # setuptools deprecations are warnings until the day builds fail
        metadata = apply_configuration(Distribution(), ROOT / "pyproject.toml").metadata
    assert metadata.license_expression == "Apache-2.0"  # an SPDX expression, not a table


def test_build_requires_a_setuptools_that_reads_spdx_licenses() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (setuptools,) = [Requirement(r) for r in project["build-system"]["requires"] if r.startswith("setuptools")]
    assert Version("76.9") not in setuptools.specifier and Version("77.0") in setuptools.specifier


def test_no_package_index_address_in_the_code() -> None:
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    code = [ROOT / name for name in tracked.split()
            if not name.endswith(".md") and name != "tests/e2e/test_packaging.py" and (ROOT / name).is_file()]
    assert code, "no tracked files found"
    found = [f"{path.relative_to(ROOT)}: {match.group()}" for path in code
             for match in INDEX_ADDRESS.finditer(path.read_text(errors="replace"))]
    assert not found
