"""The ``fedshard`` command: LightningCLI with the federated strategies registered.

``fedshard fit --config configs/shakespeare/fl_hsdp.yaml`` works like any LightningCLI program; because this module
imports :mod:`lightning_fedshard` before parsing, both ``trainer.strategy: fl_hsdp`` and the
``class_path: lightning_fedshard.FLHSDPStrategy`` / ``init_args:`` form are accepted, and
``fedshard fit --trainer.strategy.help lightning_fedshard.FLHSDPStrategy`` lists every strategy argument.
``fedshard plan`` predicts throughput, traffic and memory of each strategy before a run (see
:mod:`lightning_fedshard.plan`).
"""

from __future__ import annotations

import sys
from typing import Any

from lightning.pytorch.cli import ArgsType, LightningCLI

import lightning_fedshard  # noqa: F401  (registers "fl_fsdp" and "fl_hsdp")


def cli(args: ArgsType = None, run: bool = True, **kwargs: Any) -> LightningCLI:
    """Build the LightningCLI (any LightningModule / LightningDataModule, given by ``class_path``).

    Args:
        args: Command-line arguments (default: ``sys.argv[1:]``), a list or a dict as LightningCLI accepts.
        run: Run the subcommand (``fit``, ``validate``, ...) instead of only instantiating the classes.
        **kwargs: Passed on to :class:`~lightning.pytorch.cli.LightningCLI`.
    """
    kwargs.setdefault("save_config_kwargs", {"overwrite": True})
    return LightningCLI(args=args, run=run, **kwargs)


def main() -> None:
    """Console entry point ``fedshard``: ``fedshard plan ...`` runs the planner, anything else the LightningCLI."""
    if sys.argv[1:2] == ["plan"]:
        from lightning_fedshard.plan.command import main as plan_main

        plan_main()
        return
    cli()


if __name__ == "__main__":
    main()
