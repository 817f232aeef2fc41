"""Structured output on xgrammar (vLLM's `guided_decoding`: `json_object`, `json_schema`,
`choice`, `regex`, `grammar` (EBNF, or a Lark grammar), `structural_tag`), the grammar engine
vLLM and SGLang run.

A guide is read into an xgrammar grammar as its request is added (a guide xgrammar cannot read
is refused there, naming what is wrong); compiling it against the engine's vocabulary (the
masks of the states whose tokens it can sort ahead of time: tens to hundreds of milliseconds)
runs in a thread beside the engine's steps (xgrammar lets go of the GIL), while the request's
prompt is computed, and is kept for the next request with the same guide. Each guided request
has a matcher, made at its first mask, that takes its output tokens as they come. At a step, every guided row's
allowed tokens are written into one int32 bitmask (bit i of word i // 32: token i may come
next; an unguided row's words are all ones), which the sampler unpacks on the logits' device
for all guided rows at once (`worker.sample.sampling_batch`).

Where the output may end, the stop tokens are allowed too (the engine's EOS ids, the matcher's
stop tokens). Special tokens never stand in a grammar's text, but for structural tags, whose
triggers may be one (Llama's `<|python_tag|>`): those take special tokens by their text, as
xgrammar takes them. A grammar may start after a marker (`"after"`: a thinking reply's
`</think>`, gpt-oss's `<|channel|>final<|message|>`, special tokens spelled by their text):
until the output has written it, the row is free.

Speculative decoding's guesses are checked against the grammar (`fitting`), and a step's rows
for them are masked as if the guesses before them were output: the matcher takes the
guesses and gives them back (xgrammar's rollback).
"""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from collections.abc import Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr

from producer.grammar.json_schema import for_xgrammar
from producer.grammar.structural_tag import read_structural_tag

COMPILED_KEPT = 128  # guides whose compiled grammars are kept (a few MiB each at most)
COMPILE_THREADS = 2  # a grammar's masks are sorted ahead of time over the vocabulary, in threads
MAX_WHITESPACE_RUN = 64  # JSON's whitespace in a row: room to indent 15 levels by 4, yet no padding forever


logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Grammar:
    """A request's grammar, being compiled or compiled: shared by every request that asked the same."""

    compiled: Future[xgr.CompiledGrammar]
    after: bytes | None  # the grammar starts after this text; until then the output is free


@dataclass
class GuidedState:
    """One request's progress through its grammar."""

    grammar: Grammar
    matcher: xgr.GrammarMatcher | None = None  # made at its first mask (its grammar compiled by then)
    num_tokens: int = 0  # output tokens taken so far
    after: bytes | None = None  # while not None: the marker awaited, the output free meanwhile
    seen: bytes = b""  # while the marker is awaited: the output's tail that may begin it
    stuck: bool = False  # it may only stop: the text after its marker fit no sentence, or its grammar failed to compile


