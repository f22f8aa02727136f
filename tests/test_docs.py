"""The numbers and defaults the docs state, against the code that defines them.

Each check parses the docs (Markdown tables, a marked block, a sentence) so that changing a value on either side
fails here.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.wire.reducers import ChunkLayout, make_reducer
from lightning_fedshard.plan.command import plan, table

ROOT = Path(__file__).parents[1]
DOCS = ROOT / "docs"
NUMBER_WORDS = {"ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14, "fifteen": 15, "sixteen": 16}


def _read(name: str) -> str:
    return (ROOT / name).read_text()


def _table(text: str, header: str) -> list[list[str]]:
    """The body rows of the Markdown table whose header row is ``header``, each as a list of stripped cells."""
    lines = text.splitlines()
    start = lines.index(header) + 2  # the header, then the |---| row
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def _first_code(cell: str) -> str:
    """The first `code` span of a table cell."""
    match = re.search(r"`([^`]+)`", cell)
    assert match, f"no `value` in {cell!r}"
    return match[1]


def _number(text: str) -> int:
    """``365,976`` -> 365976."""
    return int(text.replace(",", ""))


def _section(text: str, heading: str) -> str:
    """The text under a Markdown heading, up to the next heading of the same or a higher level."""
    level = heading.split(" ")[0]
    start = text.index(heading + "\n")
    end = re.compile(rf"^#{{1,{len(level)}}} ", re.MULTILINE).search(text, start + len(heading))
    return text[start : end.start() if end else len(text)]


def _federation_defaults() -> dict[str, object]:
    return {f.name: f.default for f in dataclasses.fields(FederationConfig)}


# ------------------------------------------------------------------------------------------------------ (a) federation


def test_configuration_table_states_every_federation_default():
    section = _section(_read("docs/configuration.md"), "## Federation arguments")
    rows = _table(section, "| Argument | Default |")
    documented = {_first_code(name): ast.literal_eval(_first_code(default)) for name, default in rows}
    assert documented == _federation_defaults()
    count = re.search(r"The same (\w+) arguments", section)
    assert count and NUMBER_WORDS[count[1]] == len(documented)


def test_readme_and_getting_started_state_the_federation_defaults():
    defaults = _federation_defaults()
    readme = _read("README.md")
    trainer_bullet = readme[readme.index("- **Trainer**") : readme.index("- **LightningCLI**")]
    assert set(re.findall(r"`(\w+)`", trainer_bullet)) >= set(defaults)
    outer = re.search(r'`"(\w+)"` is the default outer optimizer', readme)
    assert outer and outer[1] == defaults["outer_optimizer"]
    traffic = re.search(r"the outer\s+traffic is (\w+) with error feedback by default", readme)
    assert traffic and traffic[1] == FederationConfig().effective_reduce_dtype  # reduce_dtype=None without a mixing
    reducer = FederationConfig().reducer()
    assert getattr(reducer, "feedback", None) is not None  # "with error feedback": on by default for int8/int4
    started = _read("docs/getting-started.md")
    name_alone = re.search(r'an outer step every (\d+) optimizer steps with the\s+`"(\w+)"` outer optimizer', started)
    assert name_alone and (int(name_alone[1]), name_alone[2]) == (defaults["sync_every"], defaults["outer_optimizer"])


def test_checkpoints_list_every_reduce_dtype_refused():
    rows = _table(_read("docs/checkpoints.md"), "| input | error |")
    row = next(cells for cells in rows if cells[0].startswith("`reduce_dtype` other than"))
    listed = row[0].removeprefix("`reduce_dtype` other than ").split("/")
    with pytest.raises(ValueError) as error:
        FederationConfig(reduce_dtype="fp8")
    accepted = ast.literal_eval(re.search(r"choose one of (\[.*\])", str(error.value))[1])
    assert listed == accepted
    assert str(error.value) in row[1]


# ----------------------------------------------------------------------------------------------------------- (b) plan


def _cli_value(cell: str) -> object:
    """A default as the plan docs write it: ``unset`` is ``None``, ``false``/``true`` are booleans."""
    if cell.startswith("unset"):
        return None
    value = _first_code(cell)
    if value in ("true", "false"):
        return value == "true"
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return value


def test_plan_defaults_table_is_the_command_signature():
    rows = _table(_read("docs/plan.md"), "| input | default |")
    documented = {_first_code(name).removeprefix("--"): _cli_value(default) for name, default in rows}
    signature = {name: p.default for name, p in inspect.signature(plan).parameters.items()}
    assert documented == {name: signature[name] for name in documented}
    # Every input that shapes the training, not only the presets' overrides, is in the table.
    presets = {
        "model_config", "seq_len", "nodes", "devices_per_node", "peak_tflops", "mfu", "step_seconds",
        "device_memory_gib", "intra_gbytes_per_s", "intra_latency_us", "inter_gbit_per_s", "inter_latency_us",
        "nodes_per_site", "site_mbit_per_s",
    }  # fmt: skip
    assert set(signature) - presets == set(documented)


def test_plan_output_in_the_docs_is_what_the_command_prints(capsys):
    docs = _read("docs/plan.md")
    block = docs[docs.index("<!-- output of: fedshard plan -->\n") : docs.index("<!-- /output -->")]
    printed = table(plan())
    capsys.readouterr()
    assert block.split("\n", 1)[1].strip() == printed


def test_plan_error_example_is_what_the_command_prints(capsys):
    docs = _read("docs/plan.md")
    shown = re.search(r"^fedshard plan: error: .*`num_groups=(\d+)`\.$", docs, re.MULTILINE)
    assert shown
    with pytest.raises(ValueError) as error:
        plan(num_groups=int(shown[1]))
    assert shown[0] == f"fedshard plan: error: {error.value}"


# --------------------------------------------------------------------------------------------------- (c) sync bytes


def test_getting_started_sync_bytes_are_the_byte_formula_of_the_example():
    from lightning_fedshard.examples import LlamaLM

    config = yaml.safe_load(_read("configs/shakespeare/fl_hsdp.yaml"))
    strategy = config["trainer"]["strategy"]["init_args"]
    groups, shard = strategy["num_groups"], strategy["shard_size"]
    replicas = config["trainer"]["devices"] * config["trainer"]["num_nodes"] // groups // shard
    local = LlamaLM(**config["model"]["init_args"]).num_parameters() // shard
    part = -(-local // replicas)  # each replica sums its part of the shard across the groups
    defaults = {**_federation_defaults(), "reduce_dtype": FederationConfig().effective_reduce_dtype}
    int4 = make_reducer(defaults["reduce_dtype"], defaults["quant_block_size"], defaults["error_feedback"])
    layout = ChunkLayout.of(part, groups, int4.codec)

    text = " ".join(_read("docs/getting-started.md").split())
    sentence = re.search(
        r"over the (\d+) groups\. Each rank holds ([\d,]+) local values, and so does the other replica .* each sending"
        r" its half, ([\d,]+) values, across the groups .* With the default `reduce_dtype=\"(\w+)\"` \(and error"
        r" feedback\) a half travels as 4-bit codes with one float32 scale per block of (\d+) values: padded to (\d+)"
        r" chunks of ([\d,]+) values \(([\d,]+) blocks\), one chunk is `P = 4 · [\d,]+ \+ [\d,]+ / 2 = ([\d,]+)`"
        r" bytes, .* `2 \(G-1\) P` = ([\d,]+) bytes, about 1/([\d.]+) of the ([\d,]+) bytes that"
        r" `reduce_dtype=\"float32\"` sent",
        text,
    )
    assert sentence, "the sync_bytes sentence of docs/getting-started.md changed its wording"
    g, values, half, dtype, block, chunks, chunk, blocks, piece, sent, ratio, float_bytes = sentence.groups()
    assert replicas == 2 and (int(g), int(chunks), dtype) == (groups, groups, defaults["reduce_dtype"])
    assert int(block) == int4.codec.block_size and (_number(values), _number(half)) == (local, part)
    assert (_number(chunk), _number(blocks), _number(piece)) == (layout.chunk, layout.blocks, layout.piece_bytes)
    assert _number(sent) == int4.wire_bytes(part, groups)
    assert _number(float_bytes) == make_reducer("float32").wire_bytes(local, groups)
    assert float(ratio) == round(_number(float_bytes) / _number(sent), 1)

    sample = re.search(r"```text\n(epoch,fedshard/.*?)```", _read("docs/getting-started.md"), re.DOTALL)
    assert sample
    header, *rows = [line.split(",") for line in sample[1].strip().splitlines()]
    column = header.index("fedshard/sync_bytes")
    logged = {float(row[column]) for row in rows if row[column]}
    assert logged == {float(int4.wire_bytes(part, groups))}


def test_the_compatibility_table_in_the_docs_is_the_one_the_modes_declare():
    from lightning_fedshard.core.rounds.options import compatibility_table

    text = _read("docs/configuration.md")
    start = text.index("<!-- compatibility table: begin -->\n") + len("<!-- compatibility table: begin -->\n")
    end = text.index("<!-- compatibility table: end -->")
    assert text[start:end] == compatibility_table(), (
        "regenerate the table in docs/configuration.md from"
        " `lightning_fedshard.core.rounds.options.compatibility_table()`"
    )


def test_the_main_jobs_perplexity_is_quoted_as_one_range_that_holds_every_quoted_run():
    """The last digits depend on the CPU: every page quotes the README's range, and every sample run lies in it."""
    import re

    low, high = map(float, re.search(r"4191\.2 -> ([\d.]+) to ([\d.]+) with the", _read("README.md")).groups())
    started = _read("docs/getting-started.md")
    assert f"{low} to {high} on the machines" in started
    pairs = re.findall(r"-> ([\d.]+) after training|`val_ppl: ([\d.]+)`", started)
    quoted = [float(after or bar) for after, bar in pairs]
    assert quoted and all(low <= v <= high for v in quoted), quoted
    simulate = _read("docs/simulate.md")
    assert f"reaches {low} to {high} on the same machines" in simulate
    sim_low, sim_high = map(float, re.search(r"perplexity ([\d.]+) to ([\d.]+) after 96 steps", simulate).groups())
    seen = [float(v) for v in re.search(r"\(([\d.]+), ([\d.]+) and ([\d.]+) on three machines", simulate).groups()]
    assert min(seen) == sim_low and max(seen) == sim_high


# ------------------------------------------------------------------------------------------------------ (d) the site


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs is not installed (the `docs` extra)")
def test_the_docs_site_builds_in_strict_mode(tmp_path):
    """mkdocs.yml's site: a broken link or anchor, a page left out of the nav, a missing reference or a docstring
    section the Google parser rejects is a warning, and --strict fails on it."""
    build = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's notice about MkDocs 2.0
    done = subprocess.run(build, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"`mkdocs build --strict` failed:\n{done.stdout}{done.stderr}"
    assert (tmp_path / "site" / "reference" / "options.html").is_file()
