"""Atomic file IO: files and folders appear complete or not at all, for one writer and for racing writers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_fedshard.checkpoint.atomic import (
    local_path,
    move_into_place,
    publish,
    remove,
    save_file,
    staging_path,
    unique_staging_dir,
    write_text,
)


def test_local_path_refuses_urls():
    assert local_path("runs/last.ckpt") == Path("runs/last.ckpt")
    with pytest.raises(ValueError, match="is a URL"):
        local_path("s3://bucket/last.ckpt")


def test_save_file_then_move_into_place_replaces_a_file(tmp_path):
    path = tmp_path / "a.ckpt"
    path.write_text("old")
    staging = staging_path(path)
    assert staging == tmp_path / ".a.ckpt.partial"
    save_file({"x": torch.arange(3)}, staging)
    move_into_place(staging, path)
    assert torch.equal(torch.load(path)["x"], torch.arange(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ckpt"]


def test_move_into_place_replaces_a_folder_and_leaves_nothing_aside(tmp_path):
    path, staging = tmp_path / "ckpt", tmp_path / ".ckpt.partial"
    (path / "old").mkdir(parents=True)
    (staging / "new").mkdir(parents=True)
    move_into_place(staging, path)
    assert [p.name for p in path.iterdir()] == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_write_text_creates_folders_replaces_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "cache" / "tokenizer.json"
    write_text(path, "first")
    write_text(path, "second ✓")
    assert path.read_text(encoding="utf-8") == "second ✓"
    assert [p.name for p in path.parent.iterdir()] == ["tokenizer.json"]


def test_publish_keeps_the_first_copy_and_drops_later_ones(tmp_path):
    path = tmp_path / "tokens"
    first, second = unique_staging_dir(path), unique_staging_dir(path)
    assert first != second and first.parent == tmp_path and first.name.startswith(".tokens.")
    (first / "data").write_text("first")
    (second / "data").write_text("second")
    assert publish(first, path) and not publish(second, path)
    assert (path / "data").read_text() == "first" and not second.exists()


def test_remove_handles_files_folders_links_and_nothing(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "dir")
    for name in ("link", "dir", "file", "missing"):
        remove(tmp_path / name)
    assert list(tmp_path.iterdir()) == []
