"""SmolLM2-135M-Instruct, the real-model recipe's model, as ``scripts/test.sh`` imports it before the tests run
(``grpo import-model --config configs/smollm2-cpu.yaml``, into the user's cache). The tests never fetch it: where it
has not been imported, they skip and say how to import it."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config import load_config
from common.model.importing import cached_path
from tests.conftest import REPO

RECIPE = REPO / "configs" / "smollm2-cpu.yaml"
# Read before the session's isolated cache replaces GRPO_CACHE_DIR: the import lives in the user's cache.
IMPORTED = cached_path(load_config(str(RECIPE), []).model.path)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    if not (IMPORTED / "config.json").is_file():
        pytest.skip(f"SmolLM2 is not imported at {IMPORTED}: run grpo import-model --config {RECIPE} (test.sh does)")
    return IMPORTED
