"""How the pseudo-gradient travels between the groups: the codecs, and the one table of ``reduce_dtype`` names.

A codec turns a flat float32 vector into what goes on the wire and back. :class:`FloatCodec` casts to a float dtype,
which the network sums as it is (an all-reduce); :class:`BlockQuantizer` is block-wise absmax int8/int4 quantization
and :class:`SparseTopK` chunk-local top-k sparsification with low-bit values (``reduce_dtype="sparse"``). Both are
chunk codecs (:class:`ChunkCodec`), whose pieces cannot be summed on the wire (see
:mod:`~lightning_fedshard.core.wire.reducers` for how they are summed, and
:mod:`~lightning_fedshard.core.wire.feedback` for error feedback, which any lossy codec can use). All are options of the
strategies: ``reduce_dtype="int4"`` or ``reduce_dtype=BlockQuantizer(bits=4, block_size=64)`` (in YAML a
``class_path`` with ``init_args``).

**Quantizer.** A float32 vector is cut into blocks of ``block_size`` values; each block keeps one float32 scale
``scale = absmax(block) / qmax`` and one integer per value, ``q = round(x / scale)`` (round half to even, clamped to
``[-qmax, qmax]``), with ``qmax = 127`` for int8 (one byte per value) and ``qmax = 7`` for int4 (two values per byte).
Dequantization is ``q * scale``. For every element, up to float32 rounding of that product::

    |x - dequantize(quantize(x))| <= scale / 2 = absmax(block) / (2 qmax)

An all-zero block gets scale 0 and codes 0, and dequantizes to exact zeros. The input must be finite (the outer step
checks this before the reduction); blocks whose absmax is below ``qmax`` times float32's smallest normal (~1.5e-36)
lose the bound to subnormal rounding.

**Default block size** (:data:`DEFAULT_BLOCK_SIZE` = 128), measured on two pseudo-gradients of a 1024 x 4096 weight
(row-major, so blocks lie along rows) with log-normal row and column scales: "AdamW" is ``W_0 - W_8`` after 8 AdamW
steps (lr 3e-4, betas 0.9/0.95, weight decay 0.1) on gradients of t(3) noise plus a persistent direction, i.e. the
difference of two nearby weight tensors (kurtosis 2: Adam's updates are nearly sign-like); "SGD" is the plain sum of
those 8 gradients (kurtosis ~2000, the heavy-tailed worst case). Relative L2 round-trip error of one quantization,
and bytes of one compressed sum vs a float32 ring all-reduce (``G = 4``, ``2**20`` values)::

    block size          32      64     128     256     512    1024
    int8 error AdamW  0.0042  0.0044  0.0045  0.0046  0.0047  0.0048
    int8 error SGD    0.0080  0.0100  0.0125  0.0155  0.0194  0.0242
    int4 error AdamW  0.0760  0.0796  0.0821  0.0840  0.0854  0.0865
    int4 error SGD    0.137   0.168   0.204   0.244   0.291   0.340
    scale bytes/value 0.125   0.0625  0.0313  0.0156  0.0078  0.0039   (4 / B)
    int8 bytes ratio  0.281   0.266   0.258   0.254   0.252   0.251
    int4 bytes ratio  0.156   0.141   0.133   0.129   0.127   0.126

int4 needs ``B >= 128`` to stay under 0.14x float32 (and int8 ``B >= 64`` under 0.27x). On AdamW pseudo-gradients the
error hardly depends on the block size, on heavy-tailed ones it grows ~20% per doubling above 128 while the bytes
shrink by 1-3%: 128 is the smallest block that meets both byte budgets.

This module knows nothing about Lightning; it takes tensors.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_fedshard.core.options.checks import check_positive_int
from lightning_fedshard.core.options.class_names import named_class
from lightning_fedshard.core.options.refusal import Advice, Refusal

#: Largest code of each bit width (codes are symmetric, in ``[-qmax, qmax]``).
QMAX: dict[int, int] = {8: 127, 4: 7}

#: Block size of the quantizer when none is given (see the measurement in the module docstring).
DEFAULT_BLOCK_SIZE = 128

#: The ``reduce_dtype`` names: the float dtypes an all-reduce sums, and the bits of the quantized ones.
FLOAT_REDUCE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
QUANTIZED_REDUCE_DTYPES: dict[str, int] = {"int8": 8, "int4": 4}
#: ``"sparse"``: :class:`SparseTopK` with its defaults.
SPARSE_REDUCE_DTYPES: tuple[str, ...] = ("sparse",)
REDUCE_DTYPE_NAMES: tuple[str, ...] = (*FLOAT_REDUCE_DTYPES, *QUANTIZED_REDUCE_DTYPES, *SPARSE_REDUCE_DTYPES)

SCALE_BYTES = 4  # one float32 per block


class Codec(ABC):
    """How a flat float32 vector is written on the wire. Subclasses are immutable values (compared by fields)."""

    #: Whether the wire values can be summed as they are (by an all-reduce), or must be decoded to be summed.
    summable: bool = False
    #: Whether decoding gives back exactly what was encoded (float32), so error feedback has nothing to carry.
    exact: bool = False

    @abstractmethod
    def describe(self) -> str:
        """A short name for logs, e.g. ``"int4 (blocks of 128)"``."""

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(vars(self).items()))))

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class FloatCodec(Codec):
    """A float dtype on the wire, summed by an all-reduce in that dtype.

    Args:
        dtype: ``"float32"`` (exact), ``"bfloat16"`` or ``"float16"`` (or the ``torch.dtype``).

    Raises:
        ValueError: For any other dtype.
    """

    summable = True

    def __init__(self, dtype: str | torch.dtype = "float32") -> None:
        name = str(dtype).removeprefix("torch.")
        if name not in FLOAT_REDUCE_DTYPES:
            raise ValueError(f"`dtype` must be one of {list(FLOAT_REDUCE_DTYPES)}, got {dtype!r}.")
        self.dtype = name

    @property
    def torch_dtype(self) -> torch.dtype:
        """The wire dtype."""
        return FLOAT_REDUCE_DTYPES[self.dtype]

    @property
    def exact(self) -> bool:  # type: ignore[override]
        """float32 carries float32 pseudo-gradients unchanged."""
        return self.dtype == "float32"

    @property
    def element_size(self) -> int:
        """Bytes per value on the wire."""
        return torch.empty(0, dtype=self.torch_dtype).element_size()

    def describe(self) -> str:
        """The dtype's name."""
        return self.dtype


