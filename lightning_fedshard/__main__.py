"""``python -m lightning_fedshard`` runs the ``fedshard`` LightningCLI."""

from lightning_fedshard.cli import main

main()
