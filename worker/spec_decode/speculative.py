"""Speculative decoding with n-gram drafts (vLLM's `speculative_config={"method": "ngram"}`,
prompt lookup decoding), with a draft model's (`{"model": DIR}`, worker/spec_decode/draft_model.py), or
with the model's own multi-token-prediction layer's (`{"method": "mtp"}`, worker/model_executor/models/mtp.py),
or with an EAGLE-3 head's (`{"method": "eagle3", "model": DIR}`, worker/model_executor/models/eagle3.py).
Plain Python here: the scheduler reads the drafts proposed.

When a request's last few tokens occurred earlier in its prompt or output, the tokens that
followed them then are a cheap guess at what comes next. The scheduler runs a request's
last token and up to `num_speculative_tokens` guessed ones in one step; the model's logits
at every one of those positions are sampled as if they had been computed one step at a time
(each row sees the guesses before it as output), and guesses are kept while each equals the
token sampled before it. Every step so yields at least one token, and the tokens are those
plain decoding would sample: for greedy rows exactly, for random rows in distribution
(sampling a token and comparing it with a one-token guess accepts the guess with its model
probability, and otherwise samples from the rest: rejection sampling's own rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from producer.sampling_params import MIN_TEMPERATURE, SamplingParams
from worker.core.request import NO_TOKEN

# vLLM's method names for one family's MTP layers, which it now calls "mtp" alike
MTP_METHODS = ("deepseek_mtp", "glm4_moe_mtp", "qwen3_next_mtp", "qwen3_5_mtp", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int  # guesses per step, at most
    prompt_lookup_max: int = 4  # longest suffix looked up
    prompt_lookup_min: int = 1  # shortest suffix looked up
    method: str = "ngram"  # or "draft_model", "mtp", "eagle3"
    model: str | None = None  # the draft model's or EAGLE-3 head's local directory
    # no guesses while this many requests run or more: at large batches a step is bound by
    # compute, and every guess adds a row to it (None: guess at any batch size)
    disable_by_batch_size: int | None = None

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> SpeculativeConfig:
        """vLLM's speculative_config dict; ValueError naming a bad or unknown key."""
        known = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                 "disable_by_batch_size"}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))})")
        config = {"method": "draft_model" if config.get("model") else "ngram", **config}
        if config["method"] in MTP_METHODS:  # vLLM's older names for it, one per family
            config["method"] = "mtp"
        if config["method"] not in ("ngram", "draft_model", "mtp", "eagle3"):
            raise ValueError(f"speculative_config method must be 'ngram', 'draft_model', 'mtp' or 'eagle3', "
                             f"got {config['method']!r}")
        if config["method"] == "mtp" and config.get("model"):
            raise ValueError("speculative_config method 'mtp' runs the model's own MTP layer: it takes no `model` "
                             f"(got {config['model']!r})")
        if config["method"] != "mtp" and (config["method"] in ("draft_model", "eagle3")) != bool(config.get("model")):
            raise ValueError("speculative_config needs a draft `model` directory exactly when method is "
                             f"'draft_model' or 'eagle3' (method {config['method']!r}, model {config.get('model')!r})")
        if config["method"] == "mtp":  # (vLLM's default: as many as the layers, one in every checkpoint)
            config.setdefault("num_speculative_tokens", 1)
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config needs num_speculative_tokens")
        spec = cls(**config)
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(spec, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config {name} must be an int >= 1, got {value!r}")
        limit = spec.disable_by_batch_size
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"speculative_config disable_by_batch_size must be an int >= 1, got {limit!r}")
        if spec.prompt_lookup_min > spec.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({spec.prompt_lookup_min}) is over "
                             f"prompt_lookup_max ({spec.prompt_lookup_max})")
        return spec


def can_speculate(params: SamplingParams, seeded: bool) -> bool:
    """A seeded random row must draw exactly one noise vector per token (a resumed job skips
    that many): it is decoded plainly. (A guided row guesses: each of its rows is masked by
    the grammar's state after the guesses before it.)"""
    random = params.temperature >= MIN_TEMPERATURE
    return not (seeded and random)


