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
    assert model.prefill_budget(0.008, 10, floor=16, ceiling=2048) == 16  # the decodes alone pass the target
    assert model.prefill_budget(10.0, 10, floor=16, ceiling=2048) == 2048


def test_it_follows_a_machine_that_slows_and_shrugs_off_a_pause():
    rng = random.Random(1)
    model = StepCostModel()
    feed(model, 0.005, 0.0005, 0.0001, 60, rng, noise=0.05)
    before = model.prefill_budget(0.020, 10, floor=16, ceiling=2048)
    assert 85 <= before <= 115
    model.observe(5.0, 10, 100)  # a 5 s pause (a GC, another process): counted as 4x the prediction at most
    assert 30 <= model.prefill_budget(0.020, 10, floor=16, ceiling=2048) < before  # (unclipped, the fit's c < 0)
    feed(model, 0.010, 0.001, 0.0002, 200, rng, noise=0.05)  # the machine at half speed
    assert model.coef[2] == pytest.approx(0.0002, rel=0.1)
    # 20 ms: 10 fixed, 10 for 10 decodes: nothing left but the floor
    assert model.prefill_budget(0.020, 10, floor=16, ceiling=2048) == 16
    assert 40 <= model.prefill_budget(0.030, 10, floor=16, ceiling=2048) <= 60


def test_decode_only_steps_teach_no_prefill_cost():
    model = StepCostModel()
    rng = random.Random(2)
    for _ in range(50):
        decodes = rng.randint(1, 64)
        model.observe(0.005 + 0.0005 * decodes, decodes, 0)
    assert not model.fitted
    assert model.prefill_budget(0.001, 10, floor=16, ceiling=512) == 512
