"""Atomic file IO: a file or folder appears at its final path complete, or not at all.

Everything is first written next to its target and then renamed onto it. A rename within one file system is atomic,
so a reader (or a job resumed after a crash) never sees half a file. Two kinds of writers use this module:

* a single writer replacing an earlier version (checkpoints): :func:`staging_path`, :func:`save_file` and
  :func:`move_into_place`; a leftover of an interrupted write is overwritten by the next one;
* several processes racing to fill the same cache (the Shakespeare data cache): :func:`write_text` and
  :func:`unique_staging_dir` + :func:`publish` give each writer its own temporary name.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch


def local_path(path: str | Path) -> Path:
    """``path`` as a :class:`~pathlib.Path`, refusing URLs: only local or mounted file systems rename atomically.

    Raises:
        ValueError: If ``path`` is a URL such as ``s3://bucket/last.ckpt``.
    """
    if "://" in str(path):
        raise ValueError(
            f"Checkpoint path {str(path)!r} is a URL; federated checkpoints are written to local or mounted file"
            " systems, where they can be renamed into place atomically."
        )
    return Path(path)


def staging_path(path: Path) -> Path:
    """The fixed hidden name next to ``path`` (``.<name>.partial``) under which a single writer prepares it."""
    return path.with_name(f".{path.name}.partial")


def unique_staging_dir(path: Path) -> Path:
    """A new, empty hidden folder next to ``path``, owned by this process alone, to prepare ``path`` in."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))


def write_file(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Create ``path``, let ``write`` fill it and flush it to disk, so that a later rename never exposes a partial file.

    Args:
        path: The (staging) file to write; its folder must exist.
        write: Writes the content into the open binary file.
    """
    with open(path, "wb") as file:
        write(file)
        file.flush()
        os.fsync(file.fileno())


def save_file(obj: Any, path: Path) -> None:
    """``torch.save(obj)`` into ``path`` through :func:`write_file`."""
    write_file(path, lambda file: torch.save(obj, file))


def write_text(path: Path, text: str) -> None:
    """Atomically replace ``path`` with ``text`` (UTF-8); safe when several processes write the same file at once.

    Each writer prepares its own temporary file next to ``path``; the last rename wins and every reader sees one
    complete version. The folder is created if missing.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    staging = Path(name)
    try:
        write_file(staging, lambda file: file.write(text.encode("utf-8")))
        os.replace(staging, path)
    finally:
        remove(staging)  # only left if the write or the rename failed


def move_into_place(staging: Path, path: Path) -> None:
    """Rename a complete ``staging`` file or folder onto ``path``; an existing one there is removed only afterwards.

    Renaming a file over a file is atomic. A folder cannot replace a folder in one step, so the old one is first
    renamed aside: between the two renames ``path`` is missing, but nothing is lost.
    """
    if staging.is_file() and (path.is_file() or not path.exists()):
        os.replace(staging, path)
        return
    aside = path.with_name(f".{path.name}.old")
    remove(aside)
    if path.exists() or path.is_symlink():
        os.replace(path, aside)
    os.replace(staging, path)
    remove(aside)


def publish(staging: Path, path: Path) -> bool:
    """Rename the folder ``staging`` onto ``path`` unless another process published ``path`` first.

    For caches whose content is the same whoever builds it: the first complete copy wins and later ones are deleted.

    Returns:
        Whether this process' copy was published.

    Raises:
        OSError: If the rename failed for another reason than an existing ``path``.
    """
    try:
        os.rename(staging, path)
    except OSError:
        if not path.is_dir():
            raise
        remove(staging)
        return False
    return True


def remove(path: Path) -> None:
    """Delete the file, link or folder at ``path``, if there is one."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
