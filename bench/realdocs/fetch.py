"""Fetch the real public PDFs used by the realdocs retrieval benchmark.

Usage::

    python -m bench.realdocs.fetch --out DIR

Every PDF comes from a Debian documentation package listed in
``bench/realdocs/sources.json``.  For each entry the script downloads the
``.deb`` from deb.debian.org, checks its SHA-256, reads the ``ar`` archive
itself (no dpkg needed), extracts the PDF member from ``data.tar.xz`` (or
``.gz``/``.bz2``; ``.zst`` falls back to the ``zstd`` or ``dpkg-deb``
command), writes ``DIR/<doc>`` and checks the PDF's SHA-256.  A PDF already in
DIR with the right checksum is kept and its package is not downloaded.

Standard library only.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

SOURCES = Path(__file__).with_name("sources.json")
NETWORK_HINT = (
    "this needs HTTP access to deb.debian.org; or copy the PDFs listed in "
    "bench/realdocs/sources.json into DIR by hand"
)


class FetchError(RuntimeError):
    """A document could not be fetched or failed its checksum."""


def load_sources(path: Path = SOURCES) -> list[dict]:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download(url: str, timeout: float = 60.0) -> bytes:
    req = urllib.request.Request(url, headers={"User-Agent": "mmrag-bench-realdocs/1"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.read()
    except (urllib.error.URLError, OSError) as exc:  # HTTPError is a URLError
        raise FetchError(f"cannot download {url}: {exc}; {NETWORK_HINT}") from exc


def ar_members(data: bytes) -> dict[str, bytes]:
    """Parse a Unix ``ar`` archive (the .deb container) into name -> bytes."""
    if not data.startswith(b"!<arch>\n"):
        raise FetchError("not a .deb (ar) archive: bad magic")
    pos, out = 8, {}
    while pos + 60 <= len(data):
        header = data[pos : pos + 60]
        if header[58:60] != b"`\n":
            raise FetchError(f"corrupt ar header at offset {pos}")
        name = header[0:16].decode("ascii").strip()
        if name.endswith("/"):  # GNU ar style
            name = name[:-1]
        size = int(header[48:58].decode("ascii").strip())
        pos += 60
        out[name] = data[pos : pos + size]
        pos += size + (size & 1)  # members are 2-byte aligned
    return out


def _tar_from_zstd(payload: bytes, deb_bytes: bytes) -> tarfile.TarFile:
    """Python's stdlib cannot read zstd; use an external tool if there is one."""
    if shutil.which("zstd"):
        raw = subprocess.run(
            ["zstd", "-dc"], input=payload, stdout=subprocess.PIPE, check=True
        ).stdout
        return tarfile.open(fileobj=io.BytesIO(raw), mode="r:")
    if shutil.which("dpkg-deb"):
        with tempfile.NamedTemporaryFile(suffix=".deb") as tmp:
            tmp.write(deb_bytes)
            tmp.flush()
            raw = subprocess.run(
                ["dpkg-deb", "--fsys-tarfile", tmp.name], stdout=subprocess.PIPE, check=True
            ).stdout
        return tarfile.open(fileobj=io.BytesIO(raw), mode="r:")
    raise FetchError(
        "package data is zstd-compressed, which the Python standard library cannot "
        "read; install the `zstd` command (apt-get install zstd) or dpkg-deb"
    )


def extract_member(deb_bytes: bytes, member: str) -> bytes:
    """Return the bytes of ``member`` (e.g. ./usr/share/doc/x/y.pdf) in a .deb."""
    members = ar_members(deb_bytes)
    data_name = next((n for n in members if n.startswith("data.tar")), None)
    if data_name is None:
        raise FetchError("no data.tar.* member in the .deb")
    payload = members[data_name]
    if data_name.endswith(".zst"):
        tar = _tar_from_zstd(payload, deb_bytes)
    else:
        # tarfile handles plain, .gz, .bz2 and .xz transparently.
        tar = tarfile.open(fileobj=io.BytesIO(payload), mode="r:*")
    wanted = {member, member.lstrip("./"), "./" + member.lstrip("./")}
    with tar:
        for info in tar:
            if info.name in wanted and info.isfile():
                fh = tar.extractfile(info)
                assert fh is not None
                return fh.read()
    raise FetchError(f"{member} not found in {data_name}")


def fetch(
    out: Path,
    *,
    progress: Callable[[str], object] = print,
    sources: list[dict] | None = None,
) -> list[Path]:
    """Make sure every PDF in sources.json is in ``out``; return their paths.

    Raises FetchError on a download failure or a checksum mismatch.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sources = load_sources() if sources is None else sources
    debs: dict[str, bytes] = {}  # url -> bytes, several PDFs may share a package
    paths: list[Path] = []
    for i, src in enumerate(sources, 1):
        doc, target = src["doc"], out / src["doc"]
        tag = f"[{i}/{len(sources)}] {doc}"
        if target.is_file() and _sha256_file(target) == src["pdf_sha256"]:
            progress(f"{tag}: already present, checksum ok")
            paths.append(target)
            continue
        url = src["url"]
        if url not in debs:
            progress(f"{tag}: downloading {url}")
            data = _download(url)
            got = _sha256_bytes(data)
            if got != src["deb_sha256"]:
                raise FetchError(
                    f"{tag}: checksum mismatch for {url}: expected {src['deb_sha256']}, "
                    f"got {got}. The mirror may carry a newer package version; update "
                    "url/deb_sha256/pdf_sha256 in bench/realdocs/sources.json (and re-check "
                    "labels.jsonl pages), or copy the listed PDFs into DIR by hand"
                )
            debs[url] = data
        pdf = extract_member(debs[url], src["member"])
        got = _sha256_bytes(pdf)
        if got != src["pdf_sha256"]:
            raise FetchError(
                f"{tag}: PDF checksum mismatch for {src['member']}: expected "
                f"{src['pdf_sha256']}, got {got}; fix pdf_sha256 in "
                "bench/realdocs/sources.json only after re-checking labels.jsonl"
            )
        tmp = target.with_name(target.name + ".part")
        tmp.write_bytes(pdf)
        tmp.replace(target)
        progress(f"{tag}: wrote {target} ({len(pdf)} bytes, {src['pages']} pages)")
        paths.append(target)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.realdocs.fetch",
        description="Download the realdocs benchmark PDFs from Debian packages.",
    )
    ap.add_argument("--out", required=True, type=Path, help="folder for the PDFs")
    args = ap.parse_args(argv)
    try:
        paths = fetch(args.out)
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{len(paths)} PDFs ready in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