class ChunkCodec(Codec):
    """A codec that writes whole blocks of values into self-contained byte *pieces*, one per part of a vector.

    A vector is padded to :meth:`padded_length` and cut into ``parts`` equal parts of whole blocks; each part is
    written as one uint8 piece of :meth:`piece_bytes` bytes. The pieces cannot be summed on the wire: the reducer
    (:class:`~lightning_fedshard.core.wire.reducers.ScatterGatherSum`) sends each part's pieces to the rank that sums
    that part, which decodes, sums and encodes it again.
    """

    #: Values per block: parts (and the padding) are whole numbers of blocks.
    block_size: int

    @abstractmethod
    def padded_length(self, numel: int, parts: int = 1) -> int:
        """Smallest length ``>= numel`` that splits into ``parts`` equal parts of whole blocks."""

    @abstractmethod
    def piece_bytes(self, chunk: int) -> int:
        """Bytes of the piece of a part of ``chunk`` values (a whole number of blocks)."""

    @abstractmethod
    def encode_pieces(self, values: Tensor, parts: int) -> Tensor:
        """The ``(parts, piece_bytes)`` uint8 pieces of a flat float32 vector of ``parts`` equal parts."""

    @abstractmethod
    def decode_pieces(self, pieces: Tensor, chunk: int) -> Tensor:
        """The ``(k, chunk)`` float32 values of ``k`` pieces (a ``(k, piece_bytes)`` uint8 tensor)."""


