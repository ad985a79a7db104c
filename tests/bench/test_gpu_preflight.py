"""The GPU check's preflight (``bench/gpu_preflight.py``) imports every pagedserve module and the
packages the check needs: here, with the project's dependencies installed, only the CUDA device is
missing (a module that fails to import, or a dependency the check does not carry, shows here)."""

from __future__ import annotations

import json

import torch

from pagedserve.bench import gpu_preflight


def test_only_the_device_is_missing_here(capsys):
    rc = gpu_preflight.main()
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    expected = set() if torch.cuda.is_available() else {"cuda device"}
    assert set(report["missing"]) == expected, report["missing"]
    assert rc == (1 if expected else 0) and report["torch"] == torch.__version__
