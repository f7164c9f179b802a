"""What an `EngineCore` (runtime/engine_core.py) tells of itself outside its steps: `info()`,
read once by the frontends at load (EngineLoop.info), and `debug_view()`, a JSON-able copy of
what it holds for tests and debugging (the core's docstring of it says what it shows). Neither
runs per request."""

from __future__ import annotations

import dataclasses

from infhip.runtime.attention import backends
from infhip.runtime.outputs import EngineInfo


def core_info(core) -> EngineInfo:
    """EngineCore ``core``'s EngineInfo: its limits, KV capacity, and the request counters of the
    attention backends and step transforms it loaded with (those /metrics adds)."""
    kv, config = core.runner.kv, core.engine.config
    counters = [rc for cls in backends() if cls.knobs_of(config) is not None for rc in cls.request_counters(config)]
    counters += [rc for t in core.runner.transforms.values() if type(t).knobs_of(config) is not None
                 for rc in t.request_counters()]
    return EngineInfo(vocab_size=config.model.vocab_size, max_seq_len=core.scheduler.max_seq_len,
                      max_num_seqs=core.max_num_seqs, kv_capacity_tokens=kv_capacity_tokens(kv),
                      kv_pages_total={g: spec.num_pages - 1 for g, spec in kv.groups.items()},
                      host_pages_total={g: spec.offload.host_pages for g, spec in kv.groups.items()
                                        if spec.offload is not None},
                      request_counters=tuple(counters))


def kv_capacity_tokens(kv) -> int:
    """Tokens a KVCacheManager holds: the smallest full-attention group's pages x page size (a
    sliding-window group's pages are reused along the sequence, so they do not bound it)."""
    full = [spec.num_pages - 1 for spec in kv.groups.values() if spec.window is None]
    pages = min(full) if full else min(spec.num_pages - 1 for spec in kv.groups.values())
    return pages * kv.page_size



def core_view(core) -> dict:
    """EngineCore ``core``'s debug view."""
    kv, runner = core.runner.kv, core.runner

    def seq_view(seq) -> dict:
        return {"seq_id": seq.seq_id, "status": seq.status.value, "prompt_tokens": seq.num_prompt_tokens,
                "computed_tokens": seq.num_computed_tokens, "cached_tokens": seq.num_cached_tokens or 0,
                "output_tokens": len(seq.output_token_ids), "finish_reason": seq.finish_reason,
                "kv_pages": {g: kv.num_pages_held(seq.seq_id, g) for g in kv.groups}}

    graphs = None
    if runner.graphs is not None:
        graphs = {"captured": [{"batch_size": bs, "backends": {n: _jsonable(k) for n, k in key.backends},
                                "kv_shift": key.kv_shift, "len_bucket": key.len_bucket}
                               for bs, key in runner.graphs.graphs],
                  "report": dict(runner.graphs.report)}
    return {"requests": {rid: {"finished": r.is_finished, "error": r.error,
                               "completions": [seq_view(f.seq) for f in r.forks]}
                         for rid, r in core._requests.items()},
            "running": [seq.seq_id for seq in core.scheduler.running],
            "waiting": [seq.seq_id for seq in core.scheduler.waiting],
            "stats": dataclasses.asdict(core.stats()),
            "transforms": {name: t.debug_view() for name, t in runner.transforms.items()},
            "backends": {name: b.debug_view() for name, b in runner.backends.items()},
            "graphs": graphs, "grammar_compiler": core._grammars is not None,
            "tp_worker_pids": [p.pid for p in core._tp.procs] if core._tp is not None else []}


def _jsonable(value):
    """A graph key part as JSON can hold it: dataclasses as dicts, tuples as lists, other objects
    by repr."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if dataclasses.is_dataclass(value):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    return repr(value)
