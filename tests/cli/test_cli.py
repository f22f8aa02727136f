"""The `fedshard` LightningCLI: configs parse, strategy arguments show in --help, and a tiny run trains."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from jsonargparse import ArgumentError
from lightning.pytorch.callbacks import ModelSummary

from lightning_fedshard import FLFSDP2Strategy, FLFSDPStrategy, FLHSDP2Strategy, FLHSDPStrategy
from lightning_fedshard.cli import cli

ROOT = Path(__file__).parents[2]
CONFIGS = sorted((ROOT / "configs" / "shakespeare").glob("*.yaml"))
FEDSHARD = str(Path(sys.executable).parent / "fedshard")  # the console script


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_shakespeare_configs_instantiate(config):
    run = cli(args=["--config", str(config)], run=False)
    fsdp2 = config.stem.endswith("2")
    expected = {
        (True, False): FLHSDPStrategy, (False, False): FLFSDPStrategy, (True, True): FLHSDP2Strategy,
        (False, True): FLFSDP2Strategy,
    }[("hsdp" in config.stem, fsdp2)]  # fmt: skip
    assert type(run.trainer.strategy) is expected
    assert run.trainer.strategy.topology.world_size == 8


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_shakespeare_configs_show_a_correct_console(config):
    trainer = cli(args=["--config", str(config)], run=False).trainer
    # A max_steps run with no max_epochs makes the progress bar read "Epoch 0/-2".
    assert trainer.max_epochs == 1 and trainer.max_steps == -1
    # Lightning's summary, taken after FSDP wrapped the model, would count one rank's shard.
    assert not any(isinstance(callback, ModelSummary) for callback in trainer.callbacks)


@pytest.mark.slow
def test_examples_load_lazily_and_by_class_path():
    # `lightning_fedshard.examples` defers its imports; configs still name its classes as `class_path`.
    code = (
        "import sys, lightning_fedshard.examples as ex; "
        "loaded = 'lightning_fedshard.examples.llama' in sys.modules; "
        "from lightning_fedshard.examples import LlamaLM; "
        "print(loaded, LlamaLM.__module__, 'LlamaLM' in dir(ex))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split() == ["False", "lightning_fedshard.examples.llama", "True"]
    with pytest.raises(AttributeError, match="NoSuchModel"):
        import lightning_fedshard.examples

        _ = lightning_fedshard.examples.NoSuchModel


def test_registered_name_works_in_yaml(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 2\n  num_nodes: 2\n  strategy: fl_hsdp\n  logger: false\n"
        "model:\n  class_path: lightning_fedshard.examples.LlamaLM\n  init_args: {size: xs, vocab_size: 256}\n"
    )
    run = cli(args=["--config", str(config)], run=False)
    assert type(run.trainer.strategy) is FLHSDPStrategy
    assert run.trainer.strategy.topology.mesh_shape == (2, 1, 2)


def test_a_codec_with_its_parameters_is_given_in_yaml_and_on_the_command_line(tmp_path):
    from lightning_fedshard import BlockQuantizer, FloatCodec, SparseTopK

    config = tmp_path / "c.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 2\n  num_nodes: 2\n  logger: false\n  strategy:\n"
        "    class_path: lightning_fedshard.FLHSDPStrategy\n    init_args:\n      reduce_dtype:\n"
        "        class_path: lightning_fedshard.BlockQuantizer\n        init_args: {bits: 8, block_size: 64}\n"
        "model:\n  class_path: lightning_fedshard.examples.LlamaLM\n  init_args: {size: xs, vocab_size: 256}\n"
    )
    federation = cli(args=["--config", str(config)], run=False).trainer.strategy.federation_config
    assert federation.reduce_dtype == BlockQuantizer(bits=8, block_size=64) and federation.compressed
    args = ["--config", str(config), "--trainer.strategy.reduce_dtype", "lightning_fedshard.FloatCodec"]
    federation = cli(args=[*args, "--trainer.strategy.reduce_dtype.dtype", "bfloat16"], run=False).trainer.strategy
    assert federation.federation_config.reduce_dtype == FloatCodec("bfloat16")
    by_name = cli(args=["--config", str(config), "--trainer.strategy.reduce_dtype", "int4"], run=False)
    assert by_name.trainer.strategy.federation_config.codec == BlockQuantizer(bits=4, block_size=128)
    sparse = ["--config", str(config), "--trainer.strategy.reduce_dtype", "lightning_fedshard.SparseTopK"]
    sparse += ["--trainer.strategy.reduce_dtype.density", "0.03", "--trainer.strategy.reduce_dtype.value_bits", "4"]
    federation = cli(args=sparse, run=False).trainer.strategy.federation_config
    assert federation.codec == SparseTopK(density=0.03, value_bits=4, chunk_size=4096) and federation.compressed


def test_elastic_options_in_yaml(tmp_path, monkeypatch):
    from lightning_fedshard import Elastic

    monkeypatch.setenv("FEDSHARD_GROUP", "2")
    config = tmp_path / "c.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 2\n  num_nodes: 1\n  logger: false\n  strategy:\n"
        "    class_path: lightning_fedshard.FLHSDPStrategy\n    init_args:\n      num_groups: 4\n"
        "      elastic:\n        class_path: lightning_fedshard.Elastic\n"
        "        init_args: {lighthouse: 'http://10.0.0.1:29510', federation: shakespeare, min_groups: 2}\n"
        "model:\n  class_path: lightning_fedshard.examples.LlamaLM\n  init_args: {size: xs, vocab_size: 256}\n"
    )
    strategy = cli(args=["--config", str(config)], run=False).trainer.strategy
    elastic = strategy.federation_config.elastic
    assert elastic == Elastic(lighthouse="http://10.0.0.1:29510", federation="shakespeare", min_groups=2)
    assert strategy.topology.num_groups == 1 and strategy.distributed_sampler_kwargs == {"num_replicas": 8, "rank": 4}


def test_a_hierarchical_outer_topology_in_yaml(tmp_path):
    from lightning_fedshard import Hierarchical

    config = tmp_path / "c.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 1\n  num_nodes: 4\n  logger: false\n  strategy:\n"
        "    class_path: lightning_fedshard.FLFSDPStrategy\n    init_args:\n      outer_topology:\n"
        "        class_path: lightning_fedshard.Hierarchical\n"
        "        init_args: {levels: {8: 2, 32: 4}, sites: [[0, 2], [1, 3]]}\n"
        "model:\n  class_path: lightning_fedshard.examples.LlamaLM\n  init_args: {size: xs, vocab_size: 256}\n"
    )
    federation = cli(args=["--config", str(config)], run=False).trainer.strategy.federation_config
    assert federation.outer_topology == Hierarchical({8: 2, 32: 4}, sites=[[0, 2], [1, 3]])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("cls", "own"),
    [
        ("FLHSDPStrategy", ("auto_wrap_policy", "sharding_strategy")),
        ("FLHSDP2Strategy", ("fsdp_modules", "mixed_precision")),
    ],
)
def test_strategy_help_lists_federation_arguments(cls, own):
    out = subprocess.run(
        [sys.executable, "-m", "lightning_fedshard", "fit", "--trainer.strategy.help", f"lightning_fedshard.{cls}"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    for arg in ("num_groups", "shard_size", "sync_every", "outer_optimizer", "reduce_dtype", "anchor_device", *own):
        assert f"--trainer.strategy.{arg}" in out
    assert "Optimizer steps between two outer steps" in " ".join(out.split())


def _error_lines(stderr: str) -> list[str]:
    """The error report on stderr: all of it but the seed lines Lightning writes before it builds the classes."""
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if ": error: " in line)
    assert all("seed set to" in line.lower() for line in lines[:start]), lines[:start]
    return lines[start:]


def test_bad_value_in_config_is_reported(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["fedshard"])  # as on the command line (no pytest arguments for Lightning to see)
    config = tmp_path / "bad.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 4\n  strategy:\n    class_path: lightning_fedshard.FLFSDPStrategy\n"
        "    init_args: {num_groups: 3}\n  logger: false\n"
        "model:\n  class_path: lightning_fedshard.examples.LlamaLM\n  init_args: {size: xs, vocab_size: 256}\n"
    )
    with pytest.raises(SystemExit) as exit_info:
        cli(args=["--config", str(config)], run=False)
    err = capsys.readouterr().err
    lines = _error_lines(err)
    assert exit_info.value.code == 2
    assert "must be divisible by `num_groups=3`" in lines[0]
    assert "Traceback" not in err and len(lines) < 10


def test_bad_value_raises_argument_error_without_exit_on_error(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 2\n  strategy:\n    class_path: lightning_fedshard.FLFSDPStrategy\n"
        "    init_args: {sync_every: 0}\n  logger: false\n"
        "model:\n  class_path: lightning_fedshard.examples.LlamaLM\n  init_args: {size: xs, vocab_size: 256}\n"
    )
    with pytest.raises(ArgumentError, match="`sync_every` must be a positive integer, got 0.") as error:
        cli(args=["--config", str(config)], run=False, parser_kwargs={"exit_on_error": False})
    assert isinstance(error.value.__cause__, ValueError)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["python -m lightning_fedshard", "fedshard"])
def test_bad_strategy_argument_is_a_short_error(command):
    prefix = [sys.executable, "-m", "lightning_fedshard"] if command != "fedshard" else [FEDSHARD]
    args = ["fit", "--config", str(ROOT / "configs/shakespeare/fl_hsdp.yaml"), "--trainer.strategy.sync_every", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([*prefix, *args], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    lines = _error_lines(run.stderr)
    assert run.returncode == 2
    assert lines[0] == "fedshard fit: error: `sync_every` must be a positive integer, got 0."
    assert "--trainer.strategy (lightning_fedshard.FLHSDPStrategy)" in lines[1]
    assert len(lines) < 10
    assert "Traceback" not in run.stderr and "Namespace(" not in run.stderr and "Expected a" not in run.stderr


@pytest.mark.parametrize(
    ("arg", "value", "first", "argument"),
    [
        ("--trainer.strategy.sync_every", "abc", "Expected a <class 'int'>. Got value: abc",
         "--trainer.strategy.sync_every (lightning_fedshard.FLHSDPStrategy)"),
        ("--trainer.strategy.no_such_option", "1", "Option 'no_such_option' is not accepted",
         "--trainer.strategy (lightning_fedshard.FLHSDPStrategy)"),
        ("--trainer.strategy.reduce_dtype", "int3", "Unsupported `reduce_dtype='int3'`",
         "--trainer.strategy (lightning_fedshard.FLHSDPStrategy)"),
        ("--trainer.max_steps", "x", "Expected a <class 'int'>. Got value: x", "--trainer.max_steps"),
    ],
)  # fmt: skip
def test_parse_and_build_errors_are_short(capsys, monkeypatch, arg, value, first, argument):
    monkeypatch.setattr(sys, "argv", ["fedshard"])
    with pytest.raises(SystemExit) as exit_info:
        cli(args=["--config", str(ROOT / "configs/shakespeare/fl_hsdp.yaml"), arg, value], run=False)
    lines = _error_lines(capsys.readouterr().err)
    assert exit_info.value.code == 2
    assert ": error: " in lines[0] and first in lines[0]
    assert lines[1] == f"  argument: {argument}"
    assert lines[-1].startswith("tip: ") and len(lines) < 10


@pytest.mark.slow
def test_tiny_federated_fit_through_the_cli(tmp_path):
    """Two one-rank groups, launched by Lightning itself from `python -m lightning_fedshard fit`."""
    config = tmp_path / "tiny.yaml"
    config.write_text(f"""
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 2
  strategy:
    class_path: lightning_fedshard.FLFSDPStrategy
    init_args: {{num_groups: 2, sync_every: 2}}
  max_steps: 5
  limit_val_batches: 2
  val_check_interval: 4
  check_val_every_n_epoch: null
  num_sanity_val_steps: 0
  enable_progress_bar: false
  enable_checkpointing: false
  logger:
    class_path: lightning.pytorch.loggers.CSVLogger
    init_args: {{save_dir: {tmp_path}, name: logs}}
