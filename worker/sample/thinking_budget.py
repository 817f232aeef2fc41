"""Thinking budgets (vLLM's `thinking_token_budget`): a reasoning model may write at most so
many tokens between its thinking's start and end markers (`<think>`, `</think>`); then the end
marker's tokens are forced, one a step, and the reply goes on as the answer.

Thinking starts where the start marker is last seen (in the prompt, when the chat template
opens the thinking, or in the output) and ends at the end marker after it. The markers are the
worker's `reasoning_config` (`think_start_str`, `think_end_str`, as vLLM names them), by
default the first of the known pairs (`<think>`, Magistral's `[THINK]`, Seed-OSS's
`<seed:think>`) the tokenizer has as tokens of their own. Plain
Python: each request's state follows its committed output a token at a time, and a row with
guesses before it is the state after them (a copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

# the thinking tags reasoning models write, each pair a token each in their tokenizers
KNOWN_MARKERS = (("<think>", "</think>"), ("[THINK]", "[/THINK]"), ("<seed:think>", "</seed:think>"))


@dataclass(frozen=True)
class ThinkingMarkers:
    start: tuple[int, ...]
    end: tuple[int, ...]

    @classmethod
    def from_config(cls, reasoning_config: dict[str, Any] | None, tokenizer: Any) -> ThinkingMarkers | None:
        """The markers a reasoning_config names (ValueError for one that is not two non-empty
        strings), else the first known pair whose tags are a token each; None: none known."""
        if reasoning_config is None:
            for pair in KNOWN_MARKERS:  # (an unknown token is the unknown token's id, or None)
                start, end = tokenizer.convert_tokens_to_ids(list(pair))
                if None not in (start, end) and tokenizer.unk_token_id not in (start, end):
                    return cls((start,), (end,))
            return None
        unknown = set(reasoning_config) - {"think_start_str", "think_end_str"}
        if unknown:
            raise ValueError(f"reasoning_config takes think_start_str and think_end_str, got {sorted(unknown)}")
        texts = [reasoning_config.get(name) for name in ("think_start_str", "think_end_str")]
        if not all(isinstance(t, str) and t for t in texts):
            raise ValueError("reasoning_config must give think_start_str and think_end_str as non-empty strings")
        start_ids, end_ids = (tuple(tokenizer.encode(t, add_special_tokens=False)) for t in texts)
        return cls(start_ids, end_ids)


@dataclass
class ThinkingState:
    """Where one completion stands: inside its thinking or not, how many tokens it has thought,
    how much of the end marker has been forced."""

    markers: ThinkingMarkers
    budget: int
    thinking: bool = False
    thought: int = 0  # output tokens inside the thinking so far
    forced: int = 0  # end-marker tokens forced so far (while forcing)
    seen: int = 0  # output tokens followed
    window: list[int] = field(default_factory=list)  # the last tokens, as long as the longer marker

    def due(self) -> int | None:
        """The token the next step must be: the end marker's next, once the budget is spent."""
        if self.thinking and self.thought >= self.budget:
            return self.markers.end[self.forced]
        return None

    def feed(self, tokens: Sequence[int], counted: bool = True) -> None:
        """Follow tokens (`counted`: output tokens, which spend the budget; else the prompt's)."""
        width = max(len(self.markers.start), len(self.markers.end))
        for token in tokens:
            due = self.due() if counted else None
            self.window = (self.window + [token])[-width:]
            if due is not None and token == due:
                self.forced += 1
                if self.forced == len(self.markers.end):
                    self.thinking, self.forced = False, 0
            elif self.thinking:
                if self._ends_with(self.markers.end):
                    self.thinking, self.forced = False, 0
                elif counted:
                    self.thought += 1
            elif self._ends_with(self.markers.start):
                self.thinking, self.thought = True, 0

    def _ends_with(self, marker: tuple[int, ...]) -> bool:
        return len(self.window) >= len(marker) and tuple(self.window[-len(marker):]) == marker


class ThinkingBudgets:
    """The states of the requests that have a budget, by request id."""

    def __init__(self, markers: ThinkingMarkers | None) -> None:
        self.markers = markers
        self.states: dict[str, ThinkingState] = {}

    def check(self, budget: int | None) -> None:
        """ValueError for a budget this worker cannot keep: it knows no thinking markers."""
        if budget is not None and self.markers is None:
            raise ValueError(
                "thinking_token_budget needs the thinking's markers: this model's tokenizer has no <think> and "
                "</think> tokens (nor [THINK], <seed:think>), so the worker must be started with --reasoning-config "
                "'{\"think_start_str\": ..., \"think_end_str\": ...}'"
            )

    def add(self, request_id: str, budget: int | None, prompt_token_ids: Sequence[int]) -> None:
        if budget is None or self.markers is None:
            return
        state = ThinkingState(self.markers, budget)
        state.feed(prompt_token_ids, counted=False)
        self.states[request_id] = state

    def remove(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def forced(self, row_ids: Sequence[str], requests: Sequence[Any], row_outputs: Sequence[Sequence[int]]
               ) -> list[int | None] | None:
        """Per logits row, the token it must be (None: free); None when no row has a budget.
        `requests[i]`: row i's request, whose `num_output_tokens` it has kept (the rest of the
        row's output are guesses the row assumes)."""
        if not self.states or not any(rid in self.states for rid in row_ids):
            return None
        out: list[int | None] = []
        for rid, request, output in zip(row_ids, requests, row_outputs, strict=True):
            state = self.states.get(rid)
            if state is None:
                out.append(None)
                continue
            kept = request.num_output_tokens
            if state.seen < kept:  # the tokens kept since the last step
                state.feed(output[state.seen:kept])
                state.seen = kept
            if len(output) > kept:  # guesses before this row
                state = replace(state, window=list(state.window))
                state.feed(output[kept:])
            out.append(state.due())
        return out
