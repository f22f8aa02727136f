"""Single-process tests of the Trainer strategies: registration, defaults and early errors."""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

import lightning_fedshard
from lightning_fedshard import FLFSDPStrategy, FLHSDPStrategy, OuterSync


def _trainer(strategy, devices: int = 4, num_nodes: int = 1) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy, logger=False)


@pytest.mark.parametrize(("name", "cls"), [("fl_fsdp", FLFSDPStrategy), ("fl_hsdp", FLHSDPStrategy)])
def test_registered_names_resolve_on_cpu(name, cls):
    assert name in StrategyRegistry
    trainer = _trainer(name, devices=2, num_nodes=2)
    assert type(trainer.strategy) is cls
    assert trainer.strategy.topology.num_groups == 2  # default: one group per node


def test_defaults_one_group_per_node_and_shard_per_node():
    trainer = _trainer(FLHSDPStrategy(), devices=2, num_nodes=4)
    assert trainer.strategy.topology.mesh_shape == (4, 1, 2)
    trainer = _trainer(FLHSDPStrategy(num_groups=2), devices=2, num_nodes=4)
    assert trainer.strategy.topology.mesh_shape == (2, 2, 2)
    trainer = _trainer(FLFSDPStrategy(num_groups=2), devices=2, num_nodes=4)
    assert trainer.strategy.topology.mesh_shape == (2, 1, 4)
    config = trainer.strategy.federation_config
    assert config.sync_every == 8 and config.outer_optimizer == "fedavg" and config.anchor_device == "cpu"


def test_one_group_warns_that_it_is_plain_fsdp():
    with pytest.warns(UserWarning, match="single federation group.*plain FSDP"):
        _trainer("fl_fsdp", devices=2)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (
            lambda: _trainer(FLFSDPStrategy(num_groups=3), devices=4),
            r"world size \(4 = 1 node\(s\) x 4.*`num_groups=3`",
        ),
        (
            lambda: _trainer(FLHSDPStrategy(num_groups=2, shard_size=3), devices=4, num_nodes=2),
            r"group size \(4 .*\) must be divisible by `shard_size=3`",
        ),
        (lambda: FLFSDPStrategy(sync_every=0), r"`sync_every` must be a positive integer, got 0"),
        (lambda: FLFSDPStrategy(outer_optimizer="adam"), r"Unknown `outer_optimizer='adam'`"),
        (lambda: FLHSDPStrategy(reduce_dtype="fp8"), r"Unsupported `reduce_dtype='fp8'`"),
        (lambda: FLFSDPStrategy(shard_size=2), r"`shard_size=2` is only for FL\+HSDP"),
        (lambda: FLHSDPStrategy(sharding_strategy="FULL_SHARD"), r"`sharding_strategy='FULL_SHARD'` is not supported"),
        (lambda: FLFSDPStrategy(device_mesh=(2, 2)), r"`device_mesh=\(2, 2\)` cannot be combined"),
        (lambda: FLFSDPStrategy(state_dict_type="weird"), r"`state_dict_type='weird'` is not supported"),
        (lambda: FLHSDPStrategy(state_dict_type="FULL"), r"`state_dict_type='FULL'` is not supported"),
    ],
)
def test_bad_configuration_fails_before_any_process_starts(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_outer_optimizer_factory_must_return_an_optimizer():
    with pytest.raises(ValueError, match="returned str, expected a `torch.optim.Optimizer`"):
        FLFSDPStrategy(outer_optimizer=lambda params: "not an optimizer")


def test_callable_outer_optimizer_is_accepted():
    factory = functools.partial(torch.optim.SGD, lr=0.5, momentum=0.8, nesterov=True)
    strategy = FLHSDPStrategy(outer_optimizer=factory)
    assert strategy.federation_config.outer_optimizer_factory is factory


def test_mesh_and_federation_fail_loudly_before_processes_start():
    strategy = FLFSDPStrategy()
    with pytest.raises(RuntimeError, match="before processes have initialized"):
        strategy.mesh
    with pytest.raises(RuntimeError, match="before processes have initialized"):
        strategy.federation


def test_public_api():
    assert set(lightning_fedshard.__all__) >= {"FLFSDPStrategy", "FLHSDPStrategy", "OuterSync"}
    assert OuterSync().log_stats


def test_layer_classes_by_import_path():
    from torch import nn
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    strategy = FLFSDPStrategy(auto_wrap_policy="torch.nn.Linear", activation_checkpointing_policy=["torch.nn.ReLU"])
    assert isinstance(strategy.kwargs["auto_wrap_policy"], ModuleWrapPolicy)
    assert nn.Linear in strategy.kwargs["auto_wrap_policy"]._module_classes
    with pytest.raises(ValueError, match=r"`auto_wrap_policy` entry 'torch.nn.Nope' cannot be imported"):
        FLFSDPStrategy(auto_wrap_policy=["torch.nn.Nope"])
    with pytest.raises(ValueError, match=r"'torch.optim.SGD' is not a torch.nn.Module subclass"):
        FLHSDPStrategy(activation_checkpointing_policy=["torch.optim.SGD"])


def test_groups_that_split_nodes_are_warned_about():
    with pytest.warns(UserWarning, match="do not line up with nodes"):
        _trainer(FLFSDPStrategy(num_groups=2), devices=2, num_nodes=3)  # groups of 3 ranks on nodes of 2


def test_outer_sync_is_placed_first_whatever_the_user_order():
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_fedshard.trainer.strategy import place_outer_sync_first

    mine, user = OuterSync(prog_bar=False), L.Callback()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=FLFSDPStrategy(num_groups=2), logger=False,
        callbacks=[user, ModelCheckpoint(), mine],
    )  # fmt: skip
    place_outer_sync_first(trainer)
    assert trainer.callbacks[0] is mine
    assert sum(isinstance(c, OuterSync) for c in trainer.callbacks) == 1 and user in trainer.callbacks

    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=FLFSDPStrategy(num_groups=2), callbacks=[user], logger=False
    )
    place_outer_sync_first(trainer)
    assert isinstance(trainer.callbacks[0], OuterSync) and trainer.callbacks[0].prog_bar

    trainer = L.Trainer(accelerator="cpu", devices=2, callbacks=[OuterSync(), OuterSync()], logger=False)
    with pytest.raises(ValueError, match="got 2 `OuterSync` callbacks"):
        place_outer_sync_first(trainer)


