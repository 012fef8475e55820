"""Fetch the uv binary from a package index with the standard library only: no pip, no venv, nothing installed into
any Python. scripts/ensure_uv.sh runs it where `python3 -m venv` is unavailable (Debian without python3-venv).

    python3 scripts/fetch_uv.py DEST_DIR   # writes DEST_DIR/uv (and uvx); prints the uv version it wrote

The index is PIP_INDEX_URL (as pip would use it), default https://pypi.org/simple; it is read through the simple
repository API (PEP 691 JSON or PEP 503 HTML), the newest release's wheel for this platform is downloaded, its
sha256 checked against the index's, and the binaries taken out of the wheel's `.data/scripts/`.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import sys
import tempfile
import urllib.request
import zipfile
from html.parser import HTMLParser
from urllib.parse import urldefrag, urljoin

DEFAULT_INDEX = "https://pypi.org/simple"
TIMEOUT_S = 60
WHEEL = re.compile(r"^uv-(?P<version>\d+(?:\.\d+)*)-[^-]+-[^-]+-(?P<platforms>[^-]+)\.whl$")
MANYLINUX = re.compile(r"^manylinux_(\d+)_(\d+)_(.+)$")
LEGACY_MANYLINUX = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}
MACOSX = re.compile(r"^macosx_(\d+)_(\d+)_(.+)$")


class FetchError(Exception):
    pass


def host_platform() -> dict:
    """What a wheel's platform tag is matched against: the OS, CPU, and libc or macOS version."""
    system, machine = platform.system(), platform.machine().lower()
    if system == "Linux":
        try:
            glibc = os.confstr("CS_GNU_LIBC_VERSION") or ""
        except (ValueError, OSError):
            glibc = ""
        match = re.match(r"glibc (\d+)\.(\d+)", glibc)
        machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
        if match:
            return {"os": "linux", "machine": machine, "glibc": (int(match[1]), int(match[2]))}
        return {"os": "linux", "machine": machine, "glibc": None}  # musl
    if system == "Darwin":
        major, minor = (int(part) for part in (platform.mac_ver()[0].split(".") + ["0"])[:2])
        return {
            "os": "macos",
            "machine": "arm64" if machine in ("arm64", "aarch64") else machine,
            "macos": (major, minor),
        }
    raise FetchError(f"no uv wheel for {system} {machine} known to this script")


def tag_fits(tag: str, host: dict) -> bool:
    """Whether one platform tag of a wheel (e.g. manylinux_2_17_x86_64) runs on the host."""
    if host["os"] == "linux":
        legacy = next((v for name, v in LEGACY_MANYLINUX.items() if tag.startswith(name + "_")), None)
        if legacy is not None:
            version, machine = legacy, tag.split("_", 1)[1]
        elif match := MANYLINUX.match(tag):
            version, machine = (int(match[1]), int(match[2])), match[3]
        elif tag.startswith("musllinux_"):
            return host["glibc"] is None and tag.split("_", 3)[-1] == host["machine"]
        else:
            return False
        return host["glibc"] is not None and machine == host["machine"] and version <= host["glibc"]
    if match := MACOSX.match(tag):
        machine = match[3]
        return (int(match[1]), int(match[2])) <= host["macos"] and machine in (host["machine"], "universal2")
    return False


def pick_wheel(files: list[dict], host: dict) -> dict:
    """The newest non-yanked release wheel whose platform tags fit the host. Each file: filename, url, sha256."""
    fitting = []
    for file in files:
        match = WHEEL.match(file["filename"])
        if match and not file.get("yanked") and any(tag_fits(t, host) for t in match["platforms"].split(".")):
            fitting.append((tuple(int(part) for part in match["version"].split(".")), file))
    if not fitting:
        raise FetchError(f"the index lists no uv wheel for this platform ({host})")
    return max(fitting, key=lambda pair: pair[0])[1]


class _Anchors(HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[dict] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "a" and attrs.get("href"):
            self.links.append(attrs)


def list_files(index: str) -> list[dict]:
    """The uv project's files on a simple-API index, with absolute URLs and sha256 digests where the index gives them."""
    page = index.rstrip("/") + "/uv/"
    request = urllib.request.Request(page, headers={"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            content_type, body = response.headers.get("Content-Type", ""), response.read()
    except OSError as error:
        raise FetchError(f"cannot read {page}: {error}") from error
    if "json" in content_type:
        return [
            {"filename": f["filename"], "url": urljoin(page, f["url"]), "sha256": f.get("hashes", {}).get("sha256"),
             "yanked": bool(f.get("yanked"))}
            for f in json.loads(body)["files"]
        ]  # fmt: skip
    parser = _Anchors()
    parser.feed(body.decode("utf-8", "replace"))
    files = []
    for link in parser.links:
        url, fragment = urldefrag(urljoin(page, link["href"]))
        sha256 = fragment[len("sha256=") :] if fragment.startswith("sha256=") else None
        files.append(
            {"filename": url.rsplit("/", 1)[-1], "url": url, "sha256": sha256, "yanked": "data-yanked" in link}
        )
    return files


def fetch(dest: str, index: str) -> str:
    """Write the uv binaries into dest; returns the version."""
    wheel = pick_wheel(list_files(index), host_platform())
    if not wheel["sha256"]:
        raise FetchError(f"the index gives no sha256 for {wheel['filename']}: refusing an unchecked binary")
    os.makedirs(dest, exist_ok=True)
    with tempfile.TemporaryFile() as tmp:
        digest = hashlib.sha256()
        try:
            with urllib.request.urlopen(wheel["url"], timeout=TIMEOUT_S) as response:
                while chunk := response.read(1 << 20):
                    digest.update(chunk)
                    tmp.write(chunk)
        except OSError as error:
            raise FetchError(f"cannot download {wheel['url']}: {error}") from error
        if digest.hexdigest() != wheel["sha256"].lower():
            raise FetchError(f"{wheel['filename']}: sha256 {digest.hexdigest()} is not the index's {wheel['sha256']}")
        tmp.seek(0)
        with zipfile.ZipFile(tmp) as archive:
            members = {
                m.rsplit("/", 1)[-1]: m for m in archive.namelist() if re.match(r"^[^/]+\.data/scripts/uvx?$", m)
            }
            if "uv" not in members:
                raise FetchError(f"{wheel['filename']} holds no .data/scripts/uv")
            for name, member in members.items():
                part = os.path.join(dest, f".{name}.part")
                with archive.open(member) as source, open(part, "wb") as target:
                    while chunk := source.read(1 << 20):
                        target.write(chunk)
                os.chmod(part, 0o755)
                os.replace(part, os.path.join(dest, name))
    return WHEEL.match(wheel["filename"])["version"]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} DEST_DIR", file=sys.stderr)
        return 2
    index = os.environ.get("PIP_INDEX_URL") or DEFAULT_INDEX
    try:
        print(fetch(argv[1], index))
    except FetchError as error:
        print(f"fetch_uv: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
