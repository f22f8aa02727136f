import dataclasses
import functools
import inspect

import pytest
import torch

from lightning_fedshard import SparseLoCo
from lightning_fedshard._arguments import FederatedArguments
from lightning_fedshard.core.config import FederationConfig, resolve_outer_optimizer
from lightning_fedshard.core.wire.reducers import AllReduceSum
from lightning_fedshard.plan import TrainSetup
from lightning_fedshard.plan.command import plan


def test_named_outer_optimizers():
    params = [torch.zeros(2, requires_grad=True)]
    nesterov = resolve_outer_optimizer("nesterov")(params)
    assert isinstance(nesterov, torch.optim.SGD)
    assert nesterov.defaults["lr"] == 0.7 and nesterov.defaults["momentum"] == 0.9 and nesterov.defaults["nesterov"]
    fedavg = resolve_outer_optimizer("fedavg")(params)
    assert fedavg.defaults["lr"] == 1.0 and fedavg.defaults["momentum"] == 0


def test_callable_outer_optimizer_is_kept():
    factory = functools.partial(torch.optim.SGD, lr=0.5, momentum=0.8, nesterov=True)
    assert FederationConfig(outer_optimizer=factory).outer_optimizer_factory is factory


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sync_every": 0}, r"`sync_every` must be a positive integer, got 0"),
        ({"sync_every": 2.5}, r"`sync_every` must be a positive integer, got 2.5"),
        ({"num_groups": -1}, r"`num_groups` must be a positive integer, got -1"),
        ({"outer_optimizer": "adamw"}, r"Unknown `outer_optimizer='adamw'`"),
        ({"outer_optimizer": 3}, r"`outer_optimizer` must be a name or a callable.*got 3"),
        ({"reduce_dtype": "int16"}, r"Unsupported `reduce_dtype='int16'`"),  # int8 and int4 are quantized outer traffic
        ({"reduce_dtype": torch.float64}, r"Unsupported `reduce_dtype=torch.float64`"),
        ({"anchor_device": "gpu"}, r"`anchor_device` must be 'cpu' or 'device', got 'gpu'"),
    ],
)
def test_bad_options_name_the_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FederationConfig(**kwargs)


@pytest.mark.parametrize(("name", "dtype"), [("bfloat16", torch.bfloat16), ("torch.float16", torch.float16)])
def test_reduce_dtype_names(name, dtype):
    assert FederationConfig(reduce_dtype=name).reduce_torch_dtype is dtype


def test_topology_defaults():
    # FL+HSDP: one group per node, shard over a node's devices
    assert FederationConfig().topology(num_nodes=4, devices_per_node=2, hybrid=True).mesh_shape == (4, 1, 2)
    assert FederationConfig(num_groups=2).topology(4, 2, hybrid=True).mesh_shape == (2, 2, 2)
    # FL+FSDP: shard over the whole group
    assert FederationConfig(num_groups=2).topology(4, 2, hybrid=False).mesh_shape == (2, 1, 4)
    with pytest.raises(ValueError, match=r"world size \(6 = 3 node\(s\) x 2 device\(s\)\).*`num_groups=4`"):
        FederationConfig(num_groups=4).topology(3, 2, hybrid=False)


_SHARED_DEFAULTS = ("sync_every", "outer_optimizer", "fragments", "sync_delay", "reduce_dtype", "error_feedback")


@pytest.mark.parametrize("entry", ["strategies", "fedshard plan", "TrainSetup"])
def test_every_entry_point_has_the_federation_config_defaults(entry):
    """The defaults are chosen once, in `FederationConfig`; the strategies and the planner must not drift from them."""
    if entry == "TrainSetup":  # embeds the record itself
        defaults = {
            f.name: getattr(TrainSetup("fl_fsdp").federation, f.name) for f in dataclasses.fields(FederationConfig)
        }
    else:
        function = FederatedArguments.__init__ if entry == "strategies" else plan
        defaults = {name: p.default for name, p in inspect.signature(function).parameters.items()}
    config = FederationConfig()
    for name in _SHARED_DEFAULTS:
        assert defaults[name] == getattr(config, name), f"{entry}: `{name}` default differs from FederationConfig"


def test_an_outer_learning_rate_left_at_torchs_default_is_an_error_in_python_and_a_warning_from_yaml():
    import functools

    import torch

    from lightning_fedshard.core.config import outer_learning_rate_warning

    for spec in (torch.optim.SGD, functools.partial(torch.optim.Adam, betas=(0.9, 0.99))):
        with pytest.raises(ValueError, match=r"leaves the outer learning rate at torch's default \(lr=0.00"):
            FederationConfig(outer_optimizer=spec)
    FederationConfig(outer_optimizer=functools.partial(torch.optim.SGD, lr=0.5))

    def instantiate(*args, **kwargs):  # jsonargparse's form: the class among the arguments, every default bound
        return args[-1](*kwargs.pop("params", ()), **kwargs)

    from_yaml = functools.partial(instantiate, object(), torch.optim.SGD, lr=0.001, momentum=0.9)
    assert "runs at lr=0.001, torch's default" in outer_learning_rate_warning(from_yaml)
    assert outer_learning_rate_warning(functools.partial(instantiate, object(), torch.optim.SGD, lr=0.7)) is None
    assert outer_learning_rate_warning("fedavg") is None


