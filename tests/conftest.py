"""Fixtures shared by every test folder."""

import os
import shutil
from collections.abc import Iterator

import pytest

# Without a GPU, Triton kernels run only under its interpreter, and Triton reads this variable when it is
# first imported (transformers imports it too): set it before any test module can import triton.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.k8s.cluster import LocalCluster


@pytest.fixture(scope="session")
def k8s() -> Iterator[LocalCluster]:
    """A local Kubernetes control plane with simulated GPU nodes (tests/k8s/cluster.py), one per session.

    Attributes: `kubeconfig` (Path), `api_client` (kubernetes ApiClient), `kubectl(*args)`,
    `add_nodes(NodePool(...))`, `create_namespace()`. Default nodes: one NVIDIA-A100-SXM4-80GB
    and one NVIDIA-H100-80GB-HBM3 node with 8 `nvidia.com/gpu` each, one NVIDIA-L4 node with 4. If the binaries cannot be
    built the fixture raises the build's error: tests using it fail, never skip.
    """
    with LocalCluster() as cluster:
        yield cluster
