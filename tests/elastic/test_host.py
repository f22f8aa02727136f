"""An elastic job's host: joining, healing, standing by."""

from __future__ import annotations

import types
import warnings

from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.fabric.utilities.warnings import PossibleUserWarning

from lightning_fedshard import Elastic
from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.runtime import FederatedRuntime


def test_a_heal_silences_lightnings_mid_epoch_resume_warning_until_the_first_step():
    def lightnings_warning() -> None:  # what Lightning's epoch loop says when it restarts mid-epoch
        rank_zero_warn(
            "You're resuming from a checkpoint that ended before the epoch ended and your dataloader is not resumable.",
            category=PossibleUserWarning,
        )

    runtime = FederatedRuntime(FederationConfig(num_groups=2, elastic=Elastic(group=1)), hybrid=False, name="fl_fsdp")
    loaded: list[object] = []
    runtime.set_host_state(dict, loaded.append)
    assert runtime.elastic is not None
    runtime._federation = types.SimpleNamespace(maybe_sync=lambda step: None)  # type: ignore[assignment]
    with warnings.catch_warnings(record=True) as seen:
        runtime.elastic._joining = True  # inside `join`: a peer's state arrives
        runtime.elastic._load_host_state_of_peer(8, {"host": {"fit_loop": "at step 8"}, "hyperparameters": []})
        runtime.elastic._joining = False
        assert loaded == [{"fit_loop": "at step 8"}] and runtime.step == 8
        lightnings_warning()  # the epoch loop restarts at the peer's position: a heal, not a resume
        assert [str(w.message) for w in seen] == []
        runtime.after_optimizer_step(9)
        lightnings_warning()  # a real resume later on is still told
        assert len(seen) == 1 and "dataloader is not resumable" in str(seen[0].message)


def test_one_job_has_no_host_and_never_waits():
    runtime = FederatedRuntime(FederationConfig(num_groups=2), hybrid=False, name="fl_fsdp")
    assert runtime.elastic is None and runtime.group_index == 0 and runtime.stand_by() and not runtime.joined
    assert runtime.membership is None and not runtime.standing_by
