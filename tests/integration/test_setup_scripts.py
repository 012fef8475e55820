"""The README's two commands on a machine with a PEP 668 ("externally managed") python3 and no uv: the demo's
bootstrap (scripts/ensure_uv.sh) installs uv without touching that Python, and the test command's launcher
(scripts/uv), run next as a separate process with the same PATH, finds it although ~/.local/bin is not on PATH.

Each test runs the real scripts in a clean environment: HOME in tmp, and PATH only a directory holding python3 and
the few tools the scripts use, so no uv is reachable except the one they install."""

import hashlib
import http.server
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import threading
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import fetch_uv  # noqa: E402

TOOLS = ["bash", "sh", "dirname", "rm", "mkdir", "ln"]  # what the scripts run besides python3 and uv
# The README's first command, the demo, up to its uv bootstrap (its own lines), then a use of uv as the demo's next.
DEMO = ROOT / "configs" / "reverse_text" / "run.sh"
_PRELUDE = DEMO.read_text().split("source scripts/ensure_uv.sh")[0] + "source scripts/ensure_uv.sh\nuv --version\n"
FIRST = ["bash", "-c", _PRELUDE, str(DEMO)]  # $0 is the demo's path, as when run as `bash configs/.../run.sh`
SECOND = [str(ROOT / "scripts" / "uv"), "--version"]  # the README's second command, with --version for `run pytest`
HINT = "hint: ~/.local/bin is not on your PATH"
FAILED = "ensure_uv: error: could not install uv"
HAS_MARKER = (
    "import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_path('stdlib'), "
    "'EXTERNALLY-MANAGED')))"
)


def _pip_refuses(python: str) -> bool:
    result = subprocess.run(
        [python, "-m", "pip", "install", "--user", "--dry-run", "uv"],
        env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "PIP_CONFIG_FILE": os.devnull},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return result.returncode != 0 and "externally-managed-environment" in result.stdout + result.stderr


def _marked_copy(prefix: Path) -> Path:
    """This interpreter's base Python under prefix, its stdlib mirrored by symlinks plus an EXTERNALLY-MANAGED file
    (what pip reads: sysconfig's stdlib directory, outside a venv). The executable is a copy, not a symlink, so that
    Python finds its prefix here rather than at the original."""
    stdlib = Path(sysconfig.get_path("stdlib"))
    base = Path(sys.base_prefix)
    (prefix / "bin").mkdir(parents=True)
    shutil.copy2(os.path.realpath(getattr(sys, "_base_executable", sys.executable)), prefix / "bin" / "python3")
    for entry in (base / "lib").iterdir():  # libpython for a shared build found through an $ORIGIN rpath
        if entry.name != stdlib.name:
            (prefix / "lib" / entry.name).parent.mkdir(parents=True, exist_ok=True)
            (prefix / "lib" / entry.name).symlink_to(entry)
    marked = prefix / stdlib.relative_to(base)
    marked.mkdir(parents=True)
    for entry in stdlib.iterdir():
        (marked / entry.name).symlink_to(entry)
    (marked / "EXTERNALLY-MANAGED").write_text("[externally-managed]\nError=a test's PEP 668 Python\n")
    return prefix / "bin" / "python3"


@pytest.fixture(scope="module")
def pep668_python(tmp_path_factory):
    """A python3 that pip refuses to install into: the distribution's where it has the PEP 668 marker (Debian 12,
    Ubuntu 24.04), else a marked copy of this interpreter's base Python."""
    system = Path("/usr/bin/python3")
    if system.exists() and subprocess.run([system, "-c", HAS_MARKER]).returncode == 0:
        python = system
    else:
        python = _marked_copy(tmp_path_factory.mktemp("pep668") / "prefix")
    if subprocess.run([python, "-m", "pip", "--version"], capture_output=True).returncode == 0:
        assert _pip_refuses(str(python)), f"{python} is not externally managed after all"
    return python


