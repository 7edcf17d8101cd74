"""pyproject.toml's ranges allow no version with a known advisory (``make lowest`` runs the
unit tests on the floors)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]

#: (package, the newest version an advisory names, the first fixed one)
ADVISORIES = [
    ("python-dotenv", "1.2.1", "1.2.2"),
    ("cryptography", "42.0.3", "42.0.4"),
    ("django", "4.2.29", "4.2.30"),
    ("django", "5.1.15", "5.2.13"),  # 5.0 and 5.1 are out of support: no fix comes
    ("langchain-core", "1.2.4", "1.2.5"),
    ("langgraph", "1.0.9", "1.0.10"),
    ("langgraph-checkpoint", "3.0.1", "4.0.0"),
]


def requirements() -> dict[str, list[Requirement]]:
    """Every requirement of the project and its extras, by package name."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found: dict[str, list[Requirement]] = {}
    for line in [*project["dependencies"],
                 *(r for extra in project["optional-dependencies"].values() for r in extra)]:
        req = Requirement(line)
        if not req.name.startswith("sagaworker"):
            found.setdefault(re.sub(r"[-_.]+", "-", req.name).lower(), []).append(req)
    return found


@pytest.mark.parametrize(("package", "affected", "fixed"), ADVISORIES)
def test_no_range_allows_a_version_with_an_advisory(package: str, affected: str,
                                                    fixed: str) -> None:
    reqs = requirements().get(package, [])
    assert reqs, f"{package} is named nowhere in pyproject.toml"
    assert [(str(r), r.specifier.contains(affected), r.specifier.contains(fixed))
            for r in reqs] == [(str(r), False, True) for r in reqs]
