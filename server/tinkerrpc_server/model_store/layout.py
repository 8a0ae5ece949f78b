"""How a built-in model lies on disk: built once into its directory under the model dir (written aside
and renamed into place), and laid out in the Hugging Face hub cache under its name, so Hugging Face's
own loaders find it by name offline."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("tinkerrpc.models")


def hf_hub_cache() -> Path:
    """The hub cache Hugging Face's loaders read: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


# (name, model directory, cache) triples already laid out by this process: the check hashes every file.
_published: set[tuple[str, Path, Path]] = set()


def offer_to_hf_cache(name: str, path: Path) -> None:
    """Lay out a built-in model in the hub cache once per process; a cache that cannot be written (a
    read-only home) costs loading by name, not the model."""
    cache = hf_hub_cache()
    key = (name, path, cache)
    if key in _published:
        return
    try:
        publish_to_hf_cache(name, path, cache)
    except OSError as err:
        log.warning("cannot lay out %s in the Hugging Face cache %s: %s", name, cache, err)
    _published.add(key)


def publish_to_hf_cache(name: str, model_path: Path, cache: Path) -> Path:
    """Lay out the files of `model_path` as the hub cache entry of the repository `name`, as `hf download`
    would: blobs/<sha256>, snapshots/<revision>/<file> -> ../../blobs/<sha256>, refs/main = revision.

    The revision is a hash of the content, so this is idempotent; every piece is written aside and
    renamed into place, so a loader never sees a half-written entry and racing writers agree.
    Returns the snapshot directory."""
    repo = cache / f"models--{name.replace('/', '--')}"
    files = sorted(f for f in model_path.iterdir() if f.is_file())
    laid_out = _snapshot_linked_to(repo, files)
    if laid_out is not None:
        return laid_out
    digests = {f.name: file_sha256(f) for f in files}
    revision = hashlib.sha1("".join(f"{n}\0{d}\n" for n, d in digests.items()).encode()).hexdigest()
    snapshot = repo / "snapshots" / revision
    for directory in (repo / "blobs", repo / "snapshots", repo / "refs"):
        directory.mkdir(parents=True, exist_ok=True)
    for file, digest in digests.items():
        blob = repo / "blobs" / digest
        if not blob.is_file():
            staged = repo / "blobs" / f".{digest}.{os.getpid()}.incomplete"
            _link_or_copy(model_path / file, staged)
            os.replace(staged, blob)
    if not snapshot.is_dir():
        staging = Path(tempfile.mkdtemp(prefix=f".{revision}.", dir=repo))
        try:
            for file, digest in digests.items():
                (staging / file).symlink_to(Path("..", "..", "blobs", digest))
            os.rename(staging, snapshot)
        except OSError:
            if not snapshot.is_dir():  # else another writer finished first, with the same content
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    ref = repo / "refs" / "main"
    if not ref.is_file() or ref.read_text() != revision:
        staged_ref = ref.with_name(f".main.{os.getpid()}")
        staged_ref.write_text(revision)
        os.replace(staged_ref, ref)
    return snapshot


def _snapshot_linked_to(repo: Path, files: list[Path]) -> Path | None:
    """The snapshot refs/main names when its files are hard links to `files` (laid out before from
    these very files, which a built model never rewrites): found without hashing them again, which
    takes a second per engine start for the 0.44 GB Qwen3-width model."""
    ref = repo / "refs" / "main"
    if not ref.is_file():
        return None
    snapshot = repo / "snapshots" / ref.read_text()
    try:
        if sorted(p.name for p in snapshot.iterdir()) != [f.name for f in files]:
            return None
        if all(os.path.samefile(snapshot / f.name, f) for f in files):
            return snapshot
    except OSError:
        pass
    return None


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _link_or_copy(source: Path, target: Path) -> None:
    """A hard link when on the same file system (no second copy), else a copy; either way the cache
    entry survives the model dir's removal."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def build_once(path: Path, write: Callable[[Path], None]) -> Path:
    """`write` a model into a temporary sibling of `path` and rename it into place, unless `path` is
    there: a reader never sees a half-written model, and of two racing builders (which write the same
    content) the second keeps the first's directory."""
    if (path / "config.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.build-", dir=path.parent))
    try:
        write(staging)
        for file in staging.iterdir():
            _fsync_file(file)
        try:
            os.rename(staging, path)
        except OSError:
            if not (path / "config.json").is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return path


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
