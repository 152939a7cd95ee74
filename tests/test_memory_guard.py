"""A pipeline folder whose target lacks ``config.json`` fails fast, with a clear error, in little memory.

Before ``check_pipeline_folder``, transformers built a default-size LLaVA (7B parameters) for such a
folder; the issue saw memory pass 20 GB before the process was killed. Here ``from_pretrained``
runs in a child process whose address space is capped at what it holds after its imports plus
3 GiB (``RLIMIT_AS``), so a regression cannot take the machine down. The child must raise our
``FileNotFoundError`` naming the missing file, with its peak RSS (``getrusage``) grown by less than
200 MiB over the imports. The same child then loads the intact folder under the same cap: the cap
is not what refuses the broken folder. (One child for both: its imports take most of the time.)

Measured with the check disabled (transformers 5.23, same cap): the child builds the default model
on the meta device and fails with transformers' ``RuntimeError`` about mismatched sizes, naming
neither the file nor the component; this test fails on that.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "vlm"
HEADROOM = 3 << 30  # bytes of address space above what the child holds after its imports
MAX_GROWTH_MB = 200

CHILD = r"""
import json, resource, sys
from mmspec.pipelines import SpeculativeVLMPipeline
import transformers, diffusers  # noqa: F401  (imported before the cap is measured)

def vm_size():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024

cap = vm_size() + int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
for folder in sys.argv[2:]:
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {"folder": folder, "error": None, "message": None}
    try:
        SpeculativeVLMPipeline.from_pretrained(folder)
    except BaseException as err:
        result.update(error=type(err).__name__, message=str(err))
    result["growth_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - rss_before
    print("RESULT " + json.dumps(result), flush=True)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmSize from /proc")
def test_missing_target_config_fails_fast_in_little_memory(tmp_path):
    broken = tmp_path / "vlm"
    shutil.copytree(ASSETS, broken)
    (broken / "target" / "config.json").unlink()
    proc = subprocess.run([sys.executable, "-c", CHILD, str(HEADROOM), str(broken), str(ASSETS)], capture_output=True,
                          text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    results = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(results) == 2, f"the child died (exit {proc.returncode}): {proc.stderr[-2000:]}"
    refused, intact = results
    assert refused["error"] == "FileNotFoundError", refused
    assert refused["message"] == f"target: missing {broken / 'target' / 'config.json'} (the component's config)"
    assert refused["growth_mb"] < MAX_GROWTH_MB, refused
    assert intact["error"] is None, intact  # the cap is not what refused the broken folder
