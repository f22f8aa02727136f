"""A small Llama language model, built from scratch, as a LightningModule.

The network is ``transformers.LlamaForCausalLM`` with random weights (nothing is downloaded) and, by default, tied
input/output embeddings. Training uses AdamW with a linear warm-up and a cosine decay; validation reports the mean
negative log-likelihood (``val_loss``, nats per token), perplexity and bits per byte.

The module works unchanged under Lightning's ``FSDPStrategy`` (FSDP1) with ``use_orig_params=True``: pass
``auto_wrap_policy=LlamaLM.wrap_policy()`` to shard every decoder layer on its own. With ``meta_init=True`` the
network is created on the meta device in ``configure_model`` and FSDP materializes it one unit at a time (see
:mod:`lightning_fedshard.examples.meta_init`), so no process ever holds the whole model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import Tensor, nn
from torch.optim.lr_scheduler import LambdaLR
from torchmetrics import MeanMetric
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from lightning_fedshard.core.options.checks import check_positive_int
from lightning_fedshard.examples.meta_init import install_reset_parameters, materialize


@dataclass(frozen=True)
class LlamaShape:
    """Width and depth of a Llama model.

    Args:
        hidden_size: Width of the residual stream.
        num_layers: Number of decoder layers.
        num_heads: Attention heads per layer (as many key/value heads: no grouped-query attention).
        intermediate_size: Width of the SwiGLU feed-forward layer.
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int


#: Model presets, sized so that a few minutes on a laptop CPU show real learning (parameters at vocabulary 4,096).
LLAMA_SIZES: dict[str, LlamaShape] = {
    "xs": LlamaShape(hidden_size=128, num_layers=4, num_heads=4, intermediate_size=384),  # 1.4 M
    "s": LlamaShape(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=768),  # 4.5 M
    "m": LlamaShape(hidden_size=384, num_layers=6, num_heads=6, intermediate_size=1024),  # 12.2 M
    "l": LlamaShape(hidden_size=512, num_layers=8, num_heads=8, intermediate_size=1536),  # 29.4 M
}

# Wrapper modules (FSDP1, activation checkpointing, torch.compile) insert these into parameter names.
_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def _clean_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


