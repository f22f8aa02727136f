"""Tests of the offline Shakespeare corpus, tokenizer and data module (single process, no network)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from torch.utils.data import DistributedSampler, Subset

from lightning_fedshard.examples import LlamaLM
from lightning_fedshard.examples.shakespeare import (
    GENRES,
    ShakespeareDataModule,
    assign_genres,
    list_plays,
    markdown_to_text,
    pack_windows,
    train_tokenizer,
)

SEQ_LEN = 64


def _offline_env(mp: pytest.MonkeyPatch, root: Path) -> None:
    mp.setenv("HF_HOME", str(root / "hf_home"))
    mp.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A cache folder prepared once for the module (text export, 4096-token BPE, tokenized plays)."""
    root = tmp_path_factory.mktemp("shakespeare")
    with pytest.MonkeyPatch.context() as mp:
        _offline_env(mp, root)
        ShakespeareDataModule(cache_dir=str(root / "cache")).prepare_data()
        yield root / "cache"


@pytest.fixture
def datamodule(cache_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> ShakespeareDataModule:
    _offline_env(monkeypatch, tmp_path)
    dm = ShakespeareDataModule(cache_dir=str(cache_dir), seq_len=SEQ_LEN, batch_size=4)
    dm.prepare_data()  # everything cached: a no-op
    dm.setup("fit")
    return dm


def _records(cache_dir: Path, split: str) -> list[dict[str, str]]:
    lines = (cache_dir / "v2" / "text" / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


@dataclass(frozen=True)
class FakeTopology:
    """Stand-in for the federation topology: consecutive ranks form a group."""

    num_groups: int
    group_size: int

    @property
    def world_size(self) -> int:
        return self.num_groups * self.group_size

    def coords(self, rank: int) -> tuple[int, int, int]:
        group, position = divmod(rank, self.group_size)
        return group, 0, position


def _attach(dm: ShakespeareDataModule, rank: int, world_size: int, topology: FakeTopology | None) -> None:
    # Only the attributes the data module reads; a real Trainer would need processes.
    dm.trainer = SimpleNamespace(  # type: ignore[assignment]
        strategy=SimpleNamespace(topology=topology), global_rank=rank, world_size=world_size
    )


def test_markdown_to_text() -> None:
    markdown = (
        "# Play\n\n## ACT I\n\n### SCENE I. A room.\n\n_Enter KING and\nQUEEN_\n\n"
        "**KING**  \nWell met,  \n__\\[Aside]_  \nmy lady\\--\n\n_Exeunt_\n"
    )
    expected = (
        "Play\n\nACT I\n\nSCENE I. A room.\n\n[Enter KING and QUEEN]\n\n"
        "KING:\nWell met,\n[Aside]\nmy lady--\n\n[Exeunt]\n"
    )
    assert markdown_to_text(markdown) == expected


def test_corpus_has_no_markdown_left(cache_dir: Path) -> None:
    texts = [record["text"] for split in ("train", "validation") for record in _records(cache_dir, split)]
    assert len(texts) == 38
    assert not [text for text in texts if any(char in text for char in "*_#\\")]
    assert 4.5e6 < sum(len(text) for text in texts) < 5.5e6


def test_held_out_plays_are_whole_and_disjoint(cache_dir: Path) -> None:
    train = {(r["genre"], r["play"]) for r in _records(cache_dir, "train")}
    val = {(r["genre"], r["play"]) for r in _records(cache_dir, "validation")}
    assert not train & val
    assert sorted(genre for genre, _ in val) == sorted(GENRES)  # one play per genre
    every_play = {(genre, path.stem) for genre, paths in list_plays().items() for path in paths}
    assert train | val == every_play


def test_tokenizer_training_is_deterministic(cache_dir: Path) -> None:
    texts = [record["text"] for record in _records(cache_dir, "train")][::4]  # 8 plays keep it quick
    first, second = train_tokenizer(texts, 1024), train_tokenizer(texts, 1024)
    assert first.get_vocab_size() == 1024
    assert first.to_str() == second.to_str()


def test_tokenizer_round_trips_validation_text(datamodule: ShakespeareDataModule, cache_dir: Path) -> None:
    tokenizer = datamodule.tokenizer
    assert tokenizer is not None and len(tokenizer) == 4096
    for record in _records(cache_dir, "validation"):
        ids = tokenizer(record["text"])["input_ids"]
        assert tokenizer.decode(ids) == record["text"], record["play"]
    # Byte-level BPE at 4096 tokens packs about three bytes of English into a token.
    assert 2.5 < datamodule.val_bytes_per_token < 3.5


def test_windows_are_shifted_pairs(datamodule: ShakespeareDataModule) -> None:
    batch = next(iter(datamodule.train_dataloader()))
    assert batch["input_ids"].shape == batch["labels"].shape == (4, SEQ_LEN)
    assert batch["input_ids"].dtype == torch.long
    window = datamodule.val_set.windows[0]
    sample = datamodule.val_set[0]
    torch.testing.assert_close(sample["input_ids"], window[:-1])
    torch.testing.assert_close(sample["labels"], window[1:])
    assert int(datamodule.train_set.windows.max()) < 4096
    # About 1.38 M training and 256 k validation tokens at vocabulary 4096.
    assert 1.2e6 < len(datamodule.train_set) * SEQ_LEN < 1.5e6
    assert 2.0e5 < len(datamodule.val_set) * SEQ_LEN < 3.0e5


def test_pack_windows_overlap_by_one() -> None:
    windows = pack_windows(torch.arange(10), seq_len=3)
    assert windows.tolist() == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    assert pack_windows(torch.arange(3), seq_len=3).shape == (0, 4)


def test_window_caps_keep_every_genre(cache_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _offline_env(monkeypatch, tmp_path)
    dm = ShakespeareDataModule(cache_dir=str(cache_dir), seq_len=SEQ_LEN, max_train_windows=60, max_val_windows=12)
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set)) == (60, 12)
    assert set(dm.train_set.genres.tolist()) == set(range(len(GENRES)))


def test_iid_split_is_a_plain_shuffled_loader(datamodule: ShakespeareDataModule) -> None:
    loader = datamodule.train_dataloader()
    assert not isinstance(loader.sampler, DistributedSampler)  # Lightning adds its own over all ranks
    assert loader.dataset is datamodule.train_set


@pytest.mark.parametrize("num_groups,group_size", [(2, 2), (3, 1), (6, 2)])
def test_genre_split_gives_groups_disjoint_genres(
    datamodule: ShakespeareDataModule, num_groups: int, group_size: int
) -> None:
    datamodule.split = "genre"
    topology = FakeTopology(num_groups, group_size)
    genres_of_group: dict[int, set[int]] = {g: set() for g in range(num_groups)}
    seen: dict[int, list[int]] = {g: [] for g in range(num_groups)}
    lengths = set()
    for rank in range(topology.world_size):
        _attach(datamodule, rank, topology.world_size, topology)
        loader = datamodule.train_dataloader()
        assert isinstance(loader.sampler, DistributedSampler)
        assert (loader.sampler.num_replicas, loader.sampler.rank) == (group_size, rank % group_size)
        lengths.add(len(loader))
        assert isinstance(loader.dataset, Subset)
        positions = [loader.dataset.indices[i] for i in loader.sampler]
        group = rank // group_size
        genres_of_group[group] |= set(datamodule.train_set.genres[positions].tolist())
        seen[group] += positions
    assert len(lengths) == 1  # every rank runs epochs of the same length: groups stay in lockstep
    for group, genres in genres_of_group.items():
        assert {GENRES[code] for code in genres} <= set(assign_genres(num_groups)[group])
        assert len(seen[group]) == len(set(seen[group]))  # ranks of a group see disjoint windows
    for a in range(num_groups):
        for b in range(a + 1, num_groups):
            assert not genres_of_group[a] & genres_of_group[b]


def test_genre_split_without_topology_is_one_group(datamodule: ShakespeareDataModule) -> None:
    datamodule.split = "genre"
    _attach(datamodule, rank=1, world_size=2, topology=None)
    sampler = datamodule.train_dataloader().sampler
    assert isinstance(sampler, DistributedSampler)
    assert (sampler.num_replicas, sampler.rank) == (2, 1)
    assert len(sampler) == len(datamodule.train_set) // 2


def test_genre_split_rejects_more_groups_than_genres(datamodule: ShakespeareDataModule) -> None:
    datamodule.split = "genre"
    _attach(datamodule, rank=0, world_size=7, topology=FakeTopology(7, 1))
    with pytest.raises(ValueError, match="num_groups=7"):
        datamodule.train_dataloader()


def test_assign_genres_covers_all_genres_once() -> None:
    for num_groups in range(1, len(GENRES) + 1):
        groups = assign_genres(num_groups)
        assert sorted(genre for group in groups for genre in group) == sorted(GENRES)
    assert assign_genres(2) == [("histories", "tragedies", "roman"), ("comedies", "romances", "problems")]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"seq_len": 0}, "seq_len=0"),
        ({"batch_size": -1}, "batch_size=-1"),
        ({"vocab_size": 100}, "vocab_size=100"),
        ({"split": "random"}, "split='random'"),
        ({"num_workers": -2}, "num_workers=-2"),
        ({"max_train_windows": 0}, "max_train_windows=0"),
        ({"max_val_windows": 0}, "max_val_windows=0"),
    ],
)
def test_bad_arguments_raise(kwargs: dict[str, object], message: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=message):
        ShakespeareDataModule(cache_dir=str(tmp_path), **kwargs)  # type: ignore[arg-type]