def test_outer_sync_refuses_another_strategy():
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    with pytest.raises(TypeError, match="`OuterSync` needs the 'fl_fsdp' or 'fl_hsdp' strategy"):
        OuterSync().on_train_start(trainer, L.LightningModule())


def test_every_federation_option_is_a_strategy_argument_with_the_same_default():
    import dataclasses
    import inspect

    from lightning_fedshard._arguments import FederatedArguments
    from lightning_fedshard.core.config import FederationConfig

    parameters = inspect.signature(FederatedArguments).parameters
    classes = [
        *(lightning_fedshard.FLFSDPStrategy, lightning_fedshard.FLHSDPStrategy),
        *(lightning_fedshard.FLFSDP2Strategy, lightning_fedshard.FLHSDP2Strategy),
        *(lightning_fedshard.fabric.FLFSDPStrategy, lightning_fedshard.fabric.FLHSDPStrategy),
        *(lightning_fedshard.fabric.FLFSDP2Strategy, lightning_fedshard.fabric.FLHSDP2Strategy),
    ]
    for field in dataclasses.fields(FederationConfig):
        assert parameters[field.name].default == field.default, field.name
    for cls in classes:  # each backend's constructor passes its **kwargs on to the one federation constructor
        assert issubclass(cls, FederatedArguments) and "kwargs" in inspect.signature(cls).parameters, cls
        for field in dataclasses.fields(FederationConfig):
            assert f"        {field.name}: " in cls.__doc__, (cls.__name__, field.name)  # the one description


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"data_parallel_size": 2}, r"`data_parallel_size=2` cannot be set on `fl_fsdp2`"),
        ({"save_distributed_checkpoint": False}, r"`save_distributed_checkpoint=False` cannot be set"),
        ({"fsdp_modules": ["torch.nn.Linear"], "auto_wrap_policy": ["torch.nn.Linear"]}, r"name the same thing"),
        ({"fsdp_modules": ["torch.nn.NoSuchLayer"]}, r"`fsdp_modules` entry 'torch.nn.NoSuchLayer' cannot be imported"),
        ({"mixed_precision": {"param_dtype": "float33"}}, r"is not a torch dtype name"),
        ({"shard_size": 2}, r"`shard_size=2` is only for FL\+HSDP.*'fl_hsdp2'"),
        ({"state_dict_type": "FULL"}, r"`state_dict_type='FULL'` is not supported"),
    ],
)
def test_fsdp2_strategy_rejects_bad_arguments_before_any_work(kwargs, message):
    with pytest.raises(ValueError, match=message):
        lightning_fedshard.FLFSDP2Strategy(**kwargs)


