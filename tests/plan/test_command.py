"""`fedshard plan` on the command line."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from lightning_fedshard.plan.command import main, plan
from lightning_fedshard.plan.quality import STUDY


@pytest.mark.slow
def test_help_documents_every_input():
    out = subprocess.run(
        [sys.executable, "-m", "lightning_fedshard", "plan", "--help"], capture_output=True, text=True, timeout=120
    ).stdout
    for arg in ("--model", "--cluster", "--inter_gbit_per_s", "--step_seconds", "--sync_every", "--reduce_dtype",
                "--sweep", "--json", "--merge_alpha", "--pace", "--on_nonfinite", "--quant_block_size"):  # fmt: skip
        assert arg in out
    assert "Network bandwidth of one node (Gbit/s)" in " ".join(out.split())


def test_table_and_json(capsys):
    predictions = plan(model="xs", cluster="emulated-4x2", micro_batch=4, precision="fp32", inter_gbit_per_s=0.05)
    table = capsys.readouterr().out
    assert [p.setup.strategy for p in predictions] == ["fsdp", "hsdp", "fl_fsdp", "fl_hsdp"]
    assert "| fl_fsdp | 4 x 1 x 2 |" in table
    plan(model="xs", cluster="emulated-4x2", json=True, sweep=True, top=3)
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 3 and {"tokens_per_second", "bottleneck", "collectives"} <= set(rows[0])


@pytest.mark.slow
def test_bad_input_is_one_line_naming_the_value():
    run = subprocess.run(
        [sys.executable, "-m", "lightning_fedshard", "plan", "--micro_batch", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode != 0
    assert run.stderr.strip().splitlines()[-1] == "fedshard plan: error: `micro_batch=0` must be a positive number."
    assert "Traceback" not in run.stderr


@pytest.mark.slow
def test_given_layout_that_does_not_fit_the_cluster_is_one_line_naming_it():
    run = subprocess.run(
        [sys.executable, "-m", "lightning_fedshard", "plan", "--num_groups", "3"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode != 0 and run.stdout == ""
    assert run.stderr.strip().splitlines() == [
        "fedshard plan: error: fl_fsdp on leonardo-512 (128 x 4 = 512 ranks): The world size (512 = 128 node(s) x 4"
        " device(s)) must be divisible by `num_groups=3`."
    ]


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"num_groups": 3}, r"\(128 x 4 = 512 ranks\).*`num_groups=3`"),
        ({"num_groups": 3, "sweep": True}, r"\(128 x 4 = 512 ranks\).*`num_groups=3`"),
        ({"shard_size": 3}, r"^hsdp on leonardo-512 \(128 x 4 = 512 ranks\).*`shard_size=3`"),
        ({"shard_size": 3, "sweep": True}, r"\(128 x 4 = 512 ranks\).*`shard_size=3`"),
    ],
)
def test_given_layout_is_kept_or_refused(capsys, given, message):
    with pytest.raises(ValueError, match=message):
        plan(**given)
    assert capsys.readouterr().out == ""


def test_default_layout_leaves_out_only_what_the_defaults_cannot_cut(capsys):
    assert [p.setup.strategy for p in plan()] == ["fsdp", "hsdp", "fl_fsdp", "fl_hsdp"]
    # One node: FL+HSDP's default two groups cannot be cut, so its row is left out without an error.
    assert [p.setup.strategy for p in plan(cluster="emulated-4x2", nodes=1)] == ["fsdp", "hsdp", "fl_fsdp"]
    swept = plan(num_groups=16, sweep=True, top=5)
    assert {p.topology.num_groups for p in swept if p.setup.federated} == {16}
    assert [p.setup.strategy for p in swept].count("fsdp") == 1  # the time-to-target ranking's reference
    capsys.readouterr()


def test_the_table_names_the_outer_topology_and_sites_it_assumes(capsys):
    plan(model="xs", cluster="emulated-4x2")
    assert (
        "\nouter topology: all groups at every sync; sites: one (every node on one network)\n"
        in capsys.readouterr().out
    )
    plan(model="xs", cluster="emulated-2x2x2", outer_topology="lightning_fedshard.Gossip")  # a class path alone
    out = capsys.readouterr().out
    assert "\nouter topology: gossip with 1 peer(s) per sync; sites: 2 of 2 nodes, 20 Mbit/s uplinks\n" in out
    plan(model="xs", cluster="emulated-2x2x2", json=True)
    row = json.loads(capsys.readouterr().out)[2]
    assert (row["outer_topology"], row["sites"]) == ("all groups at every sync", "2 of 2 nodes, 20 Mbit/s uplinks")


def test_the_sweep_says_what_it_ranks_by(capsys):
    plan(model="xs", cluster="emulated-4x2", sweep=True, top=2, rank="tokens_per_s")
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("Ranked by predicted tokens/s only") and "Quality is not predicted" in last
    assert "docs/benchmarks.md" in last
    plan(model="xs", cluster="emulated-4x2", sweep=True, top=2)  # by time to target, the default
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("Ranked by predicted time to a target loss where measured") and STUDY in out[-1]
    assert "time to target |" in "\n".join(out)
    plan(model="xs", cluster="emulated-4x2")  # a comparison is not a ranking
    assert "Ranked by" not in capsys.readouterr().out


def test_a_row_that_does_not_fit_says_what_would(capsys):
    rows = {p.setup.strategy: p for p in plan(device_memory_gib=52, num_groups=128)}
    assert "| 52.4 | no: try fragments=2 |" in capsys.readouterr().out
    fl_fsdp = rows["fl_fsdp"]
    assert not fl_fsdp.fits and fl_fsdp.advice == "try fragments=2"
    # The advice holds: with two fragments the same setup fits.
    assert all(p.fits for p in plan(device_memory_gib=52, num_groups=128, fragments=2)[2:])
    capsys.readouterr()
    plan(device_memory_gib=40, num_groups=128, json=True)
    advice = {row["strategy"]: row["advice"] for row in json.loads(capsys.readouterr().out)}
    assert advice == {
        "fsdp": None,
        "hsdp": "try activation_checkpointing=true",
        "fl_fsdp": "try fragments=4 and activation_checkpointing=true",
        "fl_hsdp": "try fragments=4 and activation_checkpointing=true",
    }
    plan(device_memory_gib=10)
    assert "| no: the sharded state alone needs 29.9 GiB of 10.0: shard over more ranks" in capsys.readouterr().out


def test_a_round_trip_sets_the_one_way_latency_between_nodes():
    by_rtt = plan(model="xs", cluster="emulated-4x2", rtt_ms=100.0, json=True)
    by_latency = plan(model="xs", cluster="emulated-4x2", inter_latency_us=50_000.0, json=True)
    assert [p.step_seconds for p in by_rtt] == [p.step_seconds for p in by_latency]
    near = plan(model="xs", cluster="emulated-4x2", json=True)
    assert all(far.step_seconds > close.step_seconds for far, close in zip(by_rtt, near))
    with pytest.raises(ValueError, match="`rtt_ms=-1` must be at least 0"):
        plan(rtt_ms=-1)


def test_every_federation_option_is_an_input_of_the_planner_with_its_default():
    """The planner's federation inputs are FederationConfig's fields themselves, not a copy that can drift."""
    import dataclasses
    import inspect

    from lightning_fedshard.core.config import FederationConfig

    parameters = inspect.signature(plan).parameters
    for field in dataclasses.fields(FederationConfig):
        assert parameters[field.name].default == field.default, field.name
        assert f"        {field.name}: " in (plan.__doc__ or "")  # FederationConfig's own description


def test_options_the_planner_does_not_model_are_still_checked(capsys):
    plan(model="xs", cluster="emulated-4x2", merge_alpha=0.5, on_nonfinite="skip_group")
    with pytest.raises(ValueError, match="merge_alpha"):
        plan(model="xs", cluster="emulated-4x2", merge_alpha=2.0)


def test_node_speeds_are_a_comma_separated_list_or_a_bracketed_one(capsys):
    small = ["--model", "xs", "--cluster", "emulated-4x2"]
    for speeds in ("1,1,1,0.25", "[1,1,1,0.25]", "[1, 1, 1, 0.25]"):
        main([*small, "--node_speeds", speeds])
        assert "With node speeds 1, 1, 1, 0.25 (docs/pace.md):" in capsys.readouterr().out, speeds
    main([*small, "--node_speeds=1,1,1,0.5"])
    assert "With node speeds 1, 1, 1, 0.5 (docs/pace.md):" in capsys.readouterr().out


def test_a_misspelled_flag_is_one_line_naming_the_nearest_valid_one(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--model", "xs", "--sync_evry", "4"])
    assert exit.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "fedshard plan: error: unknown option `--sync_evry` (did you mean `--sync_every`?); `fedshard plan --help`"
        " lists every option."
    ]


#: Cluster fields the planner computes from its inputs: an error must name the input the user gave instead.
_INTERNAL = ("num_nodes", "peak_flops", "device_memory", "intra_bandwidth", "intra_latency", "inter_bandwidth",
             "inter_latency", "site_bandwidth")  # fmt: skip


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--seq_len", "0"], "seq_len"),
        (["--nodes", "0"], "nodes"),
        (["--devices_per_node", "0"], "devices_per_node"),
        (["--peak_tflops", "-1"], "peak_tflops"),
        (["--mfu", "1.5"], "mfu"),
        (["--step_seconds", "0"], "step_seconds"),
        (["--device_memory_gib", "-1"], "device_memory_gib"),
        (["--intra_gbytes_per_s", "0"], "intra_gbytes_per_s"),
        (["--intra_latency_us", "-1"], "intra_latency_us"),
        (["--inter_gbit_per_s", "-1"], "inter_gbit_per_s"),
        (["--inter_latency_us", "-1"], "inter_latency_us"),
        (["--rtt_ms", "-1"], "rtt_ms"),
        (["--nodes_per_site", "0"], "nodes_per_site"),
        (["--nodes_per_site", "3"], "nodes_per_site"),  # 4 nodes: not cut into sites of 3
        (["--nodes_per_site", "2"], "site_mbit_per_s"),  # sites need their uplink's bandwidth
        (["--cluster", "emulated-2x2x2", "--nodes", "3"], "nodes"),  # the preset's sites of 2 do not cut 3 nodes
        (["--site_mbit_per_s", "-1"], "site_mbit_per_s"),
        (["--micro_batch", "0"], "micro_batch"),
        (["--grad_accum", "0"], "grad_accum"),
        (["--top", "0"], "top"),
        (["--node_speeds", "1,1,1,0"], "node_speeds"),
    ],
)
def test_an_error_names_the_flag_the_user_gave(args, flag):
    with pytest.raises(SystemExit) as exit:
        main(["--model", "xs", "--cluster", "emulated-4x2", *args])
    message = str(exit.value.code)
    assert message.startswith("fedshard plan: error: ") and re.search(f"`{flag}[=`]", message), message
    assert not any(f"`{name}=" in message for name in _INTERNAL) and "Latencies" not in message, message
