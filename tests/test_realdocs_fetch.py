"""mmrag/bench/realdocs/fetch.py (issue 43): the benchmark's PDFs are fetched with the package client by name,
`apt-get download <package>=<version>`, as a user's machine would, and checked twice (the .deb, the PDF); no
tracked file names a package registry's host.

Tests must not fetch: a stand-in for apt-get, first (and alone) on PATH, copies a tiny real .deb built here with
the standard library into its working folder under Debian's file name, and records the arguments it was given."""

from __future__ import annotations

import hashlib
import io
import json
import re
import shutil
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest

from mmrag.bench.realdocs.fetch import FetchError, fetch, load_sources

REPO = Path(__file__).resolve().parent.parent
PDF = b"%PDF-1.4\n% a stand-in page for the fetch tests\n%%EOF\n"
MEMBER = "./usr/share/doc/demo-doc/demo.pdf"
PACKAGE, VERSION = "demo-doc", "1:2.0-1"  # with an epoch, which apt writes %3a in the file name
DEB_NAME = "demo-doc_1%3a2.0-1_all.deb"


def _tar_xz(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _ar(members: dict[str, bytes]) -> bytes:
    """A Unix ar archive, the .deb container: 60-byte headers, members 2-byte aligned."""
    out = bytearray(b"!<arch>\n")
    for name, data in members.items():
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode("ascii")
        out += data + (b"\n" if len(data) % 2 else b"")
    return bytes(out)


def _deb(member: str = MEMBER, data: bytes = PDF) -> bytes:
    control = f"Package: {PACKAGE}\nVersion: {VERSION}\nArchitecture: all\nDescription: fetch test\n".encode()
    return _ar({
        "debian-binary": b"2.0\n",
        "control.tar.xz": _tar_xz({"./control": control}),
        "data.tar.xz": _tar_xz({member: data}),
    })


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def apt(tmp_path, monkeypatch):
    """A stand-in for apt-get (tests must not fetch): alone on PATH, so the real one cannot run; it records its
    arguments, one per line and one call per run, and copies the .deb into its working folder as apt would."""
    deb = tmp_path / "archive" / DEB_NAME
    deb.parent.mkdir()
    deb.write_bytes(_deb())
    calls = tmp_path / "apt-calls.log"
    stand_in = tmp_path / "bin" / "apt-get"
    stand_in.parent.mkdir()
    stand_in.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" "--" >> "{calls}"\n'
                        f'exec {shutil.which("cp")} "{deb}" "./{DEB_NAME}"\n')
    stand_in.chmod(stand_in.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", str(stand_in.parent))

    def calls_made() -> list[list[str]]:
        if not calls.exists():
            return []
        text = calls.read_text().split("--\n")
        return [run.splitlines() for run in text if run]

    return {"deb": deb.read_bytes(), "calls": calls_made, "archive": deb}  # archive: the .deb it hands out


def _sources(tmp_path: Path, deb_sha256: str) -> list[dict]:
    """A sources.json of one entry in the shape of mmrag/bench/realdocs/sources.json, read by the same loader."""
    path = tmp_path / "sources.json"
    path.write_text(json.dumps([{
        "doc": "demo.pdf", "package": PACKAGE, "version": VERSION, "deb_sha256": deb_sha256,
        "member": MEMBER, "pdf_sha256": _sha256(PDF), "pages": 1, "kind": "slides",
    }]))
    return load_sources(path)


def test_the_pdf_is_fetched_by_name_with_apt_get_download_and_checked(tmp_path, apt):
    out = tmp_path / "docs"
    said: list[str] = []
    assert fetch(out, sources=_sources(tmp_path, _sha256(apt["deb"])), progress=said.append) == [out / "demo.pdf"]
    assert (out / "demo.pdf").read_bytes() == PDF
    assert apt["calls"]() == [["download", f"{PACKAGE}={VERSION}"]]
    assert not list(out.glob("*.deb")) and not list(out.glob("*.part"))  # only the PDF lands in DIR
    assert "apt-get download demo-doc=1:2.0-1" in said[0]

    said.clear()  # a second run: the PDF is there with its checksum, nothing is downloaded
    assert fetch(out, sources=_sources(tmp_path, _sha256(apt["deb"])), progress=said.append) == [out / "demo.pdf"]
    assert len(apt["calls"]()) == 1 and "already present" in said[0]


def test_a_deb_with_another_checksum_is_refused_naming_the_file_and_both_hashes(tmp_path, apt):
    out, expected = tmp_path / "docs", "0" * 64
    with pytest.raises(FetchError) as refused:
        fetch(out, sources=_sources(tmp_path, expected), progress=lambda _: None)
    message = str(refused.value)
    assert DEB_NAME in message and expected in message and _sha256(apt["deb"]) in message
    assert "mmrag/bench/realdocs/sources.json" in message
    assert not (out / "demo.pdf").exists()


def test_without_apt_get_the_error_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))  # a real condition: no apt-get on PATH
    with pytest.raises(FetchError) as refused:
        fetch(tmp_path / "docs", sources=_sources(tmp_path, "0" * 64), progress=lambda _: None)
    message = str(refused.value)
    assert "apt-get is not on PATH" in message
    assert "Debian 12 (bookworm) with its main archive in the apt sources" in message
    assert "copy the PDFs listed in mmrag/bench/realdocs/sources.json into DIR by hand" in message


