"""Structured outputs in the runner: compiled grammars (cached) and per-request matchers (xgrammar).

Why xgrammar: its JSON-schema converter and token-mask cache are made for serving (vLLM's and
SGLang's default backend), a compiled grammar is a reusable object keyed by its schema, and the
per-step mask costs microseconds per request on CPU; llguidance would do as well, but it has no
compact-separator switch for JSON schemas and would add a Lark front end we do not need.

`GrammarCache` compiles each distinct `StructuredOutputsParams.key` once (LRU bounded by
`max_entries` compiled grammars and by `max_bytes` of their memory; the compiler is built on first
use, so a runner whose requests never ask pays nothing). The engine compiles off the step
(`engine/grammar_gate.py`: `prepare` in its compile thread; `ready` says whether a matcher would
compile). Each request gets its own `GrammarMatcher` over the shared compiled grammar: its state
is the request's alone and dies with it; `RequestGrammar` drives it, behind a `<think>` gate when
the request's grammar binds only after the model's thinking (`StructuredOutputsParams.after_thinking`,
set by a server with a reasoning parser). With tensor parallelism every rank compiles and advances
the same matchers (every rank samples the same tokens).

Tokens whose text holds a raw control character (U+0000..U+001F) are masked for every JSON
request: compact JSON never contains one, and xgrammar 0.2.8 lets them into strings that have a
`maxLength` (JSON parsers then refuse the output). A regex, choice or grammar may ask for a newline
or a tab: its own grammar decides alone.
"""

from __future__ import annotations

from typing import Any

import threading
from collections import OrderedDict

import torch

from mmserve.worker.device import to_device

from mmserve.structured_outputs import SEPARATORS, StructuredOutputsParams, choice_ebnf

# `json_object`: any JSON object, compact and bounded so that it ends within an ordinary budget
# whatever the weights: at most 16 members per object or array, keys of 1-32 characters, strings of
# at most 128, integers of at most 16 digits with at most 6 decimals, nesting at most 3 deep
JSON_OBJECT_EBNF = r'''
root ::= "{" (member ("," member){0,15})? "}"
member ::= key ":" value
key ::= "\"" char{1,32} "\""
char ::= [^"\\\x00-\x1f] | "\\" ["\\/bfnrt]
string ::= "\"" char{0,128} "\""
number ::= "-"? ("0" | [1-9] [0-9]{0,15}) ("." [0-9]{1,6})?
scalar ::= string | number | "true" | "false" | "null"
value ::= scalar | object2 | array2
object2 ::= "{" (key ":" value2 ("," key ":" value2){0,15})? "}"
array2 ::= "[" (value2 ("," value2){0,15})? "]"
value2 ::= scalar | object3 | array3
object3 ::= "{" (key ":" scalar ("," key ":" scalar){0,15})? "}"
array3 ::= "[" (scalar ("," scalar){0,15})? "]"
'''


DEFAULT_CACHE_BYTES = 512 << 20


class GrammarCache:
    """Compiled grammars by key, least recently used dropped past `max_entries` or `max_bytes`."""

    def __init__(self, model_dir: str, vocab_size: int, max_entries: int = 256,
                 max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's vocabulary)
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.num_bytes = 0  # the cached grammars' memory
        self._compiler: Any = None
        self.control_tokens: torch.Tensor | None = None  # [C] int64, set with the compiler
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self.num_compiles = 0  # grammars compiled since start (tests)
        self._lock = threading.Lock()  # the engine's compile thread and the step share the cache

    def matcher(self, spec: StructuredOutputsParams, eos_token_id: int | None):
        """A fresh matcher for one request (compiling its grammar on the first sight of its key);
        the grammar ends on `eos_token_id` (the model's, the same for every request)."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self._get(spec, eos_token_id))

    def ready(self, spec: StructuredOutputsParams) -> bool:
        """Whether `spec`'s grammar is compiled (a matcher for it costs no compile)."""
        with self._lock:
            return spec.key in self._compiled

    def prepare(self, spec: StructuredOutputsParams, eos_token_id: int | None) -> None:
        """Compile `spec`'s grammar into the cache (the engine's compile thread calls this)."""
        self._get(spec, eos_token_id)

    def _get(self, spec: StructuredOutputsParams, eos_token_id: int | None) -> Any:
        with self._lock:
            compiled = self._compiled.get(spec.key)
            if compiled is not None:
                self._compiled.move_to_end(spec.key)
                return compiled
            compiler = self._get_compiler(eos_token_id)
        compiled = self._compile(compiler, spec)  # outside the lock: a step's matchers need not wait
        with self._lock:
            if spec.key not in self._compiled:
                self._compiled[spec.key] = compiled
                self.num_bytes += compiled.memory_size_bytes
            while len(self._compiled) > 1 and (len(self._compiled) > self.max_entries
                                               or self.num_bytes > self.max_bytes):
                _, dropped = self._compiled.popitem(last=False)
                self.num_bytes -= dropped.memory_size_bytes
        return compiled

    def _compile(self, compiler: Any, spec: StructuredOutputsParams) -> Any:
        self.num_compiles += 1
        if spec.json_object:
            return compiler.compile_grammar(JSON_OBJECT_EBNF)
        if spec.regex is not None:
            return compiler.compile_regex(spec.regex)
        if spec.choice is not None:
            return compiler.compile_grammar(choice_ebnf(spec.choice))
        if spec.grammar is not None:
            return compiler.compile_grammar(spec.grammar)
        return compiler.compile_json_schema(spec.json, any_whitespace=False, separators=SEPARATORS,
                                            strict_mode=True)

    def _get_compiler(self, eos_token_id: int | None):
        if self._compiler is None:
            import xgrammar as xgr
            from mmserve.models.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(self.model_dir)
            stop = [eos_token_id] if eos_token_id is not None else None
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size, stop_token_ids=stop)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            control = [i for i, text in enumerate(info.decoded_vocab) if any(b < 0x20 for b in text)]
            self.control_tokens = torch.tensor(control, dtype=torch.int64)
        return self._compiler


