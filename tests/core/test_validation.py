"""The checks a FederationConfig runs when it is built: each refusal names the values that cannot go together."""

import pytest

from lightning_fedshard import SparseLoCo
from lightning_fedshard.core.config import FederationConfig
from lightning_fedshard.core.validation import check_choices, check_error_feedback
from lightning_fedshard.core.wire.reducers import AllReduceSum


def test_error_feedback_is_true_false_or_none():
    for feedback in (True, False, None):
        check_error_feedback(feedback)
    with pytest.raises(ValueError, match=r"must be True, False or None \(automatic\), got 'w'"):
        check_error_feedback("w")


def test_the_removed_error_feedback_in_the_weights_is_refused_with_the_evidence_and_what_to_use():
    message = r"`error_feedback='weights'` was removed: .* \+39% .* the buffer's \+29%.* Leave `error_feedback` unset"
    with pytest.raises(ValueError, match=message):
        FederationConfig(reduce_dtype="int8", error_feedback="weights")  # type: ignore[arg-type]


def test_an_unknown_anchor_device_or_nonfinite_policy_is_refused():
    check_choices("device", "skip_group")
    with pytest.raises(ValueError, match="`anchor_device` must be 'cpu' or 'device', got 'gpu'"):
        check_choices("gpu", "raise")
    with pytest.raises(ValueError, match="`on_nonfinite` must be one of"):
        check_choices("cpu", "ignore")


def test_a_mixing_refuses_an_error_feedback_setting():
    from lightning_fedshard import BlockQuantizer, Gossip

    with pytest.raises(ValueError, match=r"drops nothing for `error_feedback=True` to keep"):
        FederationConfig(outer_topology=Gossip(peers=1), error_feedback=True)
    assert isinstance(FederationConfig(outer_topology=Gossip(peers=1), error_feedback=False).reducer(), AllReduceSum)
    for feedback in (True, False):
        with pytest.raises(ValueError, match=rf"always; `error_feedback={feedback!r}` cannot change that"):
            FederationConfig(outer_topology=Gossip(), reduce_dtype=BlockQuantizer(8, 64), error_feedback=feedback)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(reduce_dtype="sparse", quant_block_size=64),
         "`quant_block_size=64` is for 'int8' / 'int4' given by name; `reduce_dtype='sparse'` is `SparseTopK(density="
         "0.015625, value_bits=2, chunk_size=4096)`, which carries its own parameters: give"
         " `lightning_fedshard.SparseTopK(chunk_size=...)`"),
        (dict(reduce_dtype="lightning_fedshard.BlockQuantizer", quant_block_size=64),
         "`quant_block_size=64` is for 'int8' / 'int4' given by name"),
        (dict(reduce_dtype="sparse", error_feedback=False),
         "`reduce_dtype='sparse'` with `error_feedback=False` sends 64 of every 4096 values and drops the others for"
         " good: 63/64 of every update would be lost."),
        (dict(reduce_dtype=SparseLoCo(), error_feedback=False),
         "with `error_feedback=False` sends 64 of every 4096 values and drops the others for good: 63/64 of every"
         " update would be lost."),
    ],
)  # fmt: skip
def test_sparse_options_that_would_do_nothing_useful_are_refused(kwargs, message):
    with pytest.raises(ValueError) as error:
        FederationConfig(**kwargs)
    assert message in str(error.value)