def test_a_version_apt_does_not_know_names_apt_get_update_and_the_package(tmp_path, monkeypatch):
    stand_in = tmp_path / "bin" / "apt-get"  # a stand-in for apt-get that answers as apt does for an unknown version
    stand_in.parent.mkdir()
    stand_in.write_text("#!/bin/sh\necho \"E: Version '2.0-1' for 'demo-doc' was not found\" >&2\nexit 100\n")
    stand_in.chmod(stand_in.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", str(stand_in.parent))
    with pytest.raises(FetchError) as refused:
        fetch(tmp_path / "docs", sources=_sources(tmp_path, "0" * 64), progress=lambda _: None)
    message = str(refused.value)
    assert "`apt-get update`" in message and f"{PACKAGE}={VERSION}" in message and "was not found" in message
    assert not (tmp_path / "docs" / "demo.pdf").exists()


def test_a_pdf_the_package_ships_gzipped_is_written_unzipped_and_checked_unzipped(tmp_path, apt):
    # graphviz-doc ships dotguide.pdf.gz (the held-out set's first document)
    import gzip

    member = MEMBER + ".gz"
    deb = _deb(member, gzip.compress(PDF))
    apt["archive"].write_bytes(deb)  # the .deb the stand-in hands out
    (source,) = _sources(tmp_path, _sha256(deb))
    out = tmp_path / "docs"
    assert fetch(out, sources=[{**source, "member": member}], progress=lambda _: None) == [out / "demo.pdf"]
    assert (out / "demo.pdf").read_bytes() == PDF


@pytest.mark.parametrize("which", ["realdocs", "heldout"])
def test_the_real_sources_name_packages_not_hosts(which):
    from mmrag.bench.heldout import SOURCES as HELDOUT
    from mmrag.bench.realdocs.fetch import SOURCES as REALDOCS

    sources = load_sources(HELDOUT if which == "heldout" else REALDOCS)
    for src in sources:
        assert set(src) == {"doc", "package", "version", "deb_sha256", "member", "pdf_sha256", "pages", "kind"}, src
        assert re.fullmatch(r"[0-9a-f]{64}", src["deb_sha256"]) and re.fullmatch(r"[0-9a-f]{64}", src["pdf_sha256"])
    assert len(sources) >= 5


def test_the_held_out_set_shares_no_document_with_the_set_everything_is_tuned_on():
    from mmrag.bench.heldout import SOURCES as HELDOUT

    held, tuned = load_sources(HELDOUT), load_sources()
    assert not {s["doc"] for s in held} & {s["doc"] for s in tuned}
    assert not {s["pdf_sha256"] for s in held} & {s["pdf_sha256"] for s in tuned}


# Patterns, with escaped dots and a character class, so that this file does not name the hosts it looks for.
REGISTRY_HOSTS = re.compile(rb"debian\.org|ubuntu\.com|files\.python[h]osted\.org|pypi\.org|download\.pytorch\.org|"
                            rb"anaconda\.(org|com)|npmjs\.org|huggingface\.co", re.IGNORECASE)


def test_no_tracked_file_names_a_package_registry_host():
    """Documents and packages are fetched by name with the package clients (apt-get, pip), which reach whatever
    mirror the machine is configured for; a host written into the repository would bypass that."""
    if not (REPO / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    found = []
    for name in filter(None, listed.decode().split("\0")):
        path = REPO / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8000]:  # binary, as git judges it
            continue
        for hit in REGISTRY_HOSTS.finditer(data):
            line = data.count(b"\n", 0, hit.start()) + 1
            found.append(f"{name}:{line}: {hit.group().decode()}")
    assert not found, found


def test_the_held_out_labels_are_well_formed_and_as_the_protocol_asks():
    """mmrag/bench/heldout/README.md: at least 60 questions over its five documents, half about figures, a dozen
    needing several pages; every page within its document."""
    from mmrag.bench.heldout import LABELS, SOURCES
    from retrieval.evaluate import load_labels

    labelled = load_labels(LABELS)
    pages = {s["doc"]: s["pages"] for s in load_sources(SOURCES)}
    assert len(labelled) >= 60 and len({q.id for q in labelled}) == len(labelled)
    assert sum(q.kind == "figure" for q in labelled) >= len(labelled) / 2
    assert sum(q.needs_all for q in labelled) >= 12 and all(len(q.answers) >= 2 for q in labelled if q.needs_all)
    assert {doc for q in labelled for doc, _ in q.answers} == set(pages)
    assert all(1 <= page <= pages[doc] for q in labelled for doc, page in q.answers)
