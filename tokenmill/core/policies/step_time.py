"""How long a step takes for a number of tokens, learned from the steps the engine runs. No torch."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepTimeModel:
    """seconds = fixed + per_token * tokens, least squares over the recent steps.

    Each new step's weight is 1 and older ones decay by `decay` per step (about the last 1 / (1 - decay) steps
    count), so the fit follows the machine's load and the batch's context length. Two pseudo-steps from the
    prior (`fixed`, `per_token`) with `prior_weight` keep the fit defined before there is data, and when every
    recent step had the same size (only the level is then known, so the slope stays the prior's).
    """

    fixed: float = 0.02  # prior: seconds a step costs whatever its size
    per_token: float = 0.0005  # prior: seconds per token
    decay: float = 0.97
    prior_weight: float = 0.05
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # w, w*x, w*y, w*x*x, w*x*y
    steps: int = 0
    _fit: tuple[float, float] | None = None  # coefficients() until the next observe()

    def observe(self, tokens: int, seconds: float) -> None:
        s = self._sums
        for i in range(5):
            s[i] *= self.decay
        x, y = float(tokens), float(seconds)
        s[0] += 1.0
        s[1] += x
        s[2] += y
        s[3] += x * x
        s[4] += x * y
        self.steps += 1
        self._fit = None

    def coefficients(self) -> tuple[float, float]:
        """(fixed seconds, seconds per token) of the current fit, both > 0."""
        if self._fit is None:
            self._fit = self._solve()
        return self._fit

    def _solve(self) -> tuple[float, float]:
        w, sx, sy, sxx, sxy = self._sums
        pw = self.prior_weight
        for x in (1.0, 512.0):  # the prior as two pseudo-steps
            y = self.fixed + self.per_token * x
            w, sx, sy, sxx, sxy = w + pw, sx + pw * x, sy + pw * y, sxx + pw * x * x, sxy + pw * x * y
        var = sxx - sx * sx / w
        slope = (sxy - sx * sy / w) / var if var > 1e-9 else self.per_token
        slope = max(slope, 1e-7)
        level = max((sy - slope * sx) / w, 0.0)
        return level, slope

    def predict(self, tokens: int) -> float:
        level, slope = self.coefficients()
        return level + slope * tokens

    def tokens_within(self, seconds: float) -> int:
        """The most tokens a step can compute in `seconds` (0 when even an empty step takes longer)."""
        level, slope = self.coefficients()
        return max(int((seconds - level) / slope), 0)
