"""One entry point for the benchmarks: ``python -m benchmarks <study>`` finds every study's own command line."""

from __future__ import annotations

import importlib

import pytest

from benchmarks.__main__ import STUDIES, main, usage


def test_help_lists_every_study_with_its_time_and_what_it_decides(capsys):
    main(["--help"])
    printed = capsys.readouterr().out
    for name, study in STUDIES.items():
        assert name in printed and study.time in printed
    assert printed == usage() + "\n"


@pytest.mark.parametrize("name", sorted(STUDIES))
def test_every_study_is_a_module_with_its_own_command_line(name):
    assert callable(importlib.import_module(STUDIES[name].module).main)


def test_an_unknown_study_is_refused_naming_the_studies():
    with pytest.raises(SystemExit, match="unknown study 'recipe'; the studies are run, race"):
        main(["recipe"])