@dataclass
class SpecDecodeStats:
    """Counts since the engine started (vLLM's spec_decode metrics)."""

    num_drafts: int = 0  # steps of a request that carried guesses
    num_draft_tokens: int = 0  # guesses computed
    num_accepted_tokens: int = 0  # guesses kept

    def add(self, num_drafts: int, num_kept: int) -> None:
        """One request's step that carried `num_drafts` guesses, `num_kept` of them kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_kept

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


MAX_CANDIDATES = 32  # earlier occurrences of a suffix's first token checked, latest first
MAX_BACKOFF_STEPS = 16  # a request whose guesses keep failing tries again at least this often


@dataclass
class Pace:
    """How many guesses a request gets: one more after all were kept, the same after some
    were, half after none was; at none, none for a while (doubling while that repeats),
    then one. A guess costs a row of compute: text that does not repeat itself should not
    keep paying for it."""

    limit: int
    wait_steps: int = 0
    backoff_steps: int = 1

    def guesses_next(self) -> bool:
        """Whether `allowed` would give any guess now (it is not asked, so nothing counts down)."""
        return self.limit > 0 or self.wait_steps == 0

    def allowed(self) -> int:
        if self.limit == 0:
            if self.wait_steps > 0:
                self.wait_steps -= 1
                return 0
            self.limit = 1  # try again
        return self.limit

    def record(self, num_drafts: int, num_kept: int, most: int) -> None:
        if num_kept == num_drafts:
            self.limit, self.backoff_steps = min(most, self.limit + 1), 1
        elif num_kept == 0:
            self.limit //= 2
            if self.limit == 0:
                self.wait_steps = self.backoff_steps
                self.backoff_steps = min(2 * self.backoff_steps, MAX_BACKOFF_STEPS)


class Pacing:
    """Each request's Pace, for a proposer: how many guesses it gets next, and how its
    last ones fared."""

    def __init__(self, most: int) -> None:
        self.most = most
        self._pace: dict[str, Pace] = {}

    def allowed(self, request_id: str) -> int:
        return self._pace.setdefault(request_id, Pace(self.most)).allowed()

    def guesses_next(self, request_id: str) -> bool:
        pace = self._pace.get(request_id)
        return pace is None or pace.guesses_next()

    def record(self, request_id: str, num_drafts: int, num_kept: int) -> None:
        """How a step went for the request's guesses: paces its next ones."""
        pace = self._pace.get(request_id)
        if pace is not None and num_drafts:
            pace.record(num_drafts, num_kept, self.most)

    def forget(self, request_id: str) -> None:
        self._pace.pop(request_id, None)


class NgramProposer:
    """Drafts for each request from its own tokens (and its predicted output's:
    Request.lookup_token_ids), with an index of where each token id occurs (kept per request
    and extended as tokens come), so a lookup checks only the places a match could start."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._positions: dict[str, dict[int, list[int]]] = {}  # request -> token id -> positions
        self._num_indexed: dict[str, int] = {}
        self.pacing = Pacing(config.num_speculative_tokens)

    def propose(self, request_id: str, token_ids: list[int], max_drafts: int) -> list[int]:
        """Up to `max_drafts` tokens that followed the latest earlier occurrence of the
        longest suffix of `token_ids` (prompt_lookup_max down to prompt_lookup_min tokens),
        fewer as the request's recent guesses failed."""
        max_drafts = min(max_drafts, self.pacing.allowed(request_id))
        num_tokens = len(token_ids)
        if max_drafts < 1 or num_tokens < 2:
            return []
        positions = self._index(request_id, token_ids)
        longest = min(self.config.prompt_lookup_max, num_tokens - 1)
        for n in range(longest, self.config.prompt_lookup_min - 1, -1):
            suffix_start = num_tokens - n
            suffix = token_ids[suffix_start:]
            checked = 0
            for start in reversed(positions.get(suffix[0], ())):
                if start >= suffix_start:
                    continue  # the suffix itself, or a match with nothing after it
                if token_ids[start : start + n] == suffix:
                    guesses = token_ids[start + n : start + n + max_drafts]
                    return guesses[: guesses.index(NO_TOKEN)] if NO_TOKEN in guesses else guesses
                checked += 1
                if checked == MAX_CANDIDATES:
                    break
        return []

    def propose_all(self, requests: list[tuple[str, list[int], int]]) -> dict[str, list[int]]:
        """`propose` for each (request id, token ids, most guesses) of a step."""
        return {rid: self.propose(rid, token_ids, room) for rid, token_ids, room in requests}

    def record(self, request_id: str, num_drafts: int, num_kept: int) -> None:
        self.pacing.record(request_id, num_drafts, num_kept)

    def remove(self, request_id: str) -> None:
        self._positions.pop(request_id, None)
        self._num_indexed.pop(request_id, None)
        self.pacing.forget(request_id)

    def _index(self, request_id: str, token_ids: list[int]) -> dict[int, list[int]]:
        positions = self._positions.setdefault(request_id, {})
        start = self._num_indexed.get(request_id, 0)
        for i in range(start, len(token_ids)):
            positions.setdefault(token_ids[i], []).append(i)
        self._num_indexed[request_id] = len(token_ids)
        return positions