def test_fsdp2_strategy_takes_the_fsdp1_config_unchanged():
    """A config switches backend by class name: the FSDP1 strategy's arguments, defaults included, are accepted."""
    args = dict(num_groups=2, shard_size=2, sync_every=4, auto_wrap_policy=["torch.nn.Linear"], state_dict_type="full")
    fsdp2 = lightning_fedshard.FLHSDP2Strategy(**args, data_parallel_size="auto", save_distributed_checkpoint=True)
    assert fsdp2._fsdp_modules == {torch.nn.Linear} and fsdp2.federation_config.sync_every == 4
    assert L.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy="fl_hsdp2").strategy.topology.num_groups == 2


def _all_strategy_classes() -> list[type]:
    import lightning_fedshard.fabric as fabric

    return [
        lightning_fedshard.FLFSDPStrategy, lightning_fedshard.FLHSDPStrategy,
        lightning_fedshard.FLFSDP2Strategy, lightning_fedshard.FLHSDP2Strategy,
        fabric.FLFSDPStrategy, fabric.FLHSDPStrategy, fabric.FLFSDP2Strategy, fabric.FLHSDP2Strategy,
    ]  # fmt: skip


@pytest.mark.parametrize("cls", _all_strategy_classes(), ids=lambda c: f"{c.__module__.split('.')[1]}.{c.__name__}")
def test_misspelled_arguments_fail_in_the_constructor_with_the_closest_names(cls):
    with pytest.raises(ValueError, match=r"unknown argument\(s\) `sync_evry=2` \(did you mean `sync_every`"):
        cls(sync_evry=2)
    with pytest.raises(ValueError, match=r"`num_group=2` \(did you mean `num_groups`\?\)"):
        cls(num_group=2)
    cls(sync_every=2, num_groups=2, timeout=__import__("datetime").timedelta(minutes=5))  # valid names pass


def test_arguments_of_lightning_and_torch_fsdp_are_still_accepted():
    strategy = FLFSDPStrategy(use_orig_params=True, limit_all_gathers=True, cpu_offload=False)
    assert strategy.kwargs["use_orig_params"] is True
    with pytest.raises(ValueError, match=r"`use_orig_param=True` \(did you mean `use_orig_params`\?\)"):
        FLFSDPStrategy(use_orig_param=True)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(outer_optimizer=torch.optim.SGD), r"leaves the outer learning rate at torch's default \(lr=0.001\)"),
        (
            dict(outer_optimizer=functools.partial(torch.optim.SGD, momentum=0.9)),
            r"leaves the outer learning rate at torch's default",
        ),
        (dict(error_feedback="yes"), r"must be True, False or None \(automatic\), got 'yes'"),
        (dict(error_feedback="weights"), r"`error_feedback='weights'` was removed: .* Leave `error_feedback` unset"),
    ],
)
def test_outer_options_that_would_be_silently_misread_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FLFSDPStrategy(**kwargs)


def test_a_default_shard_size_that_does_not_fit_says_it_is_the_default():
    with pytest.raises(ValueError, match=r"not divisible by the default `shard_size=4` \(the devices of one node\)"):
        _trainer(FLHSDPStrategy(num_groups=2), devices=4)


def test_the_federation_is_described_in_one_line():
    strategy = FLHSDPStrategy(num_groups=2, sync_every=4, fragments=2, sync_delay=1)
    strategy.runtime.resolve_topology(num_nodes=2, devices_per_node=2)
    line = strategy.runtime.describe()
    assert line == (
        "fl_hsdp: 2 group(s) x 1 replica(s) x 2 shard(s) = 4 ranks; outer step every 4 optimizer steps (fedavg),"
        " outer traffic int4 (blocks of 128) with error feedback, 2 streaming fragments, sum overlapped with 1"
        " step(s), anchor on the CPU"
    )
    assert "float32, anchor" in FLFSDPStrategy(reduce_dtype="float32").federation_config.describe()


def test_a_trainer_strategy_handed_to_fabric_is_named_with_the_fabric_class_to_use():
    with pytest.raises(ValueError, match=r"under Fabric use lightning_fedshard\.fabric\.FLHSDPStrategy or"):
        L.Fabric(accelerator="cpu", devices=1, strategy=lightning_fedshard.FLHSDPStrategy())
