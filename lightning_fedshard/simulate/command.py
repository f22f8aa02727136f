"""``fedshard simulate``: run the federation of a ``fedshard fit`` config on one device, every group in this process.

    fedshard simulate --config configs/shakespeare/fl_hsdp.yaml
    fedshard simulate --config configs/shakespeare/fl_hsdp.yaml --groups 4 --trainer.max_steps 400

The config's model, data, federation options (the strategy's) and Trainer arguments are used as they are; the ranks
of the config's cluster become groups of one rank each, and each group accumulates as many batches per optimizer step
as its group had ranks, so a step trains on the batch a real group's step does. The validation curve is drawn next
to the CSV log.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning_fedshard._arguments import FederatedArguments

#: ``fedshard fit`` options that would change the simulated cluster: the config's values describe it.
_CLUSTER_OPTIONS = ("--trainer.devices", "--trainer.num_nodes")


def parser() -> argparse.ArgumentParser:
    """The simulator's own options; every other argument is one of ``fedshard fit``'s."""
    p = argparse.ArgumentParser(
        prog="fedshard simulate",
        description="Simulate the federation of a `fedshard fit` config on one device, every group in this process.",
        epilog=(
            "Every other argument is a `fedshard fit` argument: --config FILE, --trainer.max_steps N, --model.*, ..."
            " The strategy's federation options are simulated; its FSDP options do not apply (a group holds the"
            " whole model). The config's trainer.devices and trainer.num_nodes are the cluster simulated: change it"
            " with --groups and --ranks_per_group. See docs/simulate.md."
        ),
    )
    p.add_argument("--groups", type=int, default=None, help="groups to simulate (default: the config's)")
    p.add_argument(
        "--ranks_per_group",
        type=int,
        default=None,
        help="batches each group accumulates per step (default: the ranks of a group in the config's cluster)",
    )
    p.add_argument("--ckpt_path", default=None, help="resume from a checkpoint of this simulation")
    return p


def main(argv: list[str] | None = None) -> Any:
    """Console entry point (``fedshard simulate ...``); returns the :class:`SimulationResult`."""
    argv = list(sys.argv[2:] if argv is None else argv)
    own, rest = _parse(argv)
    if not rest:
        parser().print_help()
        return None
    from lightning_fedshard.cli import cli
    from lightning_fedshard.simulate.simulator import Simulator, _info_silenced, refuse_unsimulated

    # The arguments are passed on as `args`: LightningCLI would warn that the process has command-line arguments too.
    # The Trainer it builds is not the one that trains: its "GPU available" lines would show twice.
    with _command_line(sys.argv[:1]), _info_silenced():
        built = cli(rest, run=False, parser_kwargs={"prog": "fedshard simulate"})
    trainer_args = dict(vars(built.config_init["trainer"]))
    strategy = trainer_args.pop("strategy")
    if not isinstance(strategy, FederatedArguments):
        parser().error(
            f"`trainer.strategy` is {strategy!r}: the simulator simulates a federated strategy ('fl_fsdp', 'fl_hsdp',"
            " ...) and takes its federation options."
        )
    try:
        refuse_unsimulated(strategy)
        topology = strategy.runtime.resolve_topology(
            trainer_args.pop("num_nodes"), _devices(trainer_args.pop("devices"))
        )
        groups = own.groups if own.groups is not None else topology.num_groups
        simulator = Simulator(
            dataclasses.replace(strategy.runtime.config, num_groups=groups),
            ranks_per_group=own.ranks_per_group if own.ranks_per_group is not None else topology.group_size,
            **trainer_args,
        )
    except ValueError as error:  # a value of the command line or the config that cannot be simulated
        parser().error(str(error))
    result = simulator.fit(built.model, datamodule=built.datamodule, ckpt_path=own.ckpt_path)
    picture = result.plot_validation()
    if picture is not None:
        print(f"validation curve: {picture}")
    for name, value in sorted(result.metrics.items()):
        print(f"{name}: {value:.4g}")
    return result


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The simulator's own options and the ``fedshard fit`` arguments, checked before anything is built."""
    own, rest = parser().parse_known_args(argv)
    for flag, value in (("--groups", own.groups), ("--ranks_per_group", own.ranks_per_group)):
        if value is not None and value < 1:
            parser().error(f"`{flag} {value}` must be at least 1.")
    try:
        return own, without_own_devices(rest)
    except ValueError as error:
        parser().error(str(error))


def without_own_devices(rest: list[str]) -> list[str]:
    """The ``fedshard fit`` arguments without ``--trainer.devices`` or ``--trainer.num_nodes`` of 1 (or ``auto``).

    The config's ``trainer.devices`` and ``trainer.num_nodes`` describe the cluster that is simulated (how many ranks
    a group has); the simulator itself runs every group on one device. On the command line they can only say the
    latter: 1 is dropped, any other value refused.

    Raises:
        ValueError: For another value, naming the option and the value.
    """
    kept: list[str] = []
    i = 0
    while i < len(rest):
        option, equals, value = rest[i].partition("=")
        if option not in _CLUSTER_OPTIONS or (not equals and i + 1 == len(rest)):  # no value: the parser says so
            kept.append(rest[i])
            i += 1
            continue
        value = value if equals else rest[i + 1]
        if value.strip().lower() not in ("1", "auto"):
            raise ValueError(
                f"`{option} {value}`: the simulator runs every group on one device of this process. The config's"
                " `trainer.devices` and `trainer.num_nodes` are the cluster it simulates (its groups' ranks); give"
                " --groups and --ranks_per_group to simulate another one."
            )
        i += 1 if equals else 2
    return kept


@contextmanager
def _command_line(argv: list[str]) -> Iterator[None]:
    saved = sys.argv
    sys.argv = argv
    try:
        yield
    finally:
        sys.argv = saved


def _devices(devices: Any) -> int:
    if isinstance(devices, int):
        return devices
    if isinstance(devices, (list, tuple)):
        return len(devices)
    raise ValueError(f"`trainer.devices={devices!r}`: give the number of devices per node of the simulated cluster.")
