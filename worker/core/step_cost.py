"""Step-time-aware chunking's cost model: what an engine step costs, learned from the steps it
ran, and the prefill tokens that fit under a target step time. Plain Python (no torch).

A step's time is modelled as  t = a + b * decode_tokens + c * prefill_tokens : a fixed cost
(scheduling, sampling set-up, the Python around the model), a cost per decode row (its weights'
share of each matmul, its attention over its context, its sampling and output) and a cost per
prefill token. a, b and c are fitted by least squares over the steps seen, each step's weight
shrinking by FORGET per step after it (a memory of ~1 / (1 - FORGET) steps), so the model
follows a machine whose speed drifts (another process on the cores, a longer context).

Given the decodes a step will carry, the prefill budget is what keeps the predicted time under
the target: (target - a - b * decodes) / c, within [floor, ceiling]. Where the decodes alone
take longer than the target (a slow or busy machine, a large batch), the target cannot be met:
the step may then take STRETCH times the decodes' time, so that prompts still advance at the
machine's pace (not a floor's few tokens a step) while no decode waits more than that for them.
Until the model has seen steps that carried prefills (it knows no c), the budget is the
ceiling: the static one."""

from __future__ import annotations

FORGET = 0.99  # each step's weight in the fit shrinks by this per later step: a memory of ~100 steps, long enough to average out a shared machine's noise
MIN_PREFILL_STEPS = 3  # steps with prefill tokens seen before c is trusted
RIDGE = 1e-6  # keeps the normal equations solvable before the features vary
# a step whose decodes alone pass the target may take this many times their time: ITL p99 stays
# under 2x its p50 where prompt chunks ride along (1.92x on W2 here at 1.5; 2.35x at 2.0, its
# chunks' cost underestimated now and then), while prompts still take a third of each step
STRETCH = 1.5
OUTLIER_RATIO = 4.0  # a step above this many times the prediction (a GC pause) teaches only that much


class StepCostModel:
    """A running, forgetting least-squares fit of step time on (1, decode tokens, prefill tokens)."""

    def __init__(self, forget: float = FORGET):
        self.forget = forget
        self._xtx = [[0.0] * 3 for _ in range(3)]  # sum of w * x x^T
        self._xty = [0.0] * 3  # sum of w * x * t
        self.coef = (0.0, 0.0, 0.0)  # a (s), b (s per decode token), c (s per prefill token)
        self.num_prefill_steps = 0

    def observe(self, step_s: float, decode_tokens: int, prefill_tokens: int) -> None:
        """Learn from one step: its wall time and the tokens it carried."""
        if self.fitted:
            step_s = min(step_s, OUTLIER_RATIO * max(self.predict(decode_tokens, prefill_tokens), 1e-6))
        x = (1.0, float(decode_tokens), float(prefill_tokens))
        for i in range(3):
            for j in range(3):
                self._xtx[i][j] = self.forget * self._xtx[i][j] + x[i] * x[j]
            self._xty[i] = self.forget * self._xty[i] + x[i] * step_s
        if prefill_tokens:
            self.num_prefill_steps += 1
        self.coef = _solve([[v + (RIDGE if i == j else 0.0) for j, v in enumerate(row)]
                            for i, row in enumerate(self._xtx)], self._xty)

    @property
    def fitted(self) -> bool:
        """Whether the fit knows what a prefill token costs."""
        return self.num_prefill_steps >= MIN_PREFILL_STEPS and self.coef[2] > 0

    def predict(self, decode_tokens: int, prefill_tokens: int) -> float:
        a, b, c = self.coef
        return a + b * decode_tokens + c * prefill_tokens

    def prefill_budget(self, target_s: float, decode_tokens: int, floor: int, ceiling: int) -> int:
        """The prefill tokens a step with `decode_tokens` may carry and stay under `target_s`
        (or STRETCH times the decodes' time, where they alone pass it), at least `floor`
        (prefills always progress) and at most `ceiling`."""
        if not self.fitted:
            return ceiling
        a, b, c = self.coef
        decode_s = a + max(b, 0.0) * decode_tokens
        room_s = max(target_s, STRETCH * decode_s) - decode_s
        return max(floor, min(ceiling, int(room_s / c))) if room_s > 0 else floor


def _solve(m: list[list[float]], v: list[float]) -> tuple[float, float, float]:
    """m x = v for a 3 x 3 m, by Gaussian elimination with partial pivoting (zeros if singular)."""
    rows = [row[:] + [rhs] for row, rhs in zip(m, v, strict=True)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) < 1e-300:
            return (0.0, 0.0, 0.0)
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, 3):
            f = rows[r][col] / rows[col][col]
            rows[r] = [x - f * y for x, y in zip(rows[r], rows[col], strict=True)]
    x = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        x[r] = (rows[r][3] - sum(rows[r][k] * x[k] for k in range(r + 1, 3))) / rows[r][r]
    return (x[0], x[1], x[2])