class RequestGrammar:
    """One request's grammar as the runner drives it: its xgrammar `matcher` accepts each output
    token and says what may come next. With `after_thinking` (the `<think>`, `</think>` ids) it
    binds the answer only: while the request thinks (`phase` "thinking": its prompt opened a block
    it has not closed, or its first token opened one) nothing is masked and the matcher waits; at
    "start" (the prompt closed or never opened a block) the first token may be `<think>` or the
    answer's first; the answer (`phase` "answer") is the grammar's."""

    def __init__(self, matcher: Any, after_thinking: tuple[int, int] | None = None,
                 prompt_ids: list[int] | None = None) -> None:
        self.matcher = matcher
        self.after_thinking = after_thinking
        self.phase = "answer"
        if after_thinking is not None:
            start, end = after_thinking
            prompt = prompt_ids or []
            opened = _last_index(prompt, start) > _last_index(prompt, end)
            self.phase = "thinking" if opened else "start"

    def binds(self) -> bool:
        """Whether the next token is masked (the grammar's turn, and it has not ended)."""
        return self.phase != "thinking" and not self.matcher.is_terminated()

    def accept(self, token: int) -> None:
        """Advance past the sampled `token`."""
        if self.after_thinking is not None and self.phase != "answer":
            start, end = self.after_thinking
            if self.phase == "thinking":
                self.phase = "answer" if token == end else "thinking"
                return
            if token == start:  # "start": the model opens its thinking
                self.phase = "thinking"
                return
            self.phase = "answer"
        if not self.matcher.is_terminated():
            self.matcher.accept_token(token)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of the int32 `bitmask`: the tokens allowed next (the grammar's, and at
        "start" `<think>` too)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.phase == "start" and self.after_thinking is not None:
            word, bit = divmod(self.after_thinking[0], 32)
            value = (int(bitmask[row, word]) | (1 << bit)) & 0xFFFFFFFF
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


def _last_index(ids: list[int], token: int) -> int:
    """The index of `token`'s last occurrence in `ids`, -1 if none (a search in C: prompts are long)."""
    try:
        return len(ids) - 1 - ids[::-1].index(token)
    except ValueError:
        return -1


def apply_grammar_masks(logits: torch.Tensor, rows: list[int], grammars: list[RequestGrammar],
                        control_tokens: torch.Tensor, json_rows: list[bool] | None = None) -> None:
    """Mask, in place, the tokens each grammar forbids next, and the `control_tokens` in the rows
    whose `json_rows[i]` is true (default: all). logits: [R, V] float32; `rows[i]` is the row of
    `grammars[i]`. Rows not named are untouched."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[-1])  # [G, ceil(V / 32)] int32
    for i, grammar in enumerate(grammars):
        grammar.fill(bitmask, i)
    index, bitmask, control_tokens = to_device((torch.tensor(rows, dtype=torch.int64), bitmask, control_tokens),
                                               logits.device)  # one pinned copy
    sub = logits[index]  # [G, V]
    xgr.apply_token_bitmask_inplace(sub, bitmask, vocab_size=logits.shape[-1])
    if json_rows is None or all(json_rows):
        sub[:, control_tokens] = float("-inf")
    elif any(json_rows):
        masked = torch.tensor([i for i, is_json in enumerate(json_rows) if is_json], device=sub.device)
        sub[masked[:, None], control_tokens[None, :]] = float("-inf")
    logits[index] = sub

