"""torchft's messages on every change of groups and every heal, with nothing for a user to act on, silenced."""

from __future__ import annotations

import logging
import warnings


class _TorchftCpuNoise(logging.Filter):
    """Drops torchft's warning that NCCL's flight recorder cannot be reset.

    torchft logs it at every change of an elastic federation's groups; on gloo there is no such (CUDA-only) trace,
    and the warning says nothing a user can act on.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "Unable to reset NCCL flight recorder" not in record.getMessage()


def quiet_torchft() -> None:
    """Quiet what torchft says on every change of groups and every heal, with nothing for a user to act on.

    Installs :class:`_TorchftCpuNoise` on torchft's manager logger, and drops torch's warning about the read-only
    buffer that torchft's checkpoint transport loads a peer's state from.
    """
    logger = logging.getLogger("torchft.manager")
    if not any(isinstance(f, _TorchftCpuNoise) for f in logger.filters):
        logger.addFilter(_TorchftCpuNoise())
    warnings.filterwarnings(
        "ignore", message="The given buffer is not writable", category=UserWarning, module=r"torch\.distributed"
    )


__all__ = ["quiet_torchft"]
