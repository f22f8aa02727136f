"""The ``fedshard`` command: ``plan`` (the planner), ``simulate`` (the simulator), anything else LightningCLI."""

from __future__ import annotations

import sys


def main() -> None:
    """Console entry point ``fedshard``."""
    if sys.argv[1:2] == ["plan"]:
        from lightning_fedshard.plan.command import main as plan_main

        plan_main()
        return
    if sys.argv[1:2] == ["simulate"]:
        from lightning_fedshard.simulate.command import main as simulate_main

        simulate_main()
        return
    from lightning_fedshard.cli import cli

    cli(parser_kwargs={"prog": "fedshard"})


if __name__ == "__main__":
    main()
