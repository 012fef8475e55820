"""The README's first command on a machine with Python but without uv: the demo installs uv itself, as CI does."""

import shutil
import subprocess
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.slow
def test_uv_is_installed_with_pip_where_it_is_missing(tmp_path):
    """A fresh Python (a new venv: pip, no uv) and nothing else on PATH: sourcing the bootstrap gives a working uv
    (from PyPI, ~10 s)."""
    venv.create(tmp_path / "python", with_pip=True)
    env = {"PATH": f"{tmp_path / 'python' / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path / "home")}
    assert shutil.which("uv", path=env["PATH"]) is None
    result = subprocess.run(
        ["bash", "-c", "set -euo pipefail; source scripts/ensure_uv.sh; uv --version"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("uv "), result.stdout


@pytest.mark.parametrize("script", ["configs/reverse_text/run.sh", ".ci/run"])
def test_demo_and_ci_bootstrap_uv_before_using_it(script):
    lines = [line.strip() for line in (ROOT / script).read_text().splitlines()]
    first_uv = next(i for i, line in enumerate(lines) if line.startswith("uv ") or " uv " in line.split("#")[0])
    assert lines.index("source scripts/ensure_uv.sh  # installs uv with pip where it is missing") < first_uv
