import torch
from torch.testing import assert_close

from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.federation import Federation
from lightning_fedshard.core.transport.inprocess import InProcessGroups


def test_schedule_counts_real_optimizer_steps():
    fed = Federation(FederationConfig(sync_every=3), InProcessGroups(1).run(lambda g, c: c)[0])
    fed.start([torch.zeros(2)], step=0)
    due = []
    for step in [1, 1, 2, 2, 3, 3, 4, 5, 6, 6, 7]:  # repeated steps: gradient accumulation
        if fed.maybe_sync(step) is not None:
            due.append(step)
    assert due == [3, 6]
    assert fed.finish(7) is not None  # stopped mid-round: one more sync
    assert fed.finish(7) is None


def test_finish_at_a_sync_boundary_does_nothing():
    fed = Federation(FederationConfig(sync_every=2), InProcessGroups(1).run(lambda g, c: c)[0])
    fed.start([torch.zeros(1)], step=0)
    assert fed.maybe_sync(2) is not None
    assert fed.finish(2) is None


def test_consensus_weights_swap_in_the_anchor_and_back():
    groups = InProcessGroups(2)

    def work(g, comm):
        shard = torch.zeros(2)
        fed = Federation(FederationConfig(sync_every=1, outer_optimizer="fedavg"), comm)
        fed.start([shard], step=0)
        shard.fill_(g + 1.0)
        fed.maybe_sync(1)  # consensus 1.5
        shard.fill_(10.0 * (g + 1))
        with fed.consensus_weights():
            inside = shard.clone()
        return inside, shard.clone()

    for g, (inside, after) in enumerate(groups.run(work)):
        assert_close(inside, torch.full((2,), 1.5))
        assert_close(after, torch.full((2,), 10.0 * (g + 1)))


def test_anchor_can_live_next_to_the_shards():
    comm = InProcessGroups(1).run(lambda g, c: c)[0]
    fed = Federation(FederationConfig(anchor_device="device"), comm)
    shard = torch.zeros(3, dtype=torch.bfloat16)
    fed.start([shard], step=0)
    assert fed.outer.anchor[0].device == shard.device
    assert fed.outer.anchor[0].dtype == torch.float32  # full-precision anchor even for low-precision shards


def test_on_write_runs_after_every_rewrite_of_the_shards():
    def work(g, comm):
        calls = []
        fed = Federation(FederationConfig(sync_every=1), comm)
        fed.start([torch.zeros(2)], step=0, on_write=lambda: calls.append(1))
        fed.maybe_sync(1)
        with fed.consensus_weights():
            pass
        return len(calls)

    # after the sync, after swapping the consensus in, after swapping it out
    assert InProcessGroups(2).run(work) == [3, 3]


def test_a_single_group_is_its_own_consensus():
    comm = InProcessGroups(1).run(lambda g, c: c)[0]
    shard = torch.zeros(2)
    fed = Federation(FederationConfig(sync_every=4), comm)
    fed.start([shard], step=0)
    shard.fill_(5.0)  # trained since the last sync
    with fed.consensus_weights():
        assert_close(shard, torch.full((2,), 5.0))


def test_starting_again_with_new_tensors_of_the_same_layout_keeps_the_state_and_writes_to_the_new_ones():
    """FSDP2 hands out new `to_local()` views (and a state-dict load may move them): the federation follows them."""
    fed = Federation(
        FederationConfig(sync_every=1, outer_optimizer="nesterov"), InProcessGroups(1).run(lambda g, c: c)[0]
    )
    first = torch.ones(3)
    fed.start([first], step=0)
    first.add_(1.0)
    fed.maybe_sync(1)  # one Nesterov step: the outer optimizer now holds momentum
    state = fed.state_dict()
    second = first.clone()
    fed.start([second], step=1)
    assert fed.outer.shards[0] is second
    torch.testing.assert_close(fed.state_dict()["outer"]["anchor"][0], state["outer"]["anchor"][0])
    second.add_(1.0)
    fed.maybe_sync(2)
    assert not torch.equal(second, first), "the sync wrote to the old tensor"


def test_a_joining_group_heals_the_participation_rules_state_and_a_checkpoint_keeps_it():
    """With a probation the rule's record of who took part is the federation's: a group that heals decides the same."""
    from lightning_fedshard.core.options.elastic import Elastic
    from lightning_fedshard.core.step.participation import Probation

    elastic = Elastic(lighthouse="http://localhost:29510", group=0, probation=2)
    config = FederationConfig(num_groups=2, sync_every=2, reduce_dtype="float32", elastic=elastic)

    def work(g, comm):
        fed = Federation(config, comm)
        fed.start([torch.zeros(3)], step=0)
        for step in (1, 2, 3, 4):
            fed.maybe_sync(step)
        return fed.heal_state(), fed.state_dict()

    healed, saved = InProcessGroups(2).run(work)[0]
    assert healed["participation"] == saved["participation"] == {"probation": {"seen": [[0, 1], [0, 1]]}}
    for state, load in ((healed, "load_heal_state"), (saved, "load_state_dict")):
        joiner = Federation(config, InProcessGroups(1).run(lambda g, c: c)[0])
        joiner.start([torch.zeros(3)], step=0)
        getattr(joiner, load)(state)
        assert isinstance(joiner.participation, Probation) and joiner.participation.seen == [(0, 1), (0, 1)]
