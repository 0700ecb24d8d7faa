"""Running tests/parallel/engine_script.py: a parallel engine in a fresh interpreter per scenario (the test
process itself never joins a process group), several scenarios at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "engine_script.py")


def run_scripts(*runs: tuple[str, str, dict], timeout: float = 240.0) -> list[dict]:
    """Run engine_script.py for each (mode, checkpoint, settings) at the same time (they mostly wait on each
    other's ranks and on timeouts); their results in order."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen([sys.executable, SCRIPT, mode, path, json.dumps(settings)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for mode, path, settings in runs]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            assert lines, f"no result (exit {p.returncode}):\n{out[-3000:]}\n{err[-6000:]}"
            results.append(json.loads(lines[-1][len("RESULT "):]))
    finally:
        for p in procs:
            p.kill()
    return results


def run_script(mode: str, path: str, settings: dict) -> dict:
    return run_scripts((mode, path, settings))[0]