def test_a_codec_object_is_the_same_sync_as_its_name_and_carries_its_own_parameters():
    from lightning_fedshard.core.wire.codecs import BlockQuantizer, FloatCodec

    assert FederationConfig(reduce_dtype=BlockQuantizer(4, 64)).codec == FederationConfig(quant_block_size=64).codec
    assert FederationConfig(reduce_dtype=FloatCodec("bfloat16")).reduce_torch_dtype == torch.bfloat16
    assert FederationConfig(reduce_dtype=BlockQuantizer(8)).reducer().feedback is not None  # feedback on, as by name
    with pytest.raises(ValueError, match=r"`quant_block_size=64` is for the named 'int8' / 'int4'"):
        FederationConfig(reduce_dtype=BlockQuantizer(4), quant_block_size=64)
    with pytest.raises(ValueError, match=r"`bits` must be one of \[4, 8\], got 2"):
        BlockQuantizer(bits=2)


def test_reduce_dtype_left_unset_is_int4_and_float32_with_a_mixing():
    from lightning_fedshard import Gossip, Hierarchical, Mixing, Sampled

    assert FederationConfig().effective_reduce_dtype == "int4" and FederationConfig().compressed
    hierarchical = FederationConfig(sync_every=2, outer_topology=Hierarchical({2: 2, 4: 4}))
    assert hierarchical.effective_reduce_dtype == "int4"  # its federation level moves the anchor, like "all"
    for mixing in (Gossip(peers=1), Sampled(groups_per_round=2), Mixing([[0.5, 0.5], [0.5, 0.5]])):
        config = FederationConfig(outer_topology=mixing)
        assert config.reduce_dtype is None and config.effective_reduce_dtype == "float32"
        assert not config.compressed and config.codec.exact and isinstance(config.reducer(), AllReduceSum)
        assert "outer traffic float32," in config.describe()  # the line printed at the start of training
    for given in ("float32", torch.float32):
        assert FederationConfig(outer_topology=Gossip(peers=1), reduce_dtype=given).codec.exact


@pytest.mark.parametrize("reduce_dtype", ["int4", "int8", "sparse", "bfloat16"])
def test_a_mixing_with_a_lossy_reduce_dtype_encodes_its_mixes_and_ends_in_float32(reduce_dtype):
    from lightning_fedshard import Gossip, Sampled

    for topology in (Gossip(peers=1), Sampled(groups_per_round=2)):
        config = FederationConfig(outer_topology=topology, reduce_dtype=reduce_dtype)
        assert not config.codec.exact  # the mixes' messages
        assert "mix messages, what they drop kept in the weights" in config.describe()
        reducer = config.reducer()  # the end of training: exact, with no residual to carry
        assert isinstance(reducer, AllReduceSum) and reducer.codec.exact and reducer.state_dict() == {}


def test_merge_alpha_is_refused_with_a_mixing_that_has_no_anchor_to_merge_towards():
    from lightning_fedshard import FLFSDPStrategy, Gossip

    message = (
        r"`outer_topology=Gossip\(peers=1, seed=0\)` and `merge_alpha=0.25` cannot be combined: a mix moves no shared"
        r" anchor, .* Drop one of them \(leave `merge_alpha=0`, or use `outer_topology='all'`\)"
    )
    with pytest.raises(ValueError, match=message):
        FederationConfig(merge_alpha=0.25, outer_topology=Gossip(peers=1))
    with pytest.raises(ValueError, match=message):  # in the strategy's constructor, before any process starts
        FLFSDPStrategy(merge_alpha=0.25, outer_topology=Gossip(peers=1))
    assert FederationConfig(merge_alpha=0.5).describe().endswith("merge_alpha=0.5, anchor on the CPU")


def test_sparse_keeps_its_valid_neighbours():
    from lightning_fedshard import SparseTopK

    assert FederationConfig(reduce_dtype="sparse", error_feedback=True).reducer().feedback is not None
    # Nothing is dropped when every value is sent: no feedback is then a choice, not a loss.
    assert FederationConfig(reduce_dtype=SparseTopK(density=1.0), error_feedback=False).reducer().feedback is None
    every = FederationConfig(reduce_dtype=SparseLoCo(top_k=8, chunk_size=8), error_feedback=False)
    assert every.reducer().feedback is None and "feedback decay" not in every.describe()
    assert "feedback decay 0.95" in FederationConfig(reduce_dtype=SparseLoCo()).describe()
    assert FederationConfig(reduce_dtype="int4", quant_block_size=64).codec.block_size == 64


def test_error_feedback_with_a_float_dtype_names_every_lossy_dtype():
    with pytest.raises(ValueError, match=r"needs a lossy `reduce_dtype` \('int8', 'int4' or 'sparse', or such a codec"):
        FederationConfig(reduce_dtype="float32", error_feedback=True)