@dataclass
class WarmupCosine:
    """Learning-rate factor for ``LambdaLR``: linear warm-up to 1, then a half cosine down to ``min_ratio``.

    A callable object rather than a closure, so that ``LambdaLR.state_dict()`` saves its fields with a checkpoint.

    Args:
        warmup_steps: Steps of linear warm-up; step ``s < warmup_steps`` gets ``(s + 1) / warmup_steps``.
        total_steps: Step at which the cosine reaches ``min_ratio`` (and stays).
        min_ratio: Final factor.
    """

    warmup_steps: int
    total_steps: int
    min_ratio: float = 0.0

    def __call__(self, step: int) -> float:
        """Factor of the peak learning rate at optimizer step ``step``."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class LlamaLM(LightningModule):
    """Causal language model: a random-init ``LlamaForCausalLM``.

    Batches are ``{"input_ids": (B, T), "labels": (B, T)}`` with ``labels`` already shifted by one position (as
    :class:`~lightning_fedshard.examples.ShakespeareDataModule` yields them); the model does not shift again.

    All ranks build identical initial weights, which depend on ``init_seed`` only (neither on the global RNG state nor
    on the rank). Two ways to build them:

    - ``meta_init=False`` (eager, the default): the whole network is built in ``__init__``, in float32, under a
      forked RNG seeded with ``init_seed``: every process holds the full model before FSDP shards it.
    - ``meta_init=True``: ``configure_model`` creates the network on the meta device (no memory). Under an FSDP1
      strategy (Lightning's ``FSDPStrategy`` and the federated strategies), FSDP then materializes and shards one
      unit (decoder layer) at a time, calling the ``reset_parameters`` that
      :func:`~lightning_fedshard.examples.meta_init.install_reset_parameters` gives every module: transformers' own
      ``_init_weights`` (normal(0, 0.02) for linear and embedding weights, ones for RMSNorm, a recomputed rotary
      ``inv_freq``) under a seed derived from ``init_seed`` and the module's name. The weights are the same on
      every rank, for every wrap policy and world size, but they are *not* bit-identical to the eager path's:
      the eager path draws all tensors from one RNG stream in construction order, which a unit materialized on
      its own cannot reproduce. They follow the same distributions. Without an FSDP strategy (one device, DDP,
      ``load_from_checkpoint``) ``configure_model`` materializes the same values at once.

    For Fabric, build the eager module inside ``fabric.init_module(empty_init=True)`` instead: it is then created on
    the meta device and ``fabric.setup`` materializes it through the same ``reset_parameters``.

    Args:
        size: Preset width and depth from :data:`LLAMA_SIZES`.
        vocab_size: Vocabulary size; must match the tokenizer.
        max_seq_len: Longest sequence the rotary embeddings are configured for.
        hidden_size: Overrides the preset's width.
        num_layers: Overrides the preset's depth.
        num_heads: Overrides the preset's number of attention heads.
        intermediate_size: Overrides the preset's feed-forward width.
        num_kv_heads: Key/value heads (grouped-query attention); default: as many as ``num_heads``.
        rope_theta: Base of the rotary position embeddings (Llama-3 uses 500000).
        lr: Peak learning rate of AdamW.
        betas: AdamW's ``(beta1, beta2)``.
        weight_decay: AdamW's decoupled weight decay, applied to matrices only (not to norms or embeddings).
        warmup_fraction: Fraction of ``trainer.estimated_stepping_batches`` spent warming up linearly.
        min_lr_ratio: Learning rate at the end of the cosine decay, as a fraction of ``lr``.
        init_seed: Seed of the weight initialization.
        tie_word_embeddings: Share one matrix between the input embedding and the output projection (Llama-3.1-8B
            does not; the small presets do).
        meta_init: Create the network on the meta device in ``configure_model`` and let FSDP materialize it unit by
            unit (see above); otherwise build it in float32 in ``__init__``.

    Raises:
        ValueError: If an argument is out of range or the shape is inconsistent.
    """

    def __init__(
        self,
        size: Literal["xs", "s", "m", "l"] = "s",
        vocab_size: int = 4096,
        max_seq_len: int = 2048,
        hidden_size: int | None = None,
        num_layers: int | None = None,
        num_heads: int | None = None,
        intermediate_size: int | None = None,
        num_kv_heads: int | None = None,
        rope_theta: float = 10000.0,
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        weight_decay: float = 0.1,
        warmup_fraction: float = 0.1,
        min_lr_ratio: float = 0.0,
        init_seed: int = 0,
        tie_word_embeddings: bool = True,
        meta_init: bool = False,
    ) -> None:
        super().__init__()
        shape = _shape(size, hidden_size, num_layers, num_heads, intermediate_size)
        _validate(shape, vocab_size, max_seq_len, lr, betas, weight_decay, warmup_fraction, min_lr_ratio)
        config = _llama_config(shape, vocab_size, max_seq_len, num_kv_heads, rope_theta, tie_word_embeddings)
        self.save_hyperparameters()
        self.shape = shape
        self.config = config
        self.init_seed = init_seed
        self.meta_init = meta_init
        self.model: LlamaForCausalLM
        self._no_decay: set[str] = set()
        self._num_parameters: int | None = None
        if not meta_init:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(init_seed)
                self._build()
        # Real tensors even under an empty-init (meta) context: Lightning moves metrics to the device, it cannot
        # materialize them.
        with torch.device("cpu"):
            self.val_nll = MeanMetric()

    def _build(self) -> None:
        """Create the network (on the current default device) and the bookkeeping that needs its shapes."""
        self.model = LlamaForCausalLM(self.config)
        # Used only if the network lives on the meta device when an FSDP unit (or `materialize`) takes it.
        install_reset_parameters(self.model, self.init_seed, self.model._init_weights)
        # Decided on the bare model: once FSDP shards it, every parameter is a flat 1-D view and shapes say nothing.
        self._no_decay = {
            _clean_name(f"model.{name}")
            for name, param in self.model.named_parameters()
            if param.ndim < 2 or "embed_tokens" in name
        }
        self._num_parameters = _count_parameters(self.model)

    def configure_model(self) -> None:
        """With ``meta_init``: create the network on the meta device (materialized at once if no FSDP will do it).

        Lightning calls this hook inside the strategy's and the precision's init contexts (e.g. ``bf16-true`` makes
        the meta tensors bfloat16), and again before ``validate``/``test`` and in ``load_from_checkpoint``: it builds
        only once.
        """
        if not self.meta_init or "model" in self._modules:
            return
        with torch.device("meta"):
            self._build()
        if not self._materialized_by_fsdp():
            materialize(self.model, self.device)

    def _materialized_by_fsdp(self) -> bool:
        """Whether the attached Trainer's strategy wraps with FSDP1, which materializes meta modules unit by unit."""
        trainer = self._trainer
        return trainer is not None and isinstance(trainer.strategy, FSDPStrategy)

    @classmethod
    def wrap_policy(cls) -> set[type[nn.Module]]:
        """Module classes to wrap as separate FSDP units (``FSDPStrategy(auto_wrap_policy=...)``)."""
        return {LlamaDecoderLayer}

    def num_parameters(self) -> int:
        """Number of parameters (tied embeddings counted once), before any sharding; allocates nothing."""
        if self._num_parameters is None:  # meta_init before configure_model: count a throw-away meta copy
            with torch.device("meta"):
                return _count_parameters(LlamaForCausalLM(self.config))
        return self._num_parameters

    def forward(self, input_ids: Tensor) -> Tensor:
        """Next-token logits ``(B, T, vocab_size)`` for token ids ``(B, T)``."""
        return self.model(input_ids=input_ids, use_cache=False).logits

    def _nll(self, batch: dict[str, Tensor]) -> Tensor:
        logits = self(batch["input_ids"])  # (B, T, V)
        # float(): the loss in fp32 even when the forward runs in reduced precision.
        return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        """Mean next-token cross-entropy of the batch, logged as ``train_loss``."""
        loss = self._nll(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        """Accumulate the token-weighted negative log-likelihood."""
        self.val_nll.update(self._nll(batch), weight=batch["labels"].numel())

    def on_validation_epoch_end(self) -> None:
        """Log ``val_loss`` (nats/token), ``val_ppl`` and, when the data module knows its bytes/token, ``val_bpb``."""
        nll = self.val_nll.compute()  # gathered over all ranks: every rank logs the same numbers
        self.val_nll.reset()
        # sync_dist only averages equal values again; without it Lightning warns in distributed runs.
        self.log("val_loss", nll, sync_dist=True)
        self.log("val_ppl", torch.exp(nll), prog_bar=True, sync_dist=True)
        if (bytes_per_token := self._val_bytes_per_token()) is not None:
            self.log("val_bpb", nll / math.log(2) / bytes_per_token, sync_dist=True)

    def _val_bytes_per_token(self) -> float | None:
        datamodule = getattr(self.trainer, "datamodule", None)
        try:
            return getattr(datamodule, "val_bytes_per_token", None)
        except RuntimeError:  # the data module was not set up
            return None

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        """AdamW without decay on norms and embeddings, stepped with a warm-up + cosine schedule."""
        hparams = self.hparams
        decay: list[nn.Parameter] = []
        no_decay: list[nn.Parameter] = []
        # self.parameters(), not self.model's captured before wrapping: under FSDP these are the live (sharded) ones.
        for name, param in self.named_parameters():
            if param.requires_grad:
                (no_decay if _clean_name(name) in self._no_decay else decay).append(param)
        groups = [
            {"params": decay, "weight_decay": hparams["weight_decay"]},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(
            [group for group in groups if group["params"]], lr=hparams["lr"], betas=tuple(hparams["betas"])
        )
        total_steps = self.trainer.estimated_stepping_batches
        if not math.isfinite(total_steps):
            raise ValueError(
                "The learning-rate schedule needs a finite run: set the Trainer's `max_steps` or `max_epochs`."
            )
        schedule = WarmupCosine(
            warmup_steps=round(hparams["warmup_fraction"] * total_steps),
            total_steps=int(total_steps),
            min_ratio=hparams["min_lr_ratio"],
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": LambdaLR(optimizer, schedule), "interval": "step"},
        }

    def save_pretrained(self, path: str | Path, state_dict: dict[str, Any] | None = None) -> None:
        """Save the network in Hugging Face format (``config.json`` + safetensors) for ``from_pretrained``.

        Args:
            path: Output folder.
            state_dict: Full state dict of the inner ``LlamaForCausalLM``; needed when the module is sharded (gather
                it first, e.g. with FSDP's full state dict), since the live parameters then hold only shards.
        """
        self.model.save_pretrained(str(path), state_dict=state_dict)


def _shape(
    size: str,
    hidden_size: int | None,
    num_layers: int | None,
    num_heads: int | None,
    intermediate_size: int | None,
) -> LlamaShape:
    """The preset's shape with the given overrides."""
    if size not in LLAMA_SIZES:
        raise ValueError(f"`size` must be one of {sorted(LLAMA_SIZES)}, got `size={size!r}`.")
    preset = LLAMA_SIZES[size]
    return LlamaShape(
        hidden_size=preset.hidden_size if hidden_size is None else hidden_size,
        num_layers=preset.num_layers if num_layers is None else num_layers,
        num_heads=preset.num_heads if num_heads is None else num_heads,
        intermediate_size=preset.intermediate_size if intermediate_size is None else intermediate_size,
    )


def _llama_config(
    shape: LlamaShape,
    vocab_size: int,
    max_seq_len: int,
    num_kv_heads: int | None,
    rope_theta: float,
    tie_word_embeddings: bool,
) -> LlamaConfig:
    """The transformers configuration of a network of this shape (after checking its attention heads)."""
    kv_heads = shape.num_heads if num_kv_heads is None else num_kv_heads
    if kv_heads < 1 or shape.num_heads % kv_heads:
        raise ValueError(f"`num_heads={shape.num_heads}` must be a multiple of `num_kv_heads={num_kv_heads}`.")
    if rope_theta <= 0:
        raise ValueError(f"`rope_theta` must be positive, got `rope_theta={rope_theta}`.")
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=kv_heads,
        rope_theta=rope_theta,  # type: ignore[call-arg]  # transformers 5 folds it into rope_parameters
        max_position_embeddings=max_seq_len,
        tie_word_embeddings=tie_word_embeddings,
        # The tokenizer has no special tokens; Llama's defaults (1, 2) would point at ordinary tokens.
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def _count_parameters(model: nn.Module) -> int:
    # Only on the bare network: once FSDP wraps it, its parameters are this rank's shards.
    return sum(param.numel() for param in model.parameters())


def _validate(
    shape: LlamaShape,
    vocab_size: int,
    max_seq_len: int,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    warmup_fraction: float,
    min_lr_ratio: float,
) -> None:
    sizes = {**vars(shape), "vocab_size": vocab_size, "max_seq_len": max_seq_len}
    for name, value in sizes.items():
        check_positive_int(name, value, what=f"`{name}={value!r}`")
    if shape.hidden_size % (2 * shape.num_heads):
        # Rotary embeddings rotate pairs of channels, so the head dimension must be even.
        raise ValueError(
            f"`hidden_size={shape.hidden_size}` must be divisible by 2 * `num_heads={shape.num_heads}`"
            " (an even head dimension)."
        )
    if lr <= 0 or weight_decay < 0:
        raise ValueError(f"Need `lr` > 0 and `weight_decay` >= 0, got `lr={lr}`, `weight_decay={weight_decay}`.")
    if len(betas) != 2 or not all(0 <= beta < 1 for beta in betas):
        raise ValueError(f"`betas` must be two numbers in [0, 1), got `betas={betas}`.")
    for name, value in {"warmup_fraction": warmup_fraction, "min_lr_ratio": min_lr_ratio}.items():
        if not 0 <= value <= 1:
            raise ValueError(f"`{name}` must be in [0, 1], got `{name}={value}`.")
