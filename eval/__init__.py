"""Quality harness on real models and real text (`infhip-eval`).

Tasks (each `run_*` takes engine directories and a config dataclass, returns an `EvalResult`
with `.records`, `.summary()`, `.markdown()`, `.save(json_path)`; `plot_result` draws it):

    passkey  run_passkey(engines, PasskeyConfig(lengths, depths, samples, seed, haystack))
    niah     run_niah(engines, NiahConfig(lengths, variants, depths, samples, seed, haystack))
    ppl      run_ppl(engines, PplConfig(lengths, chunk, samples, seed))
    agree    run_agree(engines, reference, AgreeConfig(lengths, chunk, samples, seed))
    recall   run_recall(engines, RecallConfig(lengths, chunk, samples, seed))
    ruler    run_ruler(engines, RulerConfig(lengths, tasks, samples, seed, template))

    >>> from infhip.eval import PasskeyConfig, run_passkey, plot_result          # doctest: +SKIP
    >>> res = run_passkey(["engines/smollm2-135m"], PasskeyConfig(lengths=[1024, 2048], samples=5))  # doctest: +SKIP
    >>> print(res.markdown()); res.save("passkey.json"); plot_result(res, "passkey.png")  # doctest: +SKIP

Modules: text (KJV, PG essays), ruler (RULER's 13 tasks), prompts (exact-length assembly), forcing (teacher forcing), results, plot,
stage (engine parts for the GPU machine), cli; token_drop_reference (the plain-torch token-drop
reference the tests and the token-drop probes of benchmarks/quality/ compare the engine with).
"""

from infhip.eval.agree import AgreeConfig, run_agree
from infhip.eval.common import EvalError
from infhip.eval.niah import NiahConfig, run_niah
from infhip.eval.passkey import PasskeyConfig, run_passkey
from infhip.eval.plot import plot_result
from infhip.eval.ppl import PplConfig, run_ppl
from infhip.eval.recall import NoSparseLayers, RecallConfig, run_recall
from infhip.eval.results import EvalResult, Record
from infhip.eval.ruler import RulerConfig, RulerResult, run_ruler

__all__ = ["AgreeConfig", "run_agree", "EvalError", "NiahConfig", "run_niah", "PasskeyConfig", "run_passkey",
           "plot_result", "PplConfig", "run_ppl", "NoSparseLayers", "RecallConfig", "run_recall",
           "EvalResult", "Record", "RulerConfig", "RulerResult", "run_ruler"]
