"""The small state machines, tested directly: admission (budget, reservations, room), save-retry
(backoff on an injected clock) and the train plan. No engine, no server, no torch, no sleep."""

from __future__ import annotations

import math

import pytest

from eagleops.pipeline.generate.limits import MIN_SAMPLES_FOR_MEAN, Admission, Budget, Limits
from eagleops.pipeline.generate.store import SaveRetry
from eagleops.pipeline.protocol.events import StopReason
from eagleops.pipeline.training.train.plan import TrainPlan


def _admission(budget: int, *, max_samples: int | None = None, max_tokens: int = 100, regenerate_all: bool = False) -> Admission:
    return Admission(Limits(Budget(budget), max_samples, max_tokens), regenerate_all=regenerate_all)


def test_admission_reserves_max_tokens_per_request_until_the_mean_means_something():
    admission = _admission(1000, max_tokens=100)
    held = [admission.begin(1) for _ in range(9)]
    assert admission.room(0, 0)  # 9 x 100 reserved + 0 written < 1000
    held.append(admission.begin(1))
    assert not admission.room(0, 0)  # 10 x 100 fills it
    admission.end(held.pop())
    assert admission.room(0, 0) and admission.in_flight == 9


def test_admission_reserves_the_mean_reply_once_there_are_enough_replies():
    admission = _admission(1000, max_tokens=100)
    # 8 replies of 10 tokens accepted: a request in flight is expected to add 10, not 100
    for _ in range(50):
        admission.begin(1)
    assert admission.room(80, MIN_SAMPLES_FOR_MEAN)  # 80 + 50 x 10 < 1000
    for _ in range(42):
        admission.begin(1)
    assert not admission.room(80, MIN_SAMPLES_FOR_MEAN)  # 80 + 92 x 10 >= 1000


def test_a_conversations_replies_reserve_and_then_count_until_recorded():
    admission = _admission(100, max_tokens=10, regenerate_all=True)
    talk = admission.begin(3)  # three replies to come: 30 reserved
    assert admission.flight.replies_left == 3 and admission.room(0, 0)
    admission.flight.replied(talk, 40)  # one in, not recorded yet: counts as written
    assert admission.may_go_on(0) and admission.flight.unrecorded == 40
    admission.flight.replied(talk, 70)
    assert not admission.may_go_on(0)  # 110 unrecorded: the conversation asks for no more
    admission.end(talk)  # recorded (the store has it now) or dropped: it holds nothing
    assert (admission.flight.replies_left, admission.flight.unrecorded, admission.in_flight) == (0, 0, 0)


def test_admission_says_which_limit_stopped_the_dataset_and_a_live_budget_wins():
    admission = _admission(1000, max_samples=5)
    assert admission.reached(999, 4) is None
    assert admission.reached(1000, 0) == StopReason.BUDGET
    assert admission.reached(0, 5) == StopReason.SAMPLE_CAP
    admission.begin(1)
    assert not admission.room(0, 4)  # 4 accepted + 1 in flight fill the cap
    admission.limits.budget.live = 2000  # `eagleops budget` : kept in the manifest, read here
    assert admission.budget == 2000 and admission.reached(1000, 0) is None


def test_save_retry_backs_off_on_its_clock_and_says_a_reason_once():
    saving = SaveRetry()
    assert saving.due(now=0.0)
    assert saving.failed("No space left on device", now=10.0)  # new: worth a log line
    assert not saving.due(10.4) and saving.due(10.5)  # 0.25 x 2**1
    assert not saving.failed("No space left on device", now=10.5)  # the same reason: no second line
    assert not saving.due(11.4) and saving.due(11.5)  # 0.25 x 2**2
    for _ in range(40):
        saving.failed("No space left on device", now=100.0)
    assert saving.retry_at == 100.0 + SaveRetry.MAX_DELAY_S  # capped, and no overflow
    assert saving.reset() == 42 and saving.error is None and saving.due(0.0)


def test_the_train_plan_counts_steps_warms_up_and_decays():
    plan = TrainPlan(samples=103, world=2, batch_size=4, epochs=3, max_steps=0, warmup_ratio=0.1, checkpoint_every=5)
    assert (plan.global_batch, plan.per_rank, plan.steps_per_epoch, plan.total_steps, plan.warmup) == (8, 51, 12, 36, 3)
    assert [plan.lr_factor(s) for s in range(3)] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert plan.lr_factor(3) == 1.0 and plan.lr_factor(36) == pytest.approx(0.0, abs=1e-12)
    assert plan.lr_factor(19) == pytest.approx(0.5 * (1 + math.cos(math.pi * 16 / 33)))
    assert TrainPlan(103, 2, 4, 3, 10, 0.0, 5).total_steps == 10 and TrainPlan(103, 2, 4, 3, 10, 0.0, 5).warmup == 0


def test_each_rank_gets_its_own_batch_and_the_ranks_together_cover_the_epoch():
    plan = TrainPlan(samples=32, world=2, batch_size=4, epochs=1, max_steps=0, warmup_ratio=0.0, checkpoint_every=100)
    order = list(range(100, 132))
    seen = [i for step in range(plan.steps_per_epoch) for rank in range(2) for i in plan.batch(order, step, rank)]
    assert sorted(seen) == order  # every sample once per epoch
    assert plan.batch(order, 0, 1) == order[16:20]  # rank 1 trains on its own half
    follow = TrainPlan(32, 2, 4, 1, 0, 0.0, 100, follow=True, per_shard=8)
    assert follow.batch(order, 1, 1) == order[12:16]  # following extract: the next global batch, dealt out
    assert follow.last_of_step(order, 1) == order[15]  # what every rank waits for before the step


def test_a_checkpoint_is_due_every_n_steps_and_when_a_step_finishes_a_shard_under_a_cache_bound():
    plan = TrainPlan(64, 1, 4, 1, 0, 0.0, 10, follow=True, per_shard=6, cache_bound=True)
    assert plan.checkpoint_due(10, saved_step=9)
    assert plan.frees_a_shard(2, saved_step=1)  # 8 samples trained on: the first shard (0..5) is done
    assert plan.frees_a_shard(3, saved_step=2)  # 12: the second (6..11) too
    assert not plan.frees_a_shard(4, saved_step=3)  # 16: the third (12..17) is not
    assert not TrainPlan(64, 1, 4, 1, 0, 0.0, 10, per_shard=6).frees_a_shard(2, 1)  # no bound: no early checkpoint