class BlockQuantizer(ChunkCodec):
    """Block-wise absmax quantization to int8 or int4 codes with one float32 scale per block (module docstring).

    Args:
        bits: 8 (int8) or 4 (int4, two values per byte).
        block_size: Values per block.

    Raises:
        ValueError: For ``bits`` other than 8 or 4, or a block size below 1.
    """

    def __init__(self, bits: int = 4, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        check_quantizer_args(bits, block_size)
        self.bits = bits
        self.block_size = block_size

    def describe(self) -> str:
        """E.g. ``"int4 (blocks of 128)"``."""
        return f"int{self.bits} (blocks of {self.block_size})"

    def padded_length(self, numel: int, parts: int = 1) -> int:
        """See :func:`padded_length`."""
        return padded_length(numel, self.bits, self.block_size, parts)

    def piece_bytes(self, chunk: int) -> int:
        """Bytes of ``chunk`` values (a whole number of blocks) on the wire: their scales, then their codes."""
        return SCALE_BYTES * (chunk // self.block_size) + chunk * self.bits // 8

    def encode(self, values: Tensor) -> tuple[Tensor, Tensor]:
        """Codes and scales of a flat float32 vector whose length is a whole number of blocks."""
        return encode_blocks(values.view(-1, self.block_size), self.bits)

    def decode(self, codes: Tensor, scales: Tensor) -> Tensor:
        """The flat float32 vector that :meth:`encode` produced ``codes`` and ``scales`` from."""
        return decode_blocks(codes, scales, self.bits, self.block_size).reshape(-1)

    def encode_pieces(self, values: Tensor, parts: int) -> Tensor:
        """One piece per part: its blocks' float32 scales, then their codes."""
        codes, scales = self.encode(values)
        chunk = values.numel() // parts
        scale_bytes = SCALE_BYTES * (chunk // self.block_size)
        pieces = torch.empty(parts, self.piece_bytes(chunk), dtype=torch.uint8, device=values.device)
        pieces[:, :scale_bytes] = scales.view(torch.uint8).view(parts, scale_bytes)
        pieces[:, scale_bytes:] = codes.view(parts, -1)
        return pieces

    def decode_pieces(self, pieces: Tensor, chunk: int) -> Tensor:
        """Inverse of :meth:`encode_pieces`."""
        scale_bytes = SCALE_BYTES * (chunk // self.block_size)
        scales = pieces[:, :scale_bytes].reshape(-1).view(torch.float32)
        codes = pieces[:, scale_bytes:].contiguous().reshape(-1)
        return self.decode(codes, scales).view(pieces.shape[0], chunk)


class SparseTopK(ChunkCodec):
    """Chunk-local top-k sparsification with low-bit values: the few largest entries of each chunk travel.

    Each chunk of ``chunk_size`` consecutive values keeps its ``k = ceil(density * chunk_size)`` entries of largest
    magnitude (ties go to the lower index, so every rank picks the same ones); the others are sent as zeros and, with
    error feedback, wait in the residual for a later sync. A kept entry travels as its index in the chunk
    (``ceil(log2(chunk_size))`` bits) and a ``value_bits`` code: a sign bit and ``value_bits - 1`` bits of magnitude on
    ``L = 2 ** (value_bits - 1)`` levels spaced evenly from the chunk's smallest kept magnitude ``lo`` to its largest
    ``hi`` (two float32 per chunk). A kept value is off by at most ``(hi - lo) / (2 (L - 1))`` (with one level,
    ``value_bits=1``, the level is ``(lo + hi) / 2`` and the bound ``(hi - lo) / 2``).

    Bytes per chunk: ``8 + k * (index_bits + value_bits) / 8``. At the defaults (``density=1/64``, 2-bit values,
    chunks of 4096: 64 kept entries of 12 + 2 bits) that is 120 bytes for 16384 bytes of float32: 0.0073x.

    Args:
        density: Fraction of each chunk that is kept, in ``(0, 1]``.
        value_bits: Bits per kept value, 1 to 8 (the sign is one of them).
        chunk_size: Values per chunk (the index of a kept entry is local to its chunk).

    Raises:
        ValueError: For a density outside ``(0, 1]``, ``value_bits`` outside 1..8, or a chunk size below 1.
    """

    def __init__(self, density: float = 1 / 64, value_bits: int = 2, chunk_size: int = 4096) -> None:
        if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0.0 < density <= 1.0:
            raise ValueError(f"`density` must be a number in (0, 1], got {density!r}.")
        if isinstance(value_bits, bool) or not isinstance(value_bits, int) or not 1 <= value_bits <= 8:
            raise ValueError(f"`value_bits` must be an integer from 1 to 8, got {value_bits!r}.")
        check_positive_int("chunk_size", chunk_size)
        self.density = float(density)
        self.value_bits = value_bits
        self.chunk_size = chunk_size

    @property
    def block_size(self) -> int:  # type: ignore[override]
        """The chunk: top-k picks inside it, and parts are whole numbers of chunks."""
        return self.chunk_size

    @property
    def kept(self) -> int:
        """Entries kept per chunk, ``ceil(density * chunk_size)``."""
        return max(1, math.ceil(self.density * self.chunk_size - 1e-9))

    @property
    def index_bits(self) -> int:
        """Bits of an entry's index inside its chunk."""
        return max(1, (self.chunk_size - 1).bit_length())

    def describe(self) -> str:
        """E.g. ``"sparse top-1.56% of 4096 (2-bit values)"``."""
        return f"sparse top-{100 * self.density:.3g}% of {self.chunk_size} ({self.value_bits}-bit values)"

    def padded_length(self, numel: int, parts: int = 1) -> int:
        """Whole chunks in each of ``parts`` parts."""
        unit = parts * self.chunk_size
        return -(-numel // unit) * unit

    def piece_bytes(self, chunk: int) -> int:
        """``8 m + ceil(m k index_bits / 8) + ceil(m k value_bits / 8)`` for the ``m`` chunks of a part."""
        entries = chunk // self.chunk_size * self.kept
        return (
            2 * SCALE_BYTES * (chunk // self.chunk_size)
            + _packed_bytes(entries, self.index_bits)
            + _packed_bytes(entries, self.value_bits)
        )

    def select(self, rows: Tensor) -> Tensor:
        """Indices ``(n, k)`` of the ``k`` largest magnitudes of each row of ``rows``, ascending; ties to the lower."""
        k = self.kept
        magnitudes = rows.abs()
        kth = magnitudes.topk(k, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
        above = magnitudes > kth
        tied = magnitudes == kth
        room = k - above.sum(dim=1, keepdim=True, dtype=torch.int32)
        keep = above | (tied & (tied.cumsum(dim=1, dtype=torch.int32) <= room))
        return keep.nonzero()[:, 1].view(rows.shape[0], k)

    def encode_pieces(self, values: Tensor, parts: int) -> Tensor:
        """One piece per part: its chunks' ``lo`` and ``hi`` (float32), packed indices, packed value codes."""
        rows = values.view(-1, self.chunk_size)  # (parts * m, C)
        index = self.select(rows)
        kept = rows.gather(1, index)
        magnitudes = kept.abs()
        lo, hi = magnitudes.amin(dim=1), magnitudes.amax(dim=1)
        levels = 1 << (self.value_bits - 1)
        if levels > 1:
            step = (hi - lo) / (levels - 1)
            divisor = torch.where(step > 0, step, torch.ones_like(step))
            level = ((magnitudes - lo[:, None]) / divisor[:, None]).round_().clamp_(0, levels - 1).to(torch.int32)
        else:
            level = torch.zeros_like(index, dtype=torch.int32)
        codes = level | ((kept < 0).to(torch.int32) << (self.value_bits - 1))
        chunks = rows.shape[0] // parts
        scales = torch.stack((lo, hi), dim=1).reshape(parts, 2 * chunks)  # (parts, 2 m) float32
        return torch.cat(
            (
                scales.contiguous().view(torch.uint8),
                _pack_bits(index.to(torch.int32).view(parts, -1), self.index_bits),
                _pack_bits(codes.view(parts, -1), self.value_bits),
            ),
            dim=1,
        )

    def decode_pieces(self, pieces: Tensor, chunk: int) -> Tensor:
        """Inverse of :meth:`encode_pieces`: the kept values in place, zeros elsewhere."""
        count, chunks = pieces.shape[0], chunk // self.chunk_size
        entries = chunks * self.kept
        scale_end = 2 * SCALE_BYTES * chunks
        index_end = scale_end + _packed_bytes(entries, self.index_bits)
        scales = pieces[:, :scale_end].reshape(-1).view(torch.float32).view(count * chunks, 2)
        index = _unpack_bits(pieces[:, scale_end:index_end], self.index_bits, entries)
        codes = _unpack_bits(pieces[:, index_end:], self.value_bits, entries)
        lo, hi = scales[:, :1], scales[:, 1:]
        level = (codes & ((1 << (self.value_bits - 1)) - 1)).view(count * chunks, self.kept).float()
        levels = 1 << (self.value_bits - 1)
        magnitude = lo + level * ((hi - lo) / (levels - 1)) if levels > 1 else (lo + hi).mul_(0.5).expand_as(level)
        negative = (codes >> (self.value_bits - 1)).view(count * chunks, self.kept).bool()
        kept = torch.where(negative, -magnitude, magnitude)
        out = torch.zeros(count * chunks, self.chunk_size, dtype=torch.float32, device=pieces.device)
        out.scatter_(1, index.view(count * chunks, self.kept).long(), kept)
        return out.view(count, chunk)


_MEANS = {"selected": "each value averaged over the groups that sent it", "all": "a mean over all groups"}
_GATHERED_WHOLE = "a mix encodes its messages in chunks of a codec that sums them on the way; SparseLoCo gathers whole"


class SparseLoCo(Codec):
    """The SparseLoCo / Covenant recipe: every group's top-k entries travel to every group, averaged where selected.

    Each group keeps a decaying error-feedback buffer ``e <- decay * e + d`` of its pseudo-gradients ``d`` (it stands in
    for outer momentum: use it with ``outer_optimizer="fedavg"``, plain SGD at learning rate 1). Of each chunk of
    ``chunk_size`` values of ``e`` the ``top_k`` largest magnitudes are sent, each as its index in the chunk and a
    2-bit code into a table of four levels of the whole message (``-hi, -lo, lo, hi``: the mean magnitude of the sent
    values below and above their median magnitude); what was sent, as decoded, leaves the buffer. Every group gathers
    every group's message (an all-gather: nothing is re-encoded on the way), clips each group's decoded update to the
    median of their norms (``clip=True``) and averages them: each value over the groups that sent it
    (``mean="selected"``, as Covenant's code does) or over all groups (``mean="all"``, a plain ``1/R`` mean as its
    paper writes it).

    Bytes per message: 16 for the table plus ``ceil(n k (index_bits + 2) / 8)`` for the ``n`` chunks. At the defaults
    (64 of 4096, 12-bit indices) that is 112 bytes per 16384 bytes of float32: 0.0068x.

    Args:
        top_k: Entries sent per chunk.
        chunk_size: Values per chunk.
        decay: Decay of the error-feedback buffer per sync, in ``[0, 1]``.
        mean: ``"selected"`` or ``"all"`` (see above).
        clip: Clip each group's update to the median norm of the groups' updates.

    Raises:
        ValueError: For a ``top_k`` outside ``1..chunk_size``, a decay outside ``[0, 1]`` or an unknown ``mean``.
    """

    exact = False
    #: Values of the table of levels (float32) at the start of every message.
    TABLE = 4
    #: The options this reduction does not run with, and why.
    refuses: ClassVar[dict[str, Refusal]] = {
        "gossip": Refusal(_GATHERED_WHOLE),
        "sampled": Refusal(_GATHERED_WHOLE),
        "mixing": Refusal(_GATHERED_WHOLE),
        "outer_momentum": Refusal(
            "its decaying error-feedback buffer is the recipe's outer momentum (it steps with plain averaging), and a"
            " second momentum on top compounds the two: on the examples' Llama (4 groups, sync every 8, validated at"
            " step 200 of 240, 2 seeds, benchmarks/pairs.py) outer Nesterov (0.7, 0.9) ended at validation loss"
            " 6.60 / 6.92 and rising, against 5.53 / 5.47 with plain averaging, and 6.11 / 6.00 even at an effective"
            " outer step of 1 (0.1, 0.9)",
            impossible=True,
        ),
    }
    #: The options this reduction runs with but advises against, and what was measured.
    advises_against: ClassVar[dict[str, Advice]] = {
        "eager_updates": Advice(
            "a group starts each round from its own 1/G share of the sum in flight, while SparseLoCo averages each"
            " value over the groups that sent it, clipped to the median norm; on the examples' Llama (4 groups, sync"
            " every 8, validated at step 200 of 240, 2 seeds, benchmarks/pairs.py) the pair ended at validation loss"
            " 6.45 / 6.49, behind float32 eager updates (5.96 / 5.92) and SparseLoCo alone (5.53 / 5.47); with chunks"
            " of 256 (top 4) it was level with float32 eager updates (5.95 / 5.88)"
        ),
    }

    def __init__(
        self, top_k: int = 64, chunk_size: int = 4096, decay: float = 0.95, mean: str = "selected", clip: bool = True
    ) -> None:
        check_positive_int("chunk_size", chunk_size)
        check_positive_int("top_k", top_k)
        if top_k > chunk_size:
            raise ValueError(f"`top_k={top_k}` must be at most `chunk_size={chunk_size}`.")
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay <= 1.0:
            raise ValueError(f"`decay` must be a number in [0, 1], got {decay!r}.")
        if mean not in ("selected", "all"):
            raise ValueError(f"`mean` must be 'selected' or 'all', got {mean!r}.")
        if not isinstance(clip, bool):
            raise ValueError(f"`clip` must be True or False, got {clip!r}.")
        self.top_k, self.chunk_size, self.decay, self.mean, self.clip = top_k, chunk_size, float(decay), mean, clip

    @property
    def index_bits(self) -> int:
        """Bits of an index inside its chunk."""
        return max(1, math.ceil(math.log2(self.chunk_size)))

    def describe(self, feedback: bool = True) -> str:
        """The recipe's parameters in words (without the buffer's decay when error feedback is off)."""
        decay = f" feedback decay {self.decay}," if feedback else ""
        return (
            f"SparseLoCo (top {self.top_k} of {self.chunk_size}, 2-bit table,{decay}"
            f" {'clipped to the median norm, ' if self.clip else ''}{_MEANS[self.mean]})"
        )

    def chunks(self, numel: int) -> int:
        """Chunks of a message of ``numel`` values (the last one padded with zeros)."""
        return -(-numel // self.chunk_size)

    def message_bytes(self, numel: int) -> int:
        """Bytes of the message of ``numel`` values."""
        entries = self.chunks(numel) * self.top_k
        return SCALE_BYTES * self.TABLE + _packed_bytes(entries, self.index_bits) + _packed_bytes(entries, 2)

    def encode(self, values: Tensor) -> Tensor:
        """The message of a flat float32 tensor: the table, then the packed indices, then the packed codes."""
        rows = F.pad(values, (0, self.chunks(values.numel()) * self.chunk_size - values.numel())).view(
            -1, self.chunk_size
        )
        index = SparseTopK(density=self.top_k / self.chunk_size, chunk_size=self.chunk_size).select(rows)
        kept = rows.gather(1, index).reshape(-1)
        magnitude = kept.abs()
        median = magnitude.median()
        high = magnitude > median
        lo = _mean_or_zero(magnitude[~high])
        hi = _mean_or_zero(magnitude[high])
        table = torch.stack((-hi, -lo, lo, hi)).to(torch.float32)
        codes = torch.where(kept < 0, 1 - high.to(torch.int32), 2 + high.to(torch.int32))
        return torch.cat(
            (
                table.view(torch.uint8),
                _pack_bits(index.to(torch.int32).view(1, -1), self.index_bits).view(-1),
                _pack_bits(codes.view(1, -1), 2).view(-1),
            )
        )

    def decode(self, message: Tensor, numel: int) -> tuple[Tensor, Tensor]:
        """The values of a message in place (zeros elsewhere), and which values it sent (a bool mask)."""
        chunks = self.chunks(numel)
        entries = chunks * self.top_k
        table_end = SCALE_BYTES * self.TABLE
        index_end = table_end + _packed_bytes(entries, self.index_bits)
        table = message[:table_end].clone().view(torch.float32)
        index = _unpack_bits(message[table_end:index_end].view(1, -1), self.index_bits, entries).view(chunks, -1)
        codes = _unpack_bits(message[index_end:].view(1, -1), 2, entries).view(chunks, -1)
        values = torch.zeros(chunks, self.chunk_size, dtype=torch.float32, device=message.device)
        values.scatter_(1, index.long(), table[codes.long()])
        sent = torch.zeros(chunks, self.chunk_size, dtype=torch.bool, device=message.device)
        sent.scatter_(1, index.long(), True)
        return values.view(-1)[:numel], sent.view(-1)[:numel]


def _mean_or_zero(values: Tensor) -> Tensor:
    return values.mean() if values.numel() else values.new_zeros(())


#: The codecs a ``reduce_dtype`` given as a bare class name (``"SparseTopK"``) may refer to.
CODEC_CLASSES: tuple[type[Codec], ...] = (FloatCodec, BlockQuantizer, SparseTopK, SparseLoCo)


def _packed_bytes(count: int, bits: int) -> int:
    """Bytes of ``count`` values of ``bits`` bits each, packed."""
    return -(-count * bits // 8)


def _pack_bits(values: Tensor, bits: int) -> Tensor:
    """Pack each row of a ``(p, n)`` int32 tensor of ``bits``-bit values into ``(p, ceil(n bits / 8))`` uint8.

    Value ``i``'s bit ``b`` is bit ``i * bits + b`` of the row's little-endian bit stream.
    """
    shifts = torch.arange(bits, dtype=torch.int32, device=values.device)
    stream = ((values.unsqueeze(-1) >> shifts) & 1).to(torch.uint8).view(values.shape[0], -1)
    stream = F.pad(stream, (0, _packed_bytes(values.shape[1], bits) * 8 - stream.shape[1]))
    weights = (1 << torch.arange(8, dtype=torch.int32, device=values.device)).to(torch.uint8)
    return (stream.view(values.shape[0], -1, 8) * weights).sum(dim=-1, dtype=torch.int32).to(torch.uint8)


def _unpack_bits(packed: Tensor, bits: int, count: int) -> Tensor:
    """Inverse of :func:`_pack_bits`: the ``(p, count)`` int32 values."""
    shifts = torch.arange(8, dtype=torch.int32, device=packed.device)
    stream = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 1  # (p, bytes, 8)
    stream = stream.view(packed.shape[0], -1)[:, : count * bits].view(packed.shape[0], count, bits)
    weights = 1 << torch.arange(bits, dtype=torch.int32, device=packed.device)
    return (stream * weights).sum(dim=-1, dtype=torch.int32)


def resolve_codec(reduce_dtype: str | torch.dtype | Codec, block_size: int = DEFAULT_BLOCK_SIZE) -> Codec:
    """The codec of a ``reduce_dtype`` option: a name (``"int4"``, ``"bfloat16"``, ...), a float dtype, or a codec.

    ``block_size`` is the block of the named quantized dtypes (``"int8"``, ``"int4"``); a codec object carries its own,
    and ``"sparse"`` is :class:`SparseTopK` with its defaults. A codec class given by its path or name alone
    (``"lightning_fedshard.SparseTopK"``), as a command line or YAML gives it without init arguments, is that class
    with its defaults.

    Raises:
        ValueError: For an unknown name, or a block size below 1.
    """
    check_quantizer_args(8, block_size)
    if isinstance(reduce_dtype, Codec):
        return reduce_dtype
    if isinstance(reduce_dtype, str) and (cls := named_class(reduce_dtype, Codec, CODEC_CLASSES)) is not None:
        return cls()
    name = str(reduce_dtype).removeprefix("torch.")
    if name in QUANTIZED_REDUCE_DTYPES:
        return BlockQuantizer(QUANTIZED_REDUCE_DTYPES[name], block_size)
    if name in FLOAT_REDUCE_DTYPES:
        return FloatCodec(name)
    if name in SPARSE_REDUCE_DTYPES:
        return SparseTopK()
    raise ValueError(
        f"Unsupported `reduce_dtype={reduce_dtype!r}`; choose one of {list(REDUCE_DTYPE_NAMES)} or pass a codec, e.g."
        " `lightning_fedshard.BlockQuantizer(bits=4, block_size=64)`."
    )


# --------------------------------------------------------------------------------------------------- quantizer


@dataclass(frozen=True)
class QuantizedBlocks:
    """A block-wise quantized vector.

    Attributes:
        codes: uint8 codes: one per value for int8 (the int8 bits), two per byte for int4 (element ``2i`` in the low
            nibble, ``2i + 1`` in the high one, each stored as ``q + 8``).
        scales: One float32 scale per block.
        numel: Length of the original vector (the codes cover it padded to whole blocks).
        bits: 8 or 4.
        block_size: Values per block.
    """

    codes: Tensor
    scales: Tensor
    numel: int
    bits: int
    block_size: int

    @property
    def nbytes(self) -> int:
        """Bytes of codes and scales together."""
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()


def quantize(x: Tensor, bits: int, block_size: int = DEFAULT_BLOCK_SIZE) -> QuantizedBlocks:
    """Quantize a float32 tensor (flattened, any length) block by block; see the module docstring for the bound.

    Raises:
        ValueError: For ``bits`` other than 8 or 4, or a block size below 1.
    """
    check_quantizer_args(bits, block_size)
    flat = x.reshape(-1).float()
    padded = F.pad(flat, (0, padded_length(flat.numel(), bits, block_size) - flat.numel()))
    codes, scales = encode_blocks(padded.view(-1, block_size), bits)
    return QuantizedBlocks(codes, scales, flat.numel(), bits, block_size)


def dequantize(q: QuantizedBlocks) -> Tensor:
    """The float32 vector (1-D, ``q.numel`` values) that ``q`` stands for."""
    return decode_blocks(q.codes, q.scales, q.bits, q.block_size).reshape(-1)[: q.numel]


def check_quantizer_args(bits: int, block_size: int) -> None:
    """Raise ``ValueError`` unless ``bits`` is 8 or 4 and ``block_size`` a positive integer."""
    if bits not in QMAX:
        raise ValueError(f"`bits` must be one of {sorted(QMAX)}, got {bits!r}.")
    check_positive_int("block_size", block_size)


def padded_length(numel: int, bits: int, block_size: int, parts: int = 1) -> int:
    """Smallest length ``>= numel`` that splits into ``parts`` equal chunks of whole blocks (of even length for int4).

    int4 packs two values per byte, so an int4 chunk must hold an even number of values: with an odd block size a
    chunk is then a whole number of *pairs* of blocks.
    """
    unit = block_size if bits == 8 or block_size % 2 == 0 else 2 * block_size
    return -(-numel // (parts * unit)) * parts * unit


def encode_blocks(blocks: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """Quantize a ``(num_blocks, block_size)`` float32 tensor into flat uint8 codes and ``(num_blocks,)`` scales.

    For int4 the number of values must be even.
    """
    qmax = QMAX[bits]
    scales = blocks.abs().amax(dim=1) / qmax
    # An all-zero block has scale 0: divide by 1 instead, its codes are 0 either way (and no NaN appears).
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = (blocks / divisor[:, None]).round_().clamp_(-qmax, qmax).reshape(-1)
    if bits == 8:
        return q.to(torch.int8).view(torch.uint8), scales
    return _pack_nibbles((q + 8).to(torch.uint8)), scales


def decode_blocks(codes: Tensor, scales: Tensor, bits: int, block_size: int) -> Tensor:
    """Inverse of :func:`encode_blocks`: a ``(num_blocks, block_size)`` float32 tensor."""
    if bits == 8:
        q = codes.view(torch.int8).float()
    else:
        q = _unpack_nibbles(codes).float() - 8
    return q.view(-1, block_size).mul_(scales[:, None])


def _pack_nibbles(values: Tensor) -> Tensor:
    """Two 4-bit values per byte: ``values[2i]`` in the low nibble, ``values[2i + 1]`` in the high one."""
    pairs = values.view(-1, 2)  # (n / 2, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def _unpack_nibbles(packed: Tensor) -> Tensor:
    """Inverse of :func:`_pack_nibbles`."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=1).reshape(-1)  # (n / 2, 2) -> (n,)
