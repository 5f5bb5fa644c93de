"""The parity tests hold on the oldest transformers the test extra admits (``transformers>=5.23``), not only on the
installed one: transformers 5.23.0 is installed into a cached folder (no dependencies) and the HF parity tests run
against it in a subprocess. (5.24 renamed the forward's cache keyword; the tests look it up from the signature.)"""

import os
import subprocess
import sys
from pathlib import Path

from testutil import release

OLDEST = "5.23.0"
ROOT = Path(__file__).resolve().parents[2]


def test_hf_parity_on_the_oldest_admitted_transformers():
    env = dict(os.environ, PYTHONPATH=str(release("transformers", OLDEST)))
    seen = subprocess.run([sys.executable, "-c", "import transformers; print(transformers.__version__)"],
                          capture_output=True, text=True, env=env, check=True).stdout.strip()
    assert seen == OLDEST
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                        str(ROOT / "tests/models/test_hf_parity.py")], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout
