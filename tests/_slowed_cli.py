"""Run an infhip CLI with every `EngineCore.step` slowed, so a test can signal a real process while its
requests are still generating (tests/test_server_drain.py):

    python tests/_slowed_cli.py 0.05 infhip.runtime.server --engine DIR --port 0 ...

argv: the delay in seconds per step, the CLI's module (it has ``main(argv) -> int``), its arguments.
"""

from __future__ import annotations

import importlib
import sys
import time

from infhip.runtime.engine_core import EngineCore


def main() -> int:
    delay_s, module, argv = float(sys.argv[1]), sys.argv[2], sys.argv[3:]
    step = EngineCore.step
    EngineCore.step = lambda self: time.sleep(delay_s) or step(self)
    return importlib.import_module(module).main(argv)


if __name__ == "__main__":
    sys.exit(main())
