"""The GPU calls: run.sh <suite> (suites/), the smoke call (smoke.py) and staging (stage/)."""