def _sandbox(tmp_path, python, *, venv_works=True, **env):
    """(env, bin dir): HOME in tmp, PATH = a directory with python3 and TOOLS only."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    for tool in TOOLS:
        (bin_dir / tool).symlink_to(shutil.which(tool))
    if venv_works:
        (bin_dir / "python3").symlink_to(python)
    else:  # Debian/Ubuntu without python3-venv: `python3 -m venv` fails (without ensurepip), the rest works
        (bin_dir / "python3").write_text(
            f'#!/bin/sh\nif [ "$1 $2" = "-m venv" ]; then echo "ensurepip is not available" >&2; exit 1; fi\n'
            f'exec {python} "$@"\n'
        )
        (bin_dir / "python3").chmod(0o755)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path / "home"), **env}
    assert shutil.which("uv", path=env["PATH"]) is None
    return env, bin_dir


def _site_packages(python, env):
    """The contents of every directory the Python installs packages into (user site included, under our HOME)."""
    code = "import json, site; print(json.dumps(site.getsitepackages() + [site.getusersitepackages()]))"
    dirs = json.loads(subprocess.run([python, "-c", code], env=env, capture_output=True, text=True).stdout)
    return {d: sorted(os.listdir(d)) if os.path.isdir(d) else None for d in dirs}


def _run(command, env, cwd=ROOT, timeout=300):
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("venv_works", [True, False], ids=["pip-in-private-venv", "no-venv-wheel-download"])
def test_readme_commands_install_uv_from_pypi_on_pep668_python(tmp_path, pep668_python, venv_works):
    """The real default routes against PyPI (~5 s with a venv, ~2 s without): both commands work, one after the
    other, the second in a process that inherits nothing from the first but the environment."""
    env, _ = _sandbox(tmp_path, pep668_python, venv_works=venv_works)
    before = _site_packages(pep668_python, env)

    first = _run(FIRST, env)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("uv "), first.stdout
    route = "with pip in a private venv" if venv_works else "from the wheel on https://pypi.org/simple"
    assert f"ensure_uv: installed {first.stdout.strip()} {route}" in first.stderr, first.stderr
    assert HINT in first.stderr

    second = _run(SECOND, env, cwd=tmp_path)  # in the same (unchanged) environment, from another directory
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout
    assert second.stderr == ""  # found the installed one: no second install, no hint

    home = Path(env["HOME"])
    assert (home / ".local/bin/uv").resolve() == (home / ".cache/prime-rl/uv-venv/bin/uv").resolve(strict=True)
    assert _site_packages(pep668_python, env) == before, "the system Python got new packages"
    assert not (home / ".local/lib").exists()


def _fake_uv_wheel(directory: Path, version: str) -> tuple[str, str]:
    """A uv wheel whose binary is a shell script, for this platform; returns (file name, sha256)."""
    name = f"uv-{version}-py3-none-manylinux_2_17_{platform.machine()}.manylinux2014_{platform.machine()}.whl"
    with zipfile.ZipFile(directory / name, "w") as wheel:
        wheel.writestr(f"uv-{version}.data/scripts/uv", f'#!/bin/sh\necho "uv {version} (fake) in $PWD: $*"\n')
        wheel.writestr(f"uv-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: uv\nVersion: {version}\n")
        wheel.writestr(f"uv-{version}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: false\n")
    return name, hashlib.sha256((directory / name).read_bytes()).hexdigest()


@pytest.fixture
def local_index(tmp_path):
    """A PEP 503 (HTML) simple index on localhost: yields (url, root directory)."""
    root = tmp_path / "index"
    (root / "simple" / "uv").mkdir(parents=True)
    (root / "files").mkdir()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/simple", root
    server.shutdown()
    server.server_close()


@pytest.mark.skipif(sys.platform != "linux" or not os.confstr("CS_GNU_LIBC_VERSION"), reason="glibc wheel tag")
@pytest.mark.parametrize("hash_ok", [True, False], ids=["sha256-matches", "sha256-differs"])
def test_wheel_route_takes_newest_release_from_the_index_and_checks_its_hash(
    tmp_path, pep668_python, local_index, hash_ok
):
    url, root = local_index
    links = []
    for version in ["0.9.9", "0.10.0"]:  # 0.10.0 is the newest, although "0.9.9" sorts after it as text
        name, sha256 = _fake_uv_wheel(root / "files", version)
        links.append(f'<a href="../../files/{name}#sha256={sha256 if hash_ok else "0" * 64}">{name}</a>')
    (root / "simple" / "uv" / "index.html").write_text("<html><body>\n" + "\n".join(links) + "\n</body></html>\n")
    env, _ = _sandbox(tmp_path, pep668_python, venv_works=False, PIP_INDEX_URL=url)

    first = _run(FIRST, env)
    second = _run([*SECOND, "x"], env, cwd=tmp_path)
    if hash_ok:
        assert first.returncode == 0, first.stderr
        assert first.stdout == f"uv 0.10.0 (fake) in {ROOT}: --version\n"
        assert f"from the wheel on {url} into" in first.stderr and HINT in first.stderr
        assert second.returncode == 0, second.stderr
        assert second.stdout == f"uv 0.10.0 (fake) in {tmp_path}: --version x\n"  # in the caller's directory
    else:
        for result in (first, second):
            assert result.returncode == 1
            assert "sha256" in result.stderr and "is not the index's" in result.stderr, result.stderr
            assert FAILED in result.stderr and "command not found" not in result.stderr
            assert result.stdout == ""
        assert not (Path(env["HOME"]) / ".local/bin/uv").exists()


def test_no_install_route_fails_with_a_clear_message(tmp_path, pep668_python):
    """Index unreachable: the first command, pip in the private venv fails, then the wheel download; the second, where
    `python3 -m venv` does not work, the wheel download. Both stop with the error, neither goes on to
    `uv: command not found`."""
    unreachable = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_RETRIES": "0", "PIP_CONFIG_FILE": os.devnull}
    for command, venv_works in [(FIRST, True), (SECOND, False)]:
        env, _ = _sandbox(tmp_path / command[0].rsplit("/")[-1], pep668_python, venv_works=venv_works, **unreachable)
        result = _run(command, env)
        assert result.returncode == 1, result.stderr
        assert result.stdout == ""
        assert ("pip in the private venv could not install uv" in result.stderr) == venv_works, result.stderr
        assert "cannot read http://127.0.0.1:9/simple/uv/" in result.stderr
        assert FAILED in result.stderr and "docs.astral.sh/uv" in result.stderr
        assert "command not found" not in result.stderr
        assert not (Path(env["HOME"]) / ".local/bin/uv").exists()


def test_launcher_uses_an_installed_uv_and_never_itself(tmp_path, pep668_python):
    """A uv installed earlier in ~/.local/bin, which is not on PATH, while scripts/ is: the launcher runs that uv
    (not itself, in a loop), in the caller's directory, without installing anything."""
    env, bin_dir = _sandbox(tmp_path, pep668_python)
    env["PATH"] = f"{ROOT / 'scripts'}:{bin_dir}"
    uv = Path(env["HOME"]) / ".local/bin/uv"
    uv.parent.mkdir(parents=True)
    uv.write_text('#!/bin/sh\necho "uv 9.9.9 (installed earlier) in $PWD: $*"\n')
    uv.chmod(0o755)
    result = _run([SECOND[0], "run", "pytest"], env, cwd=tmp_path, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"uv 9.9.9 (installed earlier) in {tmp_path}: run pytest\n"
    assert result.stderr == ""
    assert not (Path(env["HOME"]) / ".cache").exists()


def test_marked_copy_of_a_python_is_externally_managed(tmp_path):
    """The fallback for machines without a distribution Python: pip refuses the marked copy, as a PEP 668 one."""
    python = _marked_copy(tmp_path / "prefix")
    if subprocess.run([python, "-m", "pip", "--version"], capture_output=True).returncode != 0:
        pytest.skip("this interpreter's base Python has no pip")
    assert _pip_refuses(str(python))


def test_fetch_uv_picks_the_newest_fitting_wheel():
    files = [
        {"filename": f"uv-{version}-py3-none-{tag}.whl", "yanked": yanked}
        for version, tag, yanked in [
            ("0.9.9", "manylinux_2_17_x86_64.manylinux2014_x86_64", False),
            ("0.10.0", "manylinux_2_17_x86_64.manylinux2014_x86_64", False),
            ("0.10.1", "manylinux_2_17_x86_64.manylinux2014_x86_64", True),  # yanked
            ("0.11.0", "manylinux_2_28_x86_64", False),  # needs a newer glibc than the host's 2.27
            ("0.11.0", "musllinux_1_1_x86_64", False),
            ("0.11.0", "manylinux_2_17_aarch64.manylinux2014_aarch64", False),
            ("0.11.0", "macosx_10_12_x86_64", False),
            ("0.11.0", "win_amd64", False),
        ]
    ] + [{"filename": "uv-0.12.0.tar.gz"}, {"filename": "uv-0.12.0rc1-py3-none-manylinux1_x86_64.whl"}]
    glibc = {"os": "linux", "machine": "x86_64", "glibc": (2, 27)}
    assert fetch_uv.pick_wheel(files, glibc)["filename"].startswith("uv-0.10.0-")
    assert (
        fetch_uv.pick_wheel(files, {**glibc, "glibc": (2, 28)})["filename"]
        == "uv-0.11.0-py3-none-manylinux_2_28_x86_64.whl"
    )
    assert (
        fetch_uv.pick_wheel(files, {**glibc, "glibc": None})["filename"]
        == "uv-0.11.0-py3-none-musllinux_1_1_x86_64.whl"
    )
    mac = {"os": "macos", "machine": "arm64", "macos": (14, 0)}
    assert fetch_uv.tag_fits("macosx_11_0_arm64", mac) and fetch_uv.tag_fits("macosx_10_12_universal2", mac)
    assert not fetch_uv.tag_fits("macosx_10_12_x86_64", mac) and not fetch_uv.tag_fits("macosx_15_0_arm64", mac)
    with pytest.raises(fetch_uv.FetchError, match="no uv wheel for this platform"):
        fetch_uv.pick_wheel(files, {**glibc, "machine": "riscv64"})


@pytest.mark.parametrize("script", ["configs/reverse_text/run.sh", "configs/tower_of_hanoi/run.sh"])
def test_demos_bootstrap_uv_before_using_it(script):
    lines = [line.strip() for line in (ROOT / script).read_text().splitlines()]
    first_uv = next(i for i, line in enumerate(lines) if line.startswith("uv ") or " uv " in line.split("#")[0])
    assert lines.index("source scripts/ensure_uv.sh  # puts uv on PATH, installing it where it is missing") < first_uv


def test_ci_runs_the_readme_test_command_through_the_launcher():
    commands = [line for line in (ROOT / ".ci/run").read_text().splitlines() if line and not line.startswith("#")]
    assert commands[-1] == 'exec scripts/uv run pytest -m "not gpu"'
    assert os.access(ROOT / "scripts" / "uv", os.X_OK)
