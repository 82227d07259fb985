"""Fetch the real public PDFs used by the realdocs retrieval benchmark.

Usage::

    python -m mmrag.bench.realdocs.fetch --out DIR                # the tuning set, bench/realdocs
    python -m mmrag.bench.realdocs.fetch --set heldout --out DIR  # the held-out set, mmrag/bench/heldout

Every PDF comes from a Debian 12 (bookworm) documentation package listed in
``mmrag/bench/realdocs/sources.json``.  For each entry the script asks the package
client for it by name, ``apt-get download <package>=<version>`` in a temporary
folder (no root needed), as a user's machine would: apt reaches whichever
archive mirror the machine's apt sources name, so no host is written here.  It
then checks the ``.deb``'s SHA-256, reads the ``ar`` archive itself (no dpkg
needed), extracts the PDF member from ``data.tar.xz`` (or ``.gz``/``.bz2``;
``.zst`` falls back to the ``zstd`` or ``dpkg-deb`` command), gunzips a member
the package ships compressed (``dotguide.pdf.gz``), writes ``DIR/<doc>`` and
checks the PDF's SHA-256.  A PDF already in DIR with the
right checksum is kept and its package is not downloaded.

Standard library and apt-get only.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

SOURCES = Path(__file__).with_name("sources.json")
BY_HAND = "or copy the PDFs listed in mmrag/bench/realdocs/sources.json into DIR by hand"
APT_HINT = (
    "install apt / run on Debian 12 (bookworm) with its main archive in the apt sources, " + BY_HAND
)


class FetchError(RuntimeError):
    """A document could not be fetched or failed its checksum."""


def load_sources(path: Path = SOURCES) -> list[dict]:
    """The entries of sources.json: doc, package, version, deb_sha256, member, pdf_sha256, pages, kind."""
    return json.loads(Path(path).read_text(encoding="utf-8"))


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def apt_download(package: str, version: str) -> tuple[str, bytes]:
    """``apt-get download package=version`` in an empty temporary folder; the .deb's file name and bytes.

    The folder holds only what apt-get wrote, so the .deb is found whatever name apt gives it (an epoch is
    written ``%3a``: ``r-cran-vcd_1%3a1.4-11-1_all.deb``).  apt checks the archive's signed indexes itself;
    the caller pins the exact file with its SHA-256.
    """
    spec = f"{package}={version}"
    exe = shutil.which("apt-get")
    if exe is None:
        raise FetchError(f"apt-get is not on PATH, and the PDFs come from Debian packages: {APT_HINT}")
    with tempfile.TemporaryDirectory(prefix="realdocs-apt-") as tmp:
        try:
            done = subprocess.run(
                [exe, "download", spec], cwd=tmp, stdin=subprocess.DEVNULL, capture_output=True,
                text=True, check=False,  # a failure is read below, with apt's own reason
            )
        except OSError as exc:
            raise FetchError(f"cannot run `apt-get download {spec}`: {exc}; {APT_HINT}") from exc
        debs = sorted(Path(tmp).glob("*.deb"))
        if done.returncode != 0 or len(debs) != 1:
            output = (done.stderr + done.stdout).strip()
            errors = [line for line in output.splitlines() if line.startswith("E:")]  # apt's own reasons
            said = " ".join(errors) if errors else output[-400:] or "no message"
            raise FetchError(
                f"`apt-get download {spec}` failed (exit {done.returncode}, {len(debs)} .deb written): "
                f"{said}. apt must know {spec}: run `apt-get update` (as root) on Debian 12 (bookworm) "
                f"with its main archive in the apt sources, {BY_HAND}"
            )
        return debs[0].name, debs[0].read_bytes()


def ar_members(data: bytes) -> dict[str, bytes]:
    """Parse a Unix ``ar`` archive (the .deb container) into name -> bytes."""
    if not data.startswith(b"!<arch>\n"):
        raise FetchError("not a .deb (ar) archive: bad magic")
    pos, out = 8, {}
    while pos + 60 <= len(data):
        header = data[pos : pos + 60]
        if header[58:60] != b"`\n":
            raise FetchError(f"corrupt ar header at offset {pos}")
        name = header[0:16].decode("ascii").strip().removesuffix("/")  # GNU ar ends names with /
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
    wanted = {member, member.lstrip("./"), "./" + member.lstrip("./")}
    # tarfile handles plain, .gz, .bz2 and .xz transparently.
    with (_tar_from_zstd(payload, deb_bytes) if data_name.endswith(".zst")
          else tarfile.open(fileobj=io.BytesIO(payload), mode="r:*")) as tar:
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
    """Make sure every PDF in sources.json (or ``sources``) is in ``out``; return their paths.

    Raises FetchError when apt-get is missing or cannot download a package, or on a checksum mismatch.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sources = load_sources() if sources is None else sources
    debs: dict[str, bytes] = {}  # package=version -> bytes, several PDFs may share a package
    paths: list[Path] = []
    for i, src in enumerate(sources, 1):
        doc, target = src["doc"], out / src["doc"]
        tag = f"[{i}/{len(sources)}] {doc}"
        if target.is_file() and _sha256_file(target) == src["pdf_sha256"]:
            progress(f"{tag}: already present, checksum ok")
            paths.append(target)
            continue
        spec = f"{src['package']}={src['version']}"
        if spec not in debs:
            progress(f"{tag}: apt-get download {spec}")
            name, data = apt_download(src["package"], src["version"])
            got = _sha256_bytes(data)
            if got != src["deb_sha256"]:
                raise FetchError(
                    f"{tag}: checksum mismatch for {name} ({spec}): expected {src['deb_sha256']}, "
                    f"got {got}. The archive's package is not the one the labels were written on; "
                    "update deb_sha256/pdf_sha256 in mmrag/bench/realdocs/sources.json only after "
                    f"re-checking labels.jsonl pages, {BY_HAND}"
                )
            debs[spec] = data
        pdf = extract_member(debs[spec], src["member"])
        if src["member"].endswith(".gz"):  # a PDF the package ships gzipped
            pdf = gzip.decompress(pdf)
        got = _sha256_bytes(pdf)
        if got != src["pdf_sha256"]:
            raise FetchError(
                f"{tag}: PDF checksum mismatch for {src['member']}: expected "
                f"{src['pdf_sha256']}, got {got}; fix pdf_sha256 in "
                "mmrag/bench/realdocs/sources.json only after re-checking labels.jsonl"
            )
        tmp = target.with_name(target.name + ".part")
        tmp.write_bytes(pdf)
        tmp.replace(target)
        progress(f"{tag}: wrote {target} ({len(pdf)} bytes, {src['pages']} pages)")
        paths.append(target)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m mmrag.bench.realdocs.fetch",
        description="Fetch the retrieval benchmark's PDFs from Debian packages with apt-get download: the "
                    "realdocs set (every choice is tuned on it) or the held-out set (reported only).",
    )
    ap.add_argument("--out", required=True, type=Path, help="folder for the PDFs")
    ap.add_argument("--set", choices=("realdocs", "heldout"), default="realdocs",
                    help="which set: realdocs (mmrag/bench/realdocs) or heldout (mmrag/bench/heldout)")
    args = ap.parse_args(argv)
    try:
        if args.set == "heldout":
            from mmrag.bench.heldout import SOURCES as HELDOUT

            paths = fetch(args.out, sources=load_sources(HELDOUT))
        else:
            paths = fetch(args.out)
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{len(paths)} PDFs ready in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
