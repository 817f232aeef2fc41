"""Step-time-aware chunking's cost model (worker.core.step_cost), fed (time, tokens) pairs:
no engine, no clock."""

from __future__ import annotations

import random

import pytest

from worker.core.step_cost import StepCostModel


def feed(model, a, b, c, steps, rng, noise=0.0):
    for _ in range(steps):
        decodes, prefill = rng.randint(0, 64), rng.choice([0, 0, rng.randint(1, 512)])
        model.observe((a + b * decodes + c * prefill) * (1 + rng.uniform(-noise, noise)), decodes, prefill)


def test_it_learns_the_costs_and_sizes_the_prefill_budget():
    model = StepCostModel()
    assert not model.fitted
    assert model.prefill_budget(0.05, 10, floor=16, ceiling=2048) == 2048  # nothing learned: the static budget
    feed(model, 0.005, 0.0005, 0.0001, 60, random.Random(0))  # 5 ms + 0.5 ms per decode + 0.1 ms per prefill token
    assert model.fitted
    assert model.coef == pytest.approx((0.005, 0.0005, 0.0001), rel=1e-3)
    assert model.predict(10, 100) == pytest.approx(0.02, rel=1e-3)
    # 20 ms: 5 fixed, 5 for 10 decodes, 10 left = 100 prefill tokens
    assert model.prefill_budget(0.020, 10, floor=16, ceiling=2048) in (99, 100)
    # the decodes alone (10 ms) pass an 8 ms target: the step may take 1.5x their time
    assert model.prefill_budget(0.008, 10, floor=16, ceiling=2048) in (49, 50)
    assert model.prefill_budget(0.008, 0, floor=16, ceiling=2048) in (29, 30)  # 5 ms fixed: 3 ms more, not 2.5
    assert model.prefill_budget(0.008, 0, floor=64, ceiling=2048) == 64  # never under the floor
    assert model.prefill_budget(10.0, 10, floor=16, ceiling=2048) == 2048


def test_it_follows_a_machine_that_slows_and_shrugs_off_a_pause():
    rng = random.Random(1)
    model = StepCostModel()
    feed(model, 0.005, 0.0005, 0.0001, 60, rng, noise=0.05)
    before = model.prefill_budget(0.020, 10, floor=16, ceiling=2048)
    assert 85 <= before <= 115
    model.observe(5.0, 10, 100)  # a 5 s pause (a GC, another process): counted as 4x the prediction at most
    assert 30 <= model.prefill_budget(0.020, 10, floor=16, ceiling=2048) <= 2 * before  # (unclipped: c < 0, 2048)
    feed(model, 0.010, 0.001, 0.0002, 400, rng, noise=0.05)  # the machine at half speed
    assert model.coef[2] == pytest.approx(0.0002, rel=0.1)
    # 10 decodes take 20 ms now, the whole 20 ms target: the step may take 30 ms, 50 prompt tokens
    assert 40 <= model.prefill_budget(0.020, 10, floor=16, ceiling=2048) <= 60
    assert 130 <= model.prefill_budget(0.050, 10, floor=16, ceiling=2048) <= 170  # 30 ms left: 150


def test_decode_only_steps_teach_no_prefill_cost():
    model = StepCostModel()
    rng = random.Random(2)
    for _ in range(50):
        decodes = rng.randint(1, 64)
        model.observe(0.005 + 0.0005 * decodes, decodes, 0)
    assert not model.fitted
    assert model.prefill_budget(0.001, 10, floor=16, ceiling=512) == 512
