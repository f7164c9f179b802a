"""Grammar libraries for structured output, side by side on the engines' real tokenizers (CPU):
xgrammar against llguidance, the two that vLLM / SGLang / TensorRT-LLM use.

    python -m benchmarks.speed.bench_grammar --engine engines/smollm2-135m --engine engines/qwen2.5-coder-0.5b \
        [--repeats 5] [--out grammar.json]

Per library and tokenizer:
- tokenizer setup: once per engine (the library's view of the vocabulary);
- compile: a new grammar from nothing (no cache) for JSON mode, a JSON schema, a regex and a
  choice list, median of --repeats (each with a fresh compiler so nothing is reused);
- mask: the per-token work of a request, fill one bitmask row then accept the token, walked
  along a valid answer's tokens (the same answer for both libraries); median and p99 over all
  tokens of --repeats walks, the first token's mask on its own (lazy work lands there).
What the per-token figure buys: a mask costs this much host time per step per grammar request,
overlapped with nothing (runtime/structured_output.py fills it before sampling).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "email", "tags", "address", "role"],
    "additionalProperties": False,
}
ANSWERS = {
    # compact separators (", " and ": "): what runtime/structured_output.py compiles JSON to
    "json_object": json.dumps({"title": "Genesis", "verses": [1, 2, 3], "ok": True, "note": None}),
    "json_schema": json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
                               "tags": ["math", "engines"], "address": {"city": "London", "zip": "W1"},
                               "role": "admin"}),
    "regex": "2026-12-04 23:59",
    "choice": "definitely not",
}
REGEX = r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}"
CHOICES = ["yes", "no", "maybe", "definitely not"]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Xgr:
    """xgrammar as runtime/structured_output.py runs it (GrammarRuntime: compact JSON, its cache
    cleared before each compile)."""

    name = "xgrammar"

    def __init__(self, tok, vocab_size: int):
        from infhip.runtime.structured_output import GrammarRuntime
        self.rt = GrammarRuntime(tok, vocab_size, (tok.eos_token_id,))

    def compile(self, kind: str):
        from infhip.runtime.structured_output import StructuredOutputsParams as S
        spec = {"json_object": S(json_object=True), "json_schema": S(json=SCHEMA), "regex": S(regex=REGEX),
                "choice": S(choice=CHOICES)}[kind]
        self.rt._cache.clear()
        return self.rt.compile(spec)

    def walk(self, grammar, tokens: list[int]) -> list[float]:
        import xgrammar as xgr
        m = xgr.GrammarMatcher(grammar)
        mask = xgr.allocate_token_bitmask(1, self.rt.vocab_size)
        times = []
        for t in tokens:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(mask, 0)
            ok = m.accept_token(t)
            times.append(time.perf_counter() - t0)
            assert ok, f"xgrammar refused token {t}"
        return times


class Llg:
    name = "llguidance"

    def __init__(self, tok, vocab_size: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.llg, self.vocab_size = llguidance, vocab_size
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab_size)

    def compile(self, kind: str):
        M = self.llg.LLMatcher
        if kind == "json_object":
            g = M.grammar_from_json_schema({"type": "object"})
        elif kind == "json_schema":
            g = M.grammar_from_json_schema(SCHEMA)
        elif kind == "regex":
            g = M.grammar_from_regex(REGEX)
        else:
            g = M.grammar_from_regex("(" + "|".join(CHOICES) + ")")
        # llguidance compiles lazily: building the matcher is the whole up-front cost.
        m = M(self.tok, g)
        assert not m.is_error(), m.get_error()
        return g

    def walk(self, grammar, tokens: list[int]) -> list[float]:
        m = self.llg.LLMatcher(self.tok, grammar)
        mask = self.llg.torch.allocate_token_bitmask(1, self.vocab_size)
        times = []
        for t in tokens:
            t0 = time.perf_counter()
            self.llg.torch.fill_next_token_bitmask(m, mask, 0)
            ok = m.consume_token(t)
            times.append(time.perf_counter() - t0)
            assert ok and not m.is_error(), f"llguidance refused token {t}: {m.get_error()}"
        return times


def bench(engine: Path, repeats: int) -> list[dict]:
    from transformers import AutoTokenizer

    from infhip.config import EngineConfig
    tok = AutoTokenizer.from_pretrained(str(engine / "tokenizer"))
    vocab = EngineConfig.load(engine).model.vocab_size
    rows = []
    for cls in (Xgr, Llg):
        t0 = time.perf_counter()
        lib = cls(tok, vocab)
        setup = time.perf_counter() - t0
        for kind, answer in ANSWERS.items():
            tokens = tok(answer, add_special_tokens=False)["input_ids"]
            compile_s, grammar = [], None
            for _ in range(repeats):
                t0 = time.perf_counter()
                grammar = lib.compile(kind)
                compile_s.append(time.perf_counter() - t0)
            walks = [lib.walk(grammar, tokens) for _ in range(repeats)]
            per_token = [x for w in walks for x in w]
            rows.append({"engine": engine.name, "vocab": vocab, "library": lib.name, "setup_ms": setup * 1e3,
                         "grammar": kind, "compile_ms": statistics.median(compile_s) * 1e3,
                         "tokens": len(tokens), "first_mask_ms": statistics.median(w[0] for w in walks) * 1e3,
                         "mask_median_us": statistics.median(per_token) * 1e6,
                         "mask_p99_us": _pct(per_token, 0.99) * 1e6})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=Path, action="append", required=True, help="an engine directory (repeat)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import importlib.metadata as md
    versions = {p: md.version(p) for p in ("xgrammar", "llguidance", "transformers")}
    rows = [r for e in args.engine for r in bench(e, args.repeats)]
    print(f"versions: {versions}")
    print(f"{'engine':<22} {'library':<11} {'setup ms':>8} {'grammar':<12} {'compile ms':>10} {'tokens':>6} "
          f"{'1st mask ms':>11} {'mask us p50':>11} {'p99':>8}")
    for r in rows:
        print(f"{r['engine']:<22} {r['library']:<11} {r['setup_ms']:>8.0f} {r['grammar']:<12} {r['compile_ms']:>10.1f} "
              f"{r['tokens']:>6} {r['first_mask_ms']:>11.2f} {r['mask_median_us']:>11.0f} {r['mask_p99_us']:>8.0f}")
    if args.out:
        args.out.write_text(json.dumps({"versions": versions, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
