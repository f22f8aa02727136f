"""How the pseudo-gradient travels between the groups: the codecs, and the one table of ``reduce_dtype`` names.

A codec turns a flat float32 vector into what goes on the wire and back. :class:`FloatCodec` casts to a float dtype,
which the network sums as it is (an all-reduce); :class:`BlockQuantizer` is block-wise absmax int8/int4 quantization,
whose codes cannot be summed on the wire (see :mod:`~lightning_fedshard.core.reducers` for how they are summed, and
:mod:`~lightning_fedshard.core.feedback` for error feedback, which any lossy codec can use). Both are options of the
strategies: ``reduce_dtype="int4"`` or ``reduce_dtype=BlockQuantizer(bits=4, block_size=64)`` (in YAML a ``class_path``
with ``init_args``).

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

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

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
REDUCE_DTYPE_NAMES: tuple[str, ...] = (*FLOAT_REDUCE_DTYPES, *QUANTIZED_REDUCE_DTYPES)

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


class BlockQuantizer(Codec):
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


def resolve_codec(reduce_dtype: str | torch.dtype | Codec, block_size: int = DEFAULT_BLOCK_SIZE) -> Codec:
    """The codec of a ``reduce_dtype`` option: a name (``"int4"``, ``"bfloat16"``, ...), a float dtype, or a codec.

    ``block_size`` is the block of the named quantized dtypes (``"int8"``, ``"int4"``); a codec object carries its own.

    Raises:
        ValueError: For an unknown name, or a block size below 1.
    """
    check_quantizer_args(8, block_size)
    if isinstance(reduce_dtype, Codec):
        return reduce_dtype
    name = str(reduce_dtype).removeprefix("torch.")
    if name in QUANTIZED_REDUCE_DTYPES:
        return BlockQuantizer(QUANTIZED_REDUCE_DTYPES[name], block_size)
    if name in FLOAT_REDUCE_DTYPES:
        return FloatCodec(name)
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
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"`block_size` must be a positive integer, got {block_size!r}.")


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