class GuidedDecoding:
    """The grammar state of each guided request of one engine, and the masks for a step."""

    def __init__(self, tokenizer: Any, stop_ids: Collection[int], vocab_size: int) -> None:
        """`vocab_size`: the logits' width (the tokenizer's vocabulary may be smaller)."""
        self.tokenizer = tokenizer
        self.stop_ids = sorted(stop_ids)
        self.vocab_size = vocab_size
        self.states: dict[str, GuidedState] = {}  # request id -> its progress
        # (built at the first guided request: reading the vocabulary takes a fraction of a second)
        self._compilers: dict[bool, xgr.GrammarCompiler] = {}  # by whether special tokens are read
        self._token_texts: list[bytes] | None = None  # every token's text, special tokens' spelled
        self._batch_matcher: xgr.BatchGrammarMatcher | None = None  # (fills a step's rows over threads)
        self._stop_bits: torch.Tensor | None = None  # the stop tokens alone, as a bitmask row
        self._compiled: OrderedDict[str, Future[xgr.CompiledGrammar]] = OrderedDict()  # by guide
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="genq-grammar")
        # masks filled ahead, beside the next step's forward (prefetch): request id -> (its output
        # tokens the row follows, the row); the fill in flight, which every use of a matcher awaits
        self._ahead: dict[str, tuple[int, torch.Tensor]] = {}
        self._filling: Future[None] | None = None
        self._filler = ThreadPoolExecutor(1, thread_name_prefix="genq-masks")

    def compile(self, guided_decoding: dict[str, Any]) -> Grammar:
        """The grammar `guided_decoding` asks for (SamplingParams checked its shape), compiling
        in the background; ValueError naming what is wrong where xgrammar cannot read it."""
        after = guided_decoding.get("after")
        key = json.dumps({k: v for k, v in guided_decoding.items() if k != "after"}, sort_keys=True)
        compiled = self._compiled.get(key)
        if compiled is None:
            try:
                grammar = _read(guided_decoding)
            except (RuntimeError, ValueError, TypeError) as exc:  # (xgrammar's errors, pydantic's)
                kind = next(k for k in guided_decoding if k not in ("after", "disable_any_whitespace"))
                raise ValueError(f"guided_decoding {kind}: {_xgrammar_message(exc)}") from None
            # (the vocabulary too is read there, at the first guide: a few hundred milliseconds)
            compiled = self._compiled[key] = self._pool.submit(self._compile, grammar, "structural_tag" in guided_decoding)
            if len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(key)
        return Grammar(compiled, None if after is None else after.encode())

    def add(self, request_id: str, grammar: Grammar) -> None:
        self.states[request_id] = GuidedState(grammar, after=grammar.after)

    def remove(self, request_id: str) -> None:
        self._settle()
        self.states.pop(request_id, None)
        self._ahead.pop(request_id, None)

    def prefetch(self, requests: Sequence[tuple[str, Sequence[int]]]) -> None:
        """Fill the next masks of these requests (id, output tokens) in a thread, while the
        engine schedules and runs its next step (xgrammar lets go of the GIL as it fills): a
        step's mask is then a copy of its row where its request's output is as it was here."""
        self._settle()
        self._ahead.clear()
        guided = [(rid, out) for rid, out in requests if rid in self.states]
        if guided:
            self._filling = self._filler.submit(self._fill_ahead, guided)

    def _fill_ahead(self, requests: list[tuple[str, Sequence[int]]]) -> None:
        plain: list[tuple[str, int, xgr.GrammarMatcher]] = []
        for request_id, output_token_ids in requests:
            guided = self.states[request_id]
            matcher = self._advance(guided, output_token_ids)
            if guided.after is None and matcher is not None and not matcher.is_terminated():
                plain.append((request_id, len(output_token_ids), matcher))
        if not plain:
            return
        bitmask = xgr.allocate_token_bitmask(len(plain), self.vocab_size)
        self._fill(bitmask, [(row, matcher) for row, (_, _, matcher) in enumerate(plain)])
        self._ahead = {request_id: (num_tokens, bitmask[row]) for row, (request_id, num_tokens, _) in enumerate(plain)}

    def _settle(self) -> None:
        """Wait for the fill in flight, if any: a matcher is used by one thread at a time."""
        if self._filling is not None:
            filling, self._filling = self._filling, None
            filling.result()

    def masks(self, rows: Sequence[tuple[str, Sequence[int], int]]) -> torch.Tensor | None:
        """Per row (request id, its output tokens, how many of them at the end are guesses
        (speculative decoding)): the tokens it may sample next, as a bitmask [rows,
        ceil(vocab / 32)] int32 (all ones for an unguided row, or one not guided yet); None
        when no row is guided. The request's matcher takes in its tokens, not the guesses."""
        if not any(request_id in self.states for request_id, _, _ in rows):
            return None
        self._settle()
        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)  # (all ones)
        plain: list[tuple[int, xgr.GrammarMatcher]] = []  # rows without guesses: filled at once
        for row, (request_id, output_token_ids, num_guessed) in enumerate(rows):
            guided = self.states.get(request_id)
            if guided is None:
                continue
            ahead = self._ahead.get(request_id)
            if ahead is not None and not num_guessed and ahead[0] == len(output_token_ids):
                bitmask[row] = ahead[1]  # (filled beside the forward)
                continue
            matcher = self._advance(guided, output_token_ids[: len(output_token_ids) - num_guessed])
            if guided.after is not None:
                continue  # not guided yet
            if matcher is None or matcher.is_terminated():
                bitmask[row] = self._stop_mask()
            elif num_guessed:
                self._fill_after_guesses(matcher, output_token_ids[len(output_token_ids) - num_guessed:], bitmask, row)
            else:
                plain.append((row, matcher))
        self._fill(bitmask, plain)
        return bitmask

    def _fill(self, bitmask: torch.Tensor, plain: list[tuple[int, xgr.GrammarMatcher]]) -> None:
        """Each (row, matcher)'s next tokens into its row of `bitmask`."""
        if len(plain) == 1:
            plain[0][1].fill_next_token_bitmask(bitmask, plain[0][0])
        elif plain:  # (xgrammar spreads them over threads)
            if self._batch_matcher is None:
                self._batch_matcher = xgr.BatchGrammarMatcher(COMPILE_THREADS)
            self._batch_matcher.batch_fill_next_token_bitmask(
                [matcher for _, matcher in plain], bitmask, [row for row, _ in plain])

    def fitting(self, request_id: str, output_token_ids: Sequence[int], guesses: list[int]) -> list[int]:
        """The guesses up to the first one the request's grammar refuses after its output
        (all of them for an unguided request, or one not guided yet): a refused guess could
        never be kept."""
        self._settle()
        guided = self.states.get(request_id)
        if guided is None or not guesses:
            return guesses
        matcher = self._advance(guided, output_token_ids)
        if guided.after is not None:
            return guesses
        if matcher is None:
            return []
        taken = _accept_while(matcher, guesses)
        matcher.rollback(taken)
        return guesses[:taken]

    def forced(self, request_id: str, output_token_ids: Sequence[int], room: int) -> list[int]:
        """Jump-forward: the tokens of the text the request's grammar forces next (the rest of
        a key its schema names, the `": "` after it), at most `room` of them, as guesses for its
        next step: the model checks them in one forward, and keeps those it would have
        sampled, so the output is what it would have been, in fewer steps. [] where nothing is
        forced (and for an unguided request)."""
        self._settle()
        guided = self.states.get(request_id)
        if guided is None or room <= 0:
            return []
        matcher = self._advance(guided, output_token_ids)
        if guided.after is not None or matcher is None or matcher.is_terminated():
            return []
        text = matcher.find_jump_forward_string()
        if not text:
            return []
        return self.fitting(request_id, output_token_ids, self.tokenizer.encode(text, add_special_tokens=False)[:room])

    def _fill_after_guesses(self, matcher: xgr.GrammarMatcher, guesses: Sequence[int], bitmask: torch.Tensor,
                            row: int) -> None:
        """The row's mask after its guesses (a guess the grammar refuses makes the rows after
        it unkept whatever they sample: the mask is then the one before it)."""
        taken = _accept_while(matcher, guesses)
        if matcher.is_terminated():
            bitmask[row] = self._stop_mask()
        else:
            matcher.fill_next_token_bitmask(bitmask, row)
        matcher.rollback(taken)

    def _advance(self, guided: GuidedState, output_token_ids: Sequence[int]) -> xgr.GrammarMatcher | None:
        """Take the output tokens not seen yet (one per step; all of them for a resumed
        request); the matcher past them, or None while its marker is awaited or once the output
        left the grammar (it may only stop then). A token the grammar refuses (a stop token at
        the end, a thinking budget's forced marker) leaves the matcher as it was."""
        for token_id in output_token_ids[guided.num_tokens:]:
            if guided.after is not None:
                rest = _past(guided, self._texts()[token_id])
                if rest and (matcher := self._matcher(guided)) is not None:  # the grammar's first text: it must fit
                    guided.stuck = not matcher.accept_string(rest)
            elif (matcher := self._matcher(guided)) is not None and not matcher.is_terminated():
                matcher.accept_token(token_id)
        guided.num_tokens = len(output_token_ids)
        return None if guided.after is not None else self._matcher(guided)

    def _matcher(self, guided: GuidedState) -> xgr.GrammarMatcher | None:
        """The request's matcher, made once its grammar is compiled (waiting for that where it
        is not yet: its first mask comes after its prompt's forward); None once it is stuck."""
        if guided.stuck:
            return None
        if guided.matcher is None:
            try:
                guided.matcher = xgr.GrammarMatcher(guided.grammar.compiled.result())
            except Exception:  # (one xgrammar read and could not compile: the request may only stop)
                logger.exception("a guided request's grammar could not be compiled: it may only stop")
                guided.stuck = True
                return None
        return guided.matcher

    def _compile(self, grammar: xgr.Grammar, reads_special: bool) -> xgr.CompiledGrammar:
        return self._compiler(reads_special).compile_grammar(grammar)

    def _compiler(self, reads_special: bool) -> xgr.GrammarCompiler:
        compiler = self._compilers.get(reads_special)
        if compiler is None:
            info = self._tokenizer_info(reads_special)
            compiler = self._compilers[reads_special] = xgr.GrammarCompiler(  # (this module keeps them)
                info, max_threads=COMPILE_THREADS, cache_enabled=False)
        return compiler

    def _tokenizer_info(self, reads_special: bool) -> xgr.TokenizerInfo:
        """The vocabulary as xgrammar reads it; special tokens (but the stop tokens) as tokens
        no grammar takes, unless `reads_special`: then by their text."""
        if reads_special:
            return xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_ids)
        special = {i for i, t in self.tokenizer.added_tokens_decoder.items() if t.special} - set(self.stop_ids)
        texts = [b"" if i in special else text for i, text in enumerate(self._texts())]  # (empty: never taken)
        return xgr.TokenizerInfo(texts, xgr.VocabType.RAW, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids)

    def _texts(self) -> list[bytes]:
        """Each token's bytes, a special token's its text (what a marker is spelled with)."""
        if self._token_texts is None:
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
            self._token_texts = [bytes(text) for text in info.decoded_vocab]
            self._token_texts += [b""] * (self.vocab_size - len(self._token_texts))
        return self._token_texts

    def _stop_mask(self) -> torch.Tensor:
        if self._stop_bits is None:
            bits = xgr.allocate_token_bitmask(1, self.vocab_size)
            bits.zero_()
            for token_id in self.stop_ids:
                if token_id < self.vocab_size:
                    bits[0, token_id // 32] |= _bit(token_id % 32)
            self._stop_bits = bits[0]
        return self._stop_bits


def _read(guided_decoding: dict[str, Any]) -> xgr.Grammar:
    """The guide read into xgrammar's grammar (not yet compiled against a vocabulary)."""
    whitespace = not guided_decoding.get("disable_any_whitespace")
    if guided_decoding.get("json_object"):
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=whitespace, strict_mode=False,
                                            max_whitespace_cnt=MAX_WHITESPACE_RUN)
    if "json_schema" in guided_decoding:
        schema = json.dumps(for_xgrammar(guided_decoding["json_schema"]))
        return xgr.Grammar.from_json_schema(schema, any_whitespace=whitespace, max_whitespace_cnt=MAX_WHITESPACE_RUN)
    if "regex" in guided_decoding:
        return xgr.Grammar.from_regex(guided_decoding["regex"])
    if "grammar" in guided_decoding:
        grammar = guided_decoding["grammar"]
        # a grammar without "::=" is Lark's, as vLLM tells them apart
        return xgr.Grammar.from_ebnf(grammar) if "::=" in grammar else xgr.Grammar.from_lark(grammar)
    if "structural_tag" in guided_decoding:
        return xgr.Grammar.from_structural_tag(structural_tag_json(guided_decoding["structural_tag"]))
    # the output is exactly one of the choices
    choices = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in guided_decoding["choice"])
    return xgr.Grammar.from_ebnf(f"root ::= {choices}")


