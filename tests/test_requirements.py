"""The requirement files stay layered (common <- platform <- test) and each lock still matches its .in file."""
from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

REQUIREMENTS = Path(__file__).resolve().parents[1] / "requirements"
LOCKED = ["cpu", "cuda", "test"]
INCLUDES = {"cpu": "common.in", "cuda": "common.in", "test": "cpu.in"}
_NAME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _lines(path: Path) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def _included(in_file: Path) -> list[str]:
    return [line.split(None, 1)[1] for line in _lines(in_file) if line.startswith(("-r ", "--requirement "))]


def _direct_names(in_file: Path) -> set[str]:
    """Package names an .in file asks for, following its -r includes."""
    names = set()
    for line in _lines(in_file):
        if line.startswith(("-r ", "--requirement ")):
            names |= _direct_names(in_file.parent / line.split(None, 1)[1])
        elif not line.startswith("-"):
            names.add(_canonical(_NAME.match(line).group(1)))
    return names


def _pins(lock: Path) -> dict[str, str]:
    pins = {}
    for line in _lines(lock):
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", line)
        if match:
            pins[_canonical(match.group(1))] = match.group(2)
    return pins


@pytest.mark.parametrize("platform, included", sorted(INCLUDES.items()))
def test_layers_include_their_base(platform: str, included: str):
    in_file = REQUIREMENTS / f"{platform}.in"
    assert included in _included(in_file), f"{in_file.name} must keep `-r {included}`"


@pytest.mark.parametrize("name", LOCKED)
def test_lock_is_compiled_from_its_in_file(name: str):
    lock = REQUIREMENTS / f"{name}.txt"
    assert lock.is_file(), f"{lock.name} is missing: pip-compile -o requirements/{name}.txt requirements/{name}.in"
    lines = lock.read_text().splitlines()
    header = "\n".join(itertools.takewhile(lambda line: line.startswith("#"), lines))
    command = rf"^#\s+pip-compile .*requirements/{name}\.in$"
    assert re.search(command, header, re.M), f"{lock.name} header names no pip-compile command"
    pins = _pins(lock)
    missing = sorted(_direct_names(REQUIREMENTS / f"{name}.in") - set(pins))
    assert not missing, f"{lock.name} drifted from {name}.in: no == pin for {missing}; re-run pip-compile"


def test_cpu_lock_keeps_the_local_torch_build():
    # A torch other than the exact cpu.in pin would make pip fetch PyPI's multi-GB CUDA build.
    pinned = re.search(r"^torch==([^\s;]+)", (REQUIREMENTS / "cpu.in").read_text(), re.M).group(1)
    for name in ("cpu", "test"):
        assert _pins(REQUIREMENTS / f"{name}.txt")["torch"].split("+")[0] == pinned, name


def test_common_in_is_platform_neutral():
    # pyproject.toml reads common.in as the package's dependencies: no torch builds, no pip options there.
    lines = _lines(REQUIREMENTS / "common.in")
    assert not [line for line in lines if line.startswith("-")]
    assert not {"torch", "triton"} & _direct_names(REQUIREMENTS / "common.in")