def test_setup_before_prepare_data_fails_loudly(tmp_path: Path) -> None:
    dm = ShakespeareDataModule(cache_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match="prepare_data"):
        dm.setup("fit")
    with pytest.raises(RuntimeError, match="setup"):
        _ = dm.val_bytes_per_token


def test_cache_loads_without_datasets(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every rank runs setup(): the token ids load with torch alone, not through the `datasets` library.
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now raises ImportError
    dm = ShakespeareDataModule(cache_dir=str(cache_dir))
    dm.prepare_data()
    dm.setup("fit")
    assert len(dm.train_set) > 0


def test_saved_tokenizer_loads_with_auto_tokenizer(datamodule: ShakespeareDataModule, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    datamodule.save_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert datamodule.tokenizer is not None
    text = "ROMEO:\nBut, soft! what light through yonder window breaks?\n"
    ids = tokenizer(text)["input_ids"]
    assert ids == datamodule.tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_save_tokenizer_before_setup_fails_loudly(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="setup"):
        ShakespeareDataModule(cache_dir=str(tmp_path)).save_tokenizer(tmp_path / "out")


def test_model_and_tokenizer_folder_generates_with_plain_transformers(
    datamodule: ShakespeareDataModule, tmp_path: Path
) -> None:
    """What train_shakespeare.py writes, loaded as in the README (a tiny model: only the plumbing is checked)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lm = LlamaLM(size="xs", vocab_size=4096, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    lm.save_pretrained(tmp_path)
    datamodule.save_tokenizer(tmp_path)

    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    inputs = tokenizer("ROMEO:\n", return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=5, do_sample=True, top_k=50)
    assert out.shape == (1, inputs["input_ids"].shape[1] + 5)
    assert tokenizer.decode(out[0]).startswith("ROMEO:\n")


CONFIGS = sorted((Path(__file__).parents[2] / "configs" / "shakespeare").glob("*.yaml"))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda path: path.stem)
def test_example_configs_run_within_one_epoch(config: Path, cache_dir: Path) -> None:
    """The configs run one epoch cut to `limit_train_batches`: the progress bar then counts the run exactly."""
    cfg = yaml.safe_load(config.read_text())
    trainer, data_args = cfg["trainer"], cfg["data"]["init_args"]
    assert trainer["max_epochs"] == 1 and "max_steps" not in trainer
    world_size = trainer["devices"] * trainer["num_nodes"]
    num_groups = trainer["strategy"]["init_args"]["num_groups"]
    dm = ShakespeareDataModule(cache_dir=str(cache_dir), **data_args)
    dm.setup("fit")
    if dm.split == "genre":
        topology = FakeTopology(num_groups, world_size // num_groups)
        _attach(dm, rank=0, world_size=world_size, topology=topology)
        batches_per_epoch = len(dm.train_dataloader())
    else:  # Lightning's DistributedSampler deals the windows over all ranks
        batches_per_epoch = len(dm.train_set) // world_size // dm.batch_size
    assert batches_per_epoch >= trainer["limit_train_batches"]