def structural_tag_json(spec: Any) -> str:
    """A structural tag in xgrammar's form: vLLM's `{"structures", "triggers"}` as the
    triggered tags it means (each structure a tag whose content is a JSON value of its schema),
    xgrammar's own `{"format": ...}` as given."""
    spec = read_structural_tag(spec)
    if "format" in spec:
        return json.dumps({"type": "structural_tag", "format": spec["format"]})
    tags = [{"type": "tag", "begin": s["begin"], "end": s["end"], "content": {
        "type": "json_schema", "json_schema": for_xgrammar(s["schema"]), "max_whitespace_cnt": MAX_WHITESPACE_RUN}}
        for s in spec["structures"]]
    return json.dumps({"type": "structural_tag",
                       "format": {"type": "triggered_tags", "triggers": spec["triggers"], "tags": tags}})


def _accept_while(matcher: xgr.GrammarMatcher, token_ids: Sequence[int]) -> int:
    """How many of `token_ids` the matcher takes, in order, up to the first it refuses."""
    taken = 0
    for token_id in token_ids:
        if matcher.is_terminated() or not matcher.accept_token(token_id):
            break
        taken += 1
    return taken


def _past(guided: GuidedState, text: bytes) -> bytes:
    """While waiting for `guided.after`: the text past it once it has come (the grammar
    starts there), else b"" and the tail that may begin it is kept."""
    assert guided.after is not None
    seen = guided.seen + text
    at = seen.find(guided.after)
    if at < 0:
        keep = len(guided.after) - 1
        guided.seen = seen[-keep:] if keep else b""
        return b""
    rest = seen[at + len(guided.after):]
    guided.after, guided.seen = None, b""
    return rest


def _bit(i: int) -> int:
    """Bit i of an int32 word, as the signed value torch stores (bit 31 is the sign)."""
    return (1 << i) - (1 << 32 if i == 31 else 0)


# "[02:10:57] /project/cpp/x.cc:94: ", and "Check failed: (...) is false: " after it
_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def _xgrammar_message(exc: Exception) -> str:
    """xgrammar's error without the place in its C++ sources it came from, on one line."""
    text = str(exc).strip()
    text = _XGRAMMAR_PREFIX.sub("", text)
    return " ".join(text.split()) or type(exc).__name__
