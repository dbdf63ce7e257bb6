"""The loss guard's state at the edges the trainer meets: a fresh guard is not skipping (one bad first step is a
skip, not a rollback), a checkpoint from before rollbacks were counted loads with none, and a refusal to roll
back to the initial weights names them."""

from __future__ import annotations

import math

from framework.checkpoint.config import GuardConfig
from framework.checkpoint.guard import LossGuard


def test_a_fresh_guard_is_not_skipping_and_its_first_bad_step_is_one_skip() -> None:
    g = LossGuard(GuardConfig(max_consecutive=2))
    assert not g.skipping and not g.rollback_due and g.consecutive == 0
    assert g.check(math.nan, 1.0).skip
    assert g.consecutive == 1 and g.skipping and not g.rollback_due
    assert g.check(math.nan, 1.0).skip and g.rollback_due


def test_a_state_from_before_rollbacks_were_counted_loads_with_none() -> None:
    old = {"history": [5.0, 5.1], "consecutive": 0, "skipped_total": 3}
    g = LossGuard(GuardConfig(max_rollbacks=1))
    g.load_state_dict(old)
    assert g.rollbacks == 0 and g.rollback_targets == {} and g.skipped_total == 3
    assert g.rollback_refusal("step_4") is None  # the one allowed rollback is still available


def test_refusing_a_second_rollback_to_the_initial_weights_names_them() -> None:
    g = LossGuard(GuardConfig(max_rollbacks=5))
    g.rolled_back("")  # no checkpoint yet: the rollback went to the initial weights
    assert g.rollback_refusal("") == ("a rollback to the initial weights already happened and the divergence "
                                      "came back")
