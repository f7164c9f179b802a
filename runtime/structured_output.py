"""Structured output: a request's text constrained by a grammar (a JSON schema, any JSON object,
a regex, a choice list, an EBNF grammar), applied as a token bitmask before sampling.

    >>> from infhip import LLM, SamplingParams, StructuredOutputsParams       # doctest: +SKIP
    >>> llm = LLM("engines/smollm2-135m")
    >>> schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    >>> p = SamplingParams(max_tokens=64, structured_outputs=StructuredOutputsParams(json=schema))
    >>> llm.generate(["The capital of France, as JSON: "], p)[0].text
    '{"city": "Paris"}'

The names are vLLM's (`StructuredOutputsParams(json=, regex=, choice=, grammar=, json_object=)`,
`SamplingParams(structured_outputs=...)`). The library is xgrammar, chosen by measurement over
llguidance on this engine's tokenizers (docs/serving.md, "Structured output";
benchmarks/speed/bench_grammar.py): its per-token mask is a few microseconds where llguidance's is
tens, with millisecond tails; its compile (milliseconds here) is cached per grammar.

How it runs (one `GrammarRuntime` per engine, made lazily: an engine that never sees a grammar
never builds the tokenizer's grammar view):
  - `EngineCore.add_request`: `runtime.matcher(params)` compiles the grammar (cached by its text) and makes the
    request's matcher; a grammar the library refuses is the request's ValueError (HTTP 400).
  - each step: `runtime.bitmask(matchers, device)` fills one int32 row [ceil(V / 32)] per batch row
    (all bits set for rows without a grammar), copies it to the device once, and the sampler
    masks the logits with it (`SamplingBatch.token_bitmask`, runtime/sampler.py). A step with
    no grammar row calls none of this.
  - after the step: `runtime.accept(matcher, token)` advances the matcher with the sampled token.
  - back-to-back decode steps (StepSampler.decode_steps, runtime/step_sampling.py) run for grammar rows too: each step's
    tokens go to the host in a small pinned copy right after their draw, and while the GPU
    runs the next step's forward (already queued), the host waits for that copy, advances the
    matchers (`runtime.advance`) and fills the next bitmask; the draw queues behind the
    forward. The grammar's host work hides under the forward instead of costing a whole
    scheduler step per token.
When the grammar is complete its matcher allows only the engine's EOS tokens, so the request
ends with finish_reason "stop".
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

MAX_CACHED_GRAMMARS = 256  # compiled grammars kept per engine (an LRU): ~kB to a few MB each


@dataclass
class StructuredOutputsParams:
    """What a request's output must match; give exactly one.

    json         a JSON schema (a dict, or its JSON text): the output is one JSON value valid
                 under it (compact separators; properties not listed are refused, as in
                 OpenAI's strict mode)
    json_object  True: any JSON object (OpenAI's response_format {"type": "json_object"})
    regex        the output matches this regular expression in full
    choice       the output is exactly one of these strings
    grammar      an EBNF grammar (xgrammar's / GBNF dialect) whose start rule is `root`
    structural_tag  an xgrammar structural tag ({"type": "structural_tag", "format": {...}}, a
                 dict or its JSON text): tagged JSON regions, e.g. forced tool calls
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict | str | None = None

    def __post_init__(self) -> None:
        def bad(field: str, need: str, got: object) -> ValueError:
            return ValueError(f"StructuredOutputsParams.{field} must be {need}, got {got!r:.200}")

        given = [k for k in ("json", "regex", "choice", "grammar", "structural_tag") if getattr(self, k) is not None]
        if not isinstance(self.json_object, bool):
            raise bad("json_object", "a bool", self.json_object)
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("StructuredOutputsParams takes exactly one of json, json_object, regex, choice, "
                             f"grammar, structural_tag; got {given or 'none'}")
        for name, need in (("json", "a JSON schema (a dict or its JSON text)"),
                           ("structural_tag", "a structural tag (a dict or its JSON text)")):
            v = getattr(self, name)
            if isinstance(v, str):
                try:
                    v = json.loads(v)
                except json.JSONDecodeError as e:
                    raise bad(name, need, f"text that is not JSON ({e})") from None
                setattr(self, name, v)
            if v is not None and not isinstance(v, (dict, bool) if name == "json" else dict):
                raise bad(name, need, v)
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise bad(name, "a non-empty string", v)
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or \
                    not all(isinstance(c, str) and c for c in self.choice):
                raise bad("choice", "a non-empty list of non-empty strings", self.choice)
            self.choice = list(self.choice)

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what the compile cache is keyed by."""
        if self.json is not None:
            return "json", json.dumps(self.json, sort_keys=True)
        if self.json_object:
            return "json_object", ""
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        if self.structural_tag is not None:
            return "structural_tag", json.dumps(self.structural_tag, sort_keys=True)
        return ("regex", self.regex) if self.regex is not None else ("grammar", self.grammar)


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of ``choices`` (metacharacters escaped)."""
    import re
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


def _bounded_strings_as_patterns(schema):
    """schema with each plain string's minLength / maxLength turned into the equal `pattern` of
    unescaped characters: xgrammar 0.2.9 compiles a length-bounded string to a rule that admits
    raw control characters (invalid JSON; seen at temperature 1) and no escapes, its `pattern`
    rule is right. A string with a pattern, format, enum or const is left as it is."""
    if isinstance(schema, list):
        return [_bounded_strings_as_patterns(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _bounded_strings_as_patterns(v) for k, v in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and not {"pattern", "format", "enum", "const"} & out.keys():
        lo, hi = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f'^[^"\\\\\\x00-\\x1f]{{{lo},{hi}}}$'
    return out


class GrammarRuntime:
    """One engine's grammar compiler (its tokenizer, its vocabulary: logits rows may be wider
    than the tokenizer, the extra ids are never allowed), compile cache and bitmask buffer."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        if tokenizer is None:
            raise ValueError("structured output needs the engine's tokenizer; this engine has none "
                             "(built with --random-weights from a config)")
        import xgrammar as xgr
        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(eos_token_ids))
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # our cache below: bounded
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()  # guards _cache only (compiles run outside it)
        self._host: torch.Tensor | None = None  # [max rows, ceil(V / 32)] int32, pinned on CUDA hosts
        # Sequence -> [matcher, output tokens consumed]; weak: a finished, dropped sequence's goes too.
        self._live: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar of spec (cached); ValueError with the library's reason. Thread
        safe: the server compiles on its tokenizer thread ahead of the engine thread's add_request (two
        threads compiling one new grammar at once both compile it; one result is kept)."""
        key = spec.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        c = self._compiler
        try:
            if spec.json is not None:
                g = c.compile_json_schema(json.dumps(_bounded_strings_as_patterns(spec.json)), any_whitespace=False)
            elif spec.json_object:
                g = c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            elif spec.choice is not None:
                g = c.compile_regex(choice_regex(spec.choice))
            elif spec.regex is not None:
                g = c.compile_regex(spec.regex)
            elif spec.structural_tag is not None:
                g = c.compile_structural_tag(json.dumps(self._compact_json_regions(spec.structural_tag)))
            else:
                g = c.compile_grammar(spec.grammar)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / its own types for bad input
            raise ValueError(f"structured output: the {key[0]} grammar does not compile: "
                             f"{type(e).__name__}: {str(e).strip()[:500]}") from None
        with self._lock:
            g = self._cache.setdefault(key, g)
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return g

    def _compact_json_regions(self, node):
        """A structural tag whose JSON-schema regions are EBNF grammars of compact JSON (as `json`
        compiles: the tag's own json_schema format lets whitespace run between tokens) with the
        length-bounded-string fix."""
        if isinstance(node, list):
            return [self._compact_json_regions(x) for x in node]
        if not isinstance(node, dict):
            return node
        if node.get("type") == "json_schema" and "json_schema" in node:
            schema = json.dumps(_bounded_strings_as_patterns(node["json_schema"]))
            return {"type": "grammar", "grammar": str(self._xgr.Grammar.from_json_schema(schema, any_whitespace=False))}
        return {k: self._compact_json_regions(v) for k, v in node.items()}

    def matcher(self, spec: StructuredOutputsParams):
        """A fresh matcher of spec's grammar for one request."""
        return self._xgr.GrammarMatcher(self.compile(spec))

    def apply(self, batch, seqs: list) -> None:
        """Constrain a SamplingBatch (runtime/sampler.py) whose rows are ``seqs`` (Sequences):
        each sequence with ``params.structured_outputs`` has its matcher caught up with the tokens
        it took since the last step (made on its first step: a fork, a preempted and recomputed
        request keep theirs), and its bitmask row filled; ``batch.host_each_step`` is set (the
        next mask needs the host). A batch without such a sequence is left as it is."""
        rows = [self._state(s) if s.params.structured_outputs is not None else None for s in seqs]
        if all(r is None for r in rows):
            return
        for seq, r in zip(seqs, rows):
            if r is not None:
                new = seq.output_token_ids[r[1]:]
                for t in new:
                    self.accept(r[0], t)
                r[1] += len(new)
        batch.token_bitmask = self.bitmask([r[0] if r else None for r in rows], batch.device)
        batch.host_each_step = True

    def advance(self, batch, seqs: list, tokens: list[int]) -> None:
        """Between back-to-back decode steps (StepSampler.decode_steps, runtime/step_sampling.py): advance each grammar
        row's matcher with the token it just drew (``tokens``: the batch's, on the host), counted
        as consumed (the engine commits exactly these, or finishes the sequence), and refill the
        batch's bitmask for the next draw. A batch `apply` left unconstrained is left as is."""
        if batch.token_bitmask is None:
            return
        rows = [self._live.get(s) if s.params.structured_outputs is not None else None for s in seqs]
        for r, t in zip(rows, tokens):
            if r is not None:
                self.accept(r[0], t)
                r[1] += 1
        batch.token_bitmask = self.bitmask([r[0] if r else None for r in rows], batch.device)

    def _state(self, seq) -> list:
        """[matcher, tokens it has consumed] of seq, made on first use; forgotten with seq."""
        state = self._live.get(seq)
        if state is None:
            state = self._live[seq] = [self.matcher(seq.params.structured_outputs), 0]
        return state

    def bitmask(self, matchers: list, device: torch.device) -> torch.Tensor:
        """[B, ceil(V / 32)] int32 on device: row i from matchers[i], every token allowed where
        matchers[i] is None (or already terminated: its request is finishing)."""
        b, words = len(matchers), (self.vocab_size + 31) // 32
        if self._host is None or self._host.shape[0] < b:
            self._host = torch.empty(max(b, 16), words, dtype=torch.int32,
                                     pin_memory=torch.device(device).type == "cuda")
        host = self._host[:b]
        host.fill_(-1)
        for i, m in enumerate(matchers):
            if m is not None and not m.is_terminated():
                m.fill_next_token_bitmask(host, i)
        return host.to(device, non_blocking=True)

    @staticmethod
    def accept(matcher, token: int) -> None:
        """Advance matcher with the sampled token; RuntimeError if the grammar refuses it (the
        bitmask allowed only tokens it accepts, so this is a bug, and fails the request)."""
        if matcher.is_terminated():
            return
        if not matcher.accept_token(int(token)):
            raise RuntimeError(f"the grammar refused token {token} that its own bitmask allowed")
