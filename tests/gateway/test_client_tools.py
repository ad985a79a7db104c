"""guidellm and aiperf, unchanged, against a live gateway: zero request errors. Their environments
are large (and their pins clash with ours), so this runs where ``PAGEDSERVE_CLIENT_TOOLS`` names a
folder that ``python -m bench.client_tools --install --tools-dir DIR`` filled; docs/gateway.md has
the figures of the last run."""

from __future__ import annotations

import os

import pytest

from pagedserve.bench.client_tools import main
from tests.service_helpers import MODEL_NAME

TOOLS = os.environ.get("PAGEDSERVE_CLIENT_TOOLS")


@pytest.mark.skipif(not TOOLS, reason="PAGEDSERVE_CLIENT_TOOLS is not set (see this module's docstring)")
def test_guidellm_and_aiperf_run_with_zero_errors(stack, tmp_path, capsys):
    code = main(["--url", stack.url, "--model", MODEL_NAME, "--tokenizer", str(stack.model_path), "--tools-dir", TOOLS,
                 "--requests", "8", "--concurrency", "2", "--prompt-tokens", "16", "--output-tokens", "8",
                 "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().out
