"""The kernel tests' shared fixture: the C layer kernels built for this machine, once per module."""

from __future__ import annotations

import pytest

from pagedserve.kernels.native_attention import NativeAttention
from pagedserve.kernels.native_build import NativeKernelUnavailable
from pagedserve.kernels.native_layer_ops import NativeLayerOps


@pytest.fixture(scope="module")
def kernels(tmp_path_factory) -> NativeLayerOps:
    try:
        return NativeLayerOps(NativeAttention(tmp_path_factory.mktemp("kernels")).lib)
    except NativeKernelUnavailable as err:
        pytest.skip(f"no native kernels here: {err}")
