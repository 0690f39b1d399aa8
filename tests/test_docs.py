"""The README as a new user reads it: its Python runs as written, and it lists every example."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


def test_readme_has_python_blocks() -> None:
    """The README shows the library in at least one Python block."""
    assert BLOCKS


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs_as_written(index: int, tmp_path: Path) -> None:
    """Each Python block of the README runs as a program (exit 0), printing what the README says it prints."""
    script = tmp_path / f"readme_{index}.py"
    script.write_text(BLOCKS[index])
    env = {k: v for k, v in os.environ.items() if k != "NIXL_LOG_LEVEL"}  # as a new user runs it
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    after = README[README.index(BLOCKS[index]) + len(BLOCKS[index]) :].split("\n\n", 2)[1]
    if after.startswith("It prints"):
        for claimed in re.findall(r"`([^`]+)`", after):
            assert claimed in proc.stdout.splitlines(), (claimed, proc.stdout)


def test_readme_lists_every_example_and_its_install_line() -> None:
    """Every file in examples/ is named in the README, with the extra that installs what it imports."""
    for example in sorted((ROOT / "examples").glob("*.py")):
        assert f"examples/{example.name}" in README
    assert "pip install -e '.[examples]'" in README
    pyproject = (ROOT / "pyproject.toml").read_text()
    extra = re.search(r"^examples = \[(.*)\]$", pyproject, re.M)
    assert extra is not None
    for module in ("trio", "uvicorn", "httpx"):
        assert module in extra.group(1)


def test_config_schema_example_in_the_docs_is_a_valid_cache(tmp_path: Path) -> None:
    """The ``--config`` example of docs/concepts.md parses as a CacheSpec, and ``akv plan --config``
    shows its groups; a broken file is one line and exit 64."""
    import json

    from akv.geometry.cache import CacheSpec

    text = (ROOT / "docs" / "concepts.md").read_text()
    example = re.findall(r"```json\n(.*?)```", text, re.S)[0]
    spec = CacheSpec.from_json(example)
    assert spec.names == ("full", "gdn")
    path = tmp_path / "cache.json"
    path.write_text(example)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "akv",
            "plan",
            "--config",
            str(path),
            "--prefill-tp",
            "2",
            "--decode-tp",
            "4",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert [g["group"] for g in json.loads(out)["decode"][0]["groups"]] == ["full", "gdn"]
    path.write_text(example.replace('"units": 32', '"units": "many"', 1))
    bad = subprocess.run(
        [sys.executable, "-m", "akv", "plan", "--config", str(path), "--prefill-tp", "2", "--decode-tp", "4"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 64 and bad.stderr.count("\n") == 1 and "--config" in bad.stderr


@pytest.mark.slow
def test_docs_site_builds_strict(tmp_path: Path) -> None:
    """`mkdocs build --strict` builds the site with no warning (every cross-reference resolves)."""
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "site" / "operations" / "index.html").exists()