model:
  class_path: lightning_fedshard.examples.LlamaLM
  init_args: {{size: xs, vocab_size: 256, hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64,
               max_seq_len: 32}}
data:
  class_path: lightning_fedshard.examples.ShakespeareDataModule
  init_args: {{seq_len: 32, batch_size: 4, vocab_size: 256, cache_dir: {tmp_path / "cache"},
               max_train_windows: 64, max_val_windows: 16}}
""")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HOME": str(tmp_path / "hf")}
    subprocess.run(
        [sys.executable, "-m", "lightning_fedshard", "fit", "--config", str(config)],
        cwd=tmp_path,
        env=env,
        timeout=300,
        check=True,
        capture_output=True,
    )
    metrics = (tmp_path / "logs" / "version_0" / "metrics.csv").read_text()
    header = metrics.splitlines()[0]
    assert "fedshard/sync_bytes" in header and "val_ppl" in header


@pytest.mark.parametrize(
    ("arg", "value", "field", "expected"),
    [
        ("--trainer.strategy.outer_topology", "lightning_fedshard.Gossip", "mixing", "Gossip(peers=1, seed=0)"),
        ("--trainer.strategy.outer_topology", "Gossip", "mixing", "Gossip(peers=1, seed=0)"),
        ("--trainer.strategy.reduce_dtype", "lightning_fedshard.SparseTopK", "codec",
         "SparseTopK(density=0.015625, value_bits=2, chunk_size=4096)"),
    ],
)  # fmt: skip
def test_a_class_path_alone_on_the_command_line_is_the_class_with_its_defaults(arg, value, field, expected):
    args = ["--config", str(ROOT / "configs/shakespeare/fl_hsdp.yaml"), arg, value]
    federation = cli(args=args, run=False).trainer.strategy.federation_config
    assert repr(getattr(federation, field)) == expected


@pytest.mark.parametrize("cls", ["lightning_fedshard.Sampled", "lightning_fedshard.Mixing"])
def test_a_class_path_that_needs_arguments_says_how_to_give_them_in_a_form_that_works(cls, capsys):
    config = ["--config", str(ROOT / "configs/shakespeare/fl_hsdp.yaml")]  # 2 groups
    with pytest.raises(ArgumentError) as error:
        cli(args=[*config, "--trainer.strategy.outer_topology", cls], run=False, parser_kwargs={"exit_on_error": False})
    message = str(error.value)
    assert f"`outer_topology={cls!r}` needs `" in message
    advertised = re.search(r"On a command line give them after it: `(--trainer[^`]+)`", message)[1]
    federation = cli(args=[*config, *shlex.split(advertised)], run=False).trainer.strategy.federation_config
    assert type(federation.outer_topology).__name__ == cls.rpartition(".")[2]
    # The planner's form, advertised in the same message.
    planner = re.search(r"\(`fedshard plan`: `(--outer_topology[^`]+)`\)", message)[1]
    if cls.endswith("Sampled"):  # the example matrix is for 2 groups; the planner's cluster below has 4
        from lightning_fedshard.plan.command import main as plan_main

        capsys.readouterr()
        plan_main(["--model", "xs", "--cluster", "emulated-4x2", "--json", "true", *shlex.split(planner)])
        assert '"outer_topology": "2 sampled groups per sync"' in capsys.readouterr().out


def test_the_elastic_help_that_the_strategy_help_advertises_works(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["fedshard"])
    with pytest.raises(SystemExit) as exit_info:
        cli(args=["fit", "--trainer.strategy", "fl_hsdp", "--trainer.strategy.elastic.help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert "--trainer.strategy.elastic.lighthouse LIGHTHOUSE" in out and "--trainer.strategy.elastic.min_groups" in out
    # The options it lists are accepted as listed.
    monkeypatch.setenv("FEDSHARD_GROUP", "1")
    args = ["--config", str(ROOT / "configs/shakespeare/fl_hsdp.yaml"), "--trainer.strategy.num_groups", "4"]
    args += ["--trainer.strategy.elastic.lighthouse", "http://10.0.0.1:29510"]
    args += ["--trainer.strategy.elastic.min_groups", "2"]
    elastic = cli(args=args, run=False).trainer.strategy.federation_config.elastic
    assert (elastic.lighthouse, elastic.min_groups) == ("http://10.0.0.1:29510", 2)


def test_a_per_group_pace_in_yaml_and_on_the_command_line(tmp_path):
    from lightning_fedshard import Pace

    config = tmp_path / "c.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 2\n  num_nodes: 2\n  logger: false\n  strategy:\n"
        "    class_path: lightning_fedshard.FLHSDPStrategy\n    init_args:\n      num_groups: 2\n      pace:\n"
        "        class_path: lightning_fedshard.Pace\n        init_args: {speeds: [1.0, 0.5], merge: normalized}\n"
        "model:\n  class_path: lightning_fedshard.examples.LlamaLM\n  init_args: {size: xs, vocab_size: 256}\n"
    )
    federation = cli(args=["--config", str(config)], run=False).trainer.strategy.federation_config
    assert federation.pace == Pace(speeds=(1.0, 0.5), merge="normalized")
    changed = ["--config", str(config), "--trainer.strategy.pace.merge", "tokens"]
    federation = cli(args=changed, run=False).trainer.strategy.federation_config
    assert federation.pace == Pace(speeds=(1.0, 0.5), merge="tokens")


def test_the_saved_config_hides_the_federation_secret(tmp_path):
    from lightning_fedshard.cli import HIDDEN, SaveConfigWithoutSecrets

    secret = "a-federation-secret-given-in-yaml"
    config = tmp_path / "c.yaml"
    config.write_text(
        f"trainer:\n  accelerator: cpu\n  devices: 1\n  default_root_dir: {tmp_path}\n  strategy:\n"
        "    class_path: lightning_fedshard.FLFSDPStrategy\n    init_args:\n      num_groups: 2\n      elastic:\n"
        "        class_path: lightning_fedshard.Elastic\n        init_args:\n"
        f"          lighthouse: http://localhost:29510\n          group: 0\n          secret: {secret}\n"
        "model:\n  class_path: lightning_fedshard.examples.LlamaLM\n  init_args: {size: xs, vocab_size: 256}\n"
    )
    run = cli(args=["--config", str(config)], run=False)
    assert run.trainer.strategy.federation_config.elastic.federation_secret() == secret.encode()  # it is used
    (callback,) = [c for c in run.trainer.callbacks if isinstance(c, SaveConfigWithoutSecrets)]
    callback.setup(run.trainer, run.model, "fit")
    saved = (tmp_path / "lightning_logs" / "version_0" / "config.yaml").read_text()
    assert secret not in saved and f"secret: {HIDDEN}" in saved
    secrets = [run.config[k] for k in run.config.keys() if k.endswith(".secret")]
    assert secrets == [secret]  # the run's own configuration is left as it was


def test_print_config_hides_the_federation_secret(tmp_path, capsys, monkeypatch):
    from lightning_fedshard.cli import HIDDEN

    monkeypatch.setattr(sys, "argv", ["fedshard"])
    secret = "a-federation-secret-given-in-yaml"
    config = tmp_path / "c.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  strategy:\n    class_path: lightning_fedshard.FLFSDPStrategy\n    init_args:\n"
        "      num_groups: 2\n      elastic:\n        class_path: lightning_fedshard.Elastic\n        init_args:\n"
        f"          lighthouse: http://localhost:29510\n          group: 0\n          secret: {secret}\n"
        "model:\n  class_path: lightning_fedshard.examples.LlamaLM\n  init_args: {size: xs, vocab_size: 256}\n"
    )
    for args in (["fit", "--config", str(config), "--print_config"], ["--config", str(config), "--print_config"]):
        with pytest.raises(SystemExit) as exit_info:
            cli(args=args, run=args[0] == "fit")
        printed = capsys.readouterr().out
        assert exit_info.value.code == 0
        assert secret not in printed and f"secret: {HIDDEN}" in printed
        assert "lighthouse: http://localhost:29510" in printed  # the rest is shown


def test_a_misspelled_option_names_the_nearest_valid_one(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["fedshard"])
    with pytest.raises(SystemExit) as exit_info:
        cli(args=["fit", "--config", str(ROOT / "configs/shakespeare/fl_hsdp.yaml"), "--trainer.max_stpes", "4"])
    lines = _error_lines(capsys.readouterr().err)
    assert exit_info.value.code == 2
    assert lines[0] == (
        "fedshard fit: error: unknown option `--trainer.max_stpes` (did you mean `--trainer.max_steps`?); `fedshard fit"
        " --help` lists every option."
    )
