"""Lightning's ordinary workflows on every registered strategy name, with the Trainer's defaults.

One launch (4 ranks = 2 nodes x 2 devices, so every name federates 2 groups) runs Lightning's ``BoringModel``
through ``fit`` (sanity check on) -> ``test`` -> ``validate(ckpt_path=...)`` -> ``predict`` -> a second ``fit`` on
the same Trainer, then resumes the federated checkpoint under ``strategy="ddp"``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from tests.launch import launch
from tests.trainer.workflow_worker import NAMES, VARIANTS

pytestmark = pytest.mark.slow  # launches processes

WORKER = Path(__file__).with_name("workflow_worker.py")
NODES, DEVICES = 2, 2


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("workflows")
    launch(WORKER, [str(root)], NODES, DEVICES, root / "logs", timeout=400)
    return root


@pytest.fixture(scope="module")
def ranks(root) -> list[dict]:
    return [torch.load(root / f"rank{r}.pt", weights_only=False) for r in range(NODES * DEVICES)]


def test_the_console_names_the_federation_once_and_stays_free_of_warnings_nobody_can_act_on(root):
    logs = [(root / "logs" / f"rank{r}.log").read_text() for r in range(NODES * DEVICES)]
    line = (
        "fl_hsdp: 2 group(s) x 1 replica(s) x 2 shard(s) = 4 ranks; outer step every 8 optimizer steps (fedavg),"
        " outer traffic int4 (blocks of 128) with error feedback, anchor on the CPU"
    )
    assert line in logs[0] and not any(line in log for log in logs[1:])  # rank zero only, at the start of each fit
    for log in logs:
        assert "LeafSpec" not in log and "ShardedTensor" not in log and "NO_SHARD" not in log
    for log in logs[1:]:
        assert "FutureWarning" not in log and "DeprecationWarning" not in log  # deprecations: rank zero only


def _peers(ranks: list[dict], name: str, key: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What each rank saw next to the rank at the same in-group position of the other group (one group per node)."""
    return [(ranks[r][name][key], ranks[r + DEVICES][name][key]) for r in range(DEVICES)]


@pytest.mark.parametrize("name", NAMES)
def test_fit_with_the_sanity_check_then_test_validate_predict_and_fit_again(ranks, name):
    for seen in ranks:
        run = seen[name]
        assert run["sanity_batches"] == 2  # Trainer default num_sanity_val_steps=2
        assert run["callbacks"][0] == "OuterSync"
        assert run["syncs_after_fit"] == 1  # max_steps=4 < sync_every=8: the end-of-fit sync
        assert run["predictions"] > 0 and set(run["validate"]) == {"val_loss"}
        # the second fit continues the same federation: its schedule syncs at step 8
        assert run["same_federation"] and run["global_step"] == 8 and run["syncs_after_second_fit"] == 2
        assert_close(run["after_test"], run["after_fit"], rtol=0, atol=0)  # evaluation leaves the weights alone
    for key in ("after_fit", "after_second_fit"):
        for mine, peer in _peers(ranks, name, key):
            assert_close(mine, peer, rtol=0, atol=0)  # every group ends with the consensus
    losses = [seen[name]["test_losses"] for seen in ranks]
    assert all(len(loss) > 0 for loss in losses)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_same_workflow_with_sums_in_flight_and_groups_that_differ(ranks, name):
    """Eager updates (a sum in flight at every validation) and outer topologies (groups that differ after a sync)."""
    for seen in ranks:
        run = seen[name]
        assert run["sanity_batches"] == 2 and run["predictions"] > 0 and set(run["validate"]) == {"val_loss"}
        assert run["same_federation"] and run["global_step"] == 8
        assert_close(run["after_test"], run["after_fit"], rtol=0, atol=0)
    # eager: 2 groups of 2 shards (each shard against its peer); the topologies: 4 one-rank groups (all equal)
    pairs = _peers(ranks, name, "after_second_fit") if name == "eager" else [
        (seen[name]["after_second_fit"], ranks[0][name]["after_second_fit"]) for seen in ranks
    ]  # fmt: skip
    for mine, peer in pairs:
        assert_close(mine, peer, rtol=0, atol=0)  # every group ends with the consensus
    moved = ranks[0][name]["after_second_fit"] - ranks[0][name]["after_fit"]
    assert moved.abs().max() > 0  # the second fit trained


def test_a_mixing_with_the_default_reduce_dtype_ends_fit_on_the_groups_exact_mean(root, ranks):
    """Gossip with the Trainer's defaults and `reduce_dtype` left unset: 4 one-rank groups that differ after the last
    step's mix, and the end of `fit` lands every group on their exact mean (a plain outer step in float32)."""
    groups = torch.stack([seen["gossip"]["before_end_of_fit"] for seen in ranks]).double()
    assert (groups - groups.mean(0)).abs().max() > 1e-4  # the groups differ before the end of fit
    for seen in ranks:
        assert_close(seen["gossip"]["after_fit"].double(), groups.mean(0), atol=1e-6, rtol=0)
    line = "outer step every 2 optimizer steps (fedavg), outer traffic float32, gossip with 1 peer(s) per sync"
    assert line in (root / "logs" / "rank0.log").read_text()


def test_sampled_participation_restarts_every_group_from_the_anchor_of_each_outer_step(root, ranks):
    """`Sampled(2, outer_step=True)` on 4 one-rank groups: the outer step at steps 2 and 4 takes the sampled groups'
    mean and every group restarts from it, so all groups agree right after the last step (no end-of-fit sync needed)."""
    for seen in ranks:
        run = seen["sampled"]
        assert_close(run["before_end_of_fit"], ranks[0]["sampled"]["before_end_of_fit"], rtol=0, atol=0)
        assert_close(run["after_fit"], run["before_end_of_fit"], rtol=0, atol=0)
        assert run["syncs_after_fit"] == 2 and run["syncs_after_second_fit"] == 4  # outer steps, no mix
    line = "outer step every 2 optimizer steps (fedavg), outer traffic float32, 2 sampled groups per outer step"
    assert line in (root / "logs" / "rank0.log").read_text()


def test_a_plain_strategy_resumes_the_consensus_of_a_federated_checkpoint(ranks):
    checkpoint = torch.load(ranks[0]["fl_fsdp"]["final_checkpoint"], weights_only=False)
    assert checkpoint["optimizer_states"] == []  # the inner optimizer states are per group, beside the consensus
    for seen in ranks:
        assert seen["ddp"]["global_step"] == 10  # continued from the checkpoint's step 8
        for key, value in checkpoint["state_dict"].items():
            assert_close(seen["ddp"]["loaded"][key], value, rtol=0, atol=0)
