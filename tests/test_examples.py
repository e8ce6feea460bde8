"""Every script in examples/ runs, at a tiny size, as a user would run it (a subprocess).

An example registers here with the arguments that make it tiny; an example that is not
registered fails `test_every_example_is_registered`, so none can rot unrun.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

# file name -> (arguments for the CI size, packages it needs)
CI_RUNS = {
    # aot_eager traces the quantized model through dynamo and AOTAutograd (fullgraph) in
    # ~15 s; inductor's C++ codegen of the same graph took 69 s on two cores.
    "hf_causal_lm.py": (["--tiny", "--compile-backend", "aot_eager", "--new-tokens", "4"],
                        ["transformers"]),
    # 2 gloo ranks, 8 AdamW steps of the tiny model: ~11 s on two shared cores, mostly the
    # two spawned processes importing torch and torchao.
    "fsdp2_training.py": (["--nproc", "2", "--size", "tiny", "--steps", "8"], []),
}


def test_every_example_is_registered():
    found = {p.name for p in EXAMPLES.glob("*.py")}
    missing = found - set(CI_RUNS)
    assert not missing, f"add {sorted(missing)} to CI_RUNS in tests/test_examples.py"


@pytest.mark.parametrize("name", sorted(CI_RUNS))
def test_example_runs(name):
    args, packages = CI_RUNS[name]
    for package in packages:
        pytest.importorskip(package)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                      os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=ROOT, env=env,
                          text=True, capture_output=True, timeout=600)
    assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr[-4000:]}"
    assert ": NO" not in done.stdout, done.stdout
