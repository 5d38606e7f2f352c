import os
import shutil
import sys

import pytest
import torch

torch.set_num_threads(1)  # tiny models: threads only add overhead, and CI machines are often shared

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SHARED_SHAKESPEARE = os.path.join(ROOT, "..", "shared", "data", "tinyshakespeare", "input.txt")
os.environ.setdefault("TIKTOKEN_CACHE_DIR", os.path.join(ROOT, "..", "shared", "data", "tiktoken_cache"))


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """A data/ folder with Tiny Shakespeare already in place (the offline path: no network)."""
    d = tmp_path_factory.mktemp("data")
    src = next((p for p in (os.path.join(ROOT, "data", "shakespeare", "input.txt"), SHARED_SHAKESPEARE)
                if os.path.exists(p)), None)
    if src is None:
        pytest.skip("Tiny Shakespeare not available offline")
    os.makedirs(d / "shakespeare")
    shutil.copy(src, d / "shakespeare" / "input.txt")
    return str(d)
