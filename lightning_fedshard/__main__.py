"""``python -m lightning_fedshard`` runs the ``fedshard`` command."""

from lightning_fedshard.commands import main

main()
