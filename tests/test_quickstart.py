"""The quickstart example: train, corrupt the newest checkpoint, resume from the previous
one, and get the very same losses as the uninterrupted run."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import REPO
from tests.test_verify import _flip_byte


def _train(*args) -> dict[int, str]:
    out = subprocess.run([sys.executable, str(REPO / "examples" / "quickstart.py"), *map(str, args)],
                         check=True, capture_output=True, text=True).stdout
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^step +(\d+) +loss (\S+)$", out, re.M)}


def test_resume_after_corruption_continues_exactly(tmp_path):
    first = _train("--root", tmp_path / "a", "--steps", 12, "--save-every", 4)
    _flip_byte(tmp_path / "a" / "step_000012")
    resumed = _train("--root", tmp_path / "b", "--steps", 12, "--save-every", 100,
                     "--resume-from", tmp_path / "a")
    assert sorted(resumed) == list(range(9, 13))  # resumed from step 8, not the corrupt 12
    assert all(resumed[s] == first[s] for s in resumed)
