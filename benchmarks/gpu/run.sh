#!/usr/bin/env bash
# One runner for the GPU calls: `bash benchmarks/gpu/run.sh SUITE [ARGS...]` runs
# benchmarks/gpu/suites/SUITE.sh from the repository root with ARGS (each suite's header says
# which it takes, what to carry and what it writes under $OUT, default /tmp/infhip-out).
# No SUITE, -h or --help: the suites, one line each. The calls of a session, in order:
# docs/gpu_runbook.md.
set -o pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
usage() {
  echo "usage: bash benchmarks/gpu/run.sh SUITE [ARGS...]   (on the GPU machine, repo root; logs and JSON under \$OUT)"
  echo "suites:"
  for f in "$HERE"/suites/*.sh; do
    printf "  %-16s %s\n" "$(basename "$f" .sh)" "$(sed -n 's/^# suite: //p' "$f" | head -1)"
  done
}
case ${1:-} in
  ""|-h|--help|help) usage; exit 0 ;;
esac
SUITE=$1; shift
if [ ! -f "$HERE/suites/$SUITE.sh" ]; then
  echo "run.sh: unknown suite '$SUITE'" >&2; usage >&2; exit 2
fi
cd "$HERE/../.."  # the repository root: suites run `python3 -m benchmarks....` and `pip install -e .` from there
exec bash "$HERE/suites/$SUITE.sh" "$@"
