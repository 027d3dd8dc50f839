"""The container images, built here with buildah on a debootstrap base (tests/images/builder.py):
the operator image in every run, the server image (several GB) under the `slow` marker."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.images.builder import Container, build
from tests.k8s.cluster import free_port

pytestmark = pytest.mark.images


@pytest.fixture(scope="module")
def operator_image() -> str:
    image, _ = build("operator", timeout=900)
    return image


def test_the_operator_image_runs_the_operator_as_non_root_without_torch(operator_image: str) -> None:
    container = Container(operator_image)
    try:
        assert container.config("{{.OCIv1.Config.User}}") == "10001:10001"
        assert container.run("id", "-u").stdout.strip() == "10001"
        help_text = container.run("conveyor", "operator", "--help").stdout
        assert "--server-image" in help_text and "--network-policy-from" in help_text
        probe = (
            "import importlib.util, conveyor.operator, conveyor.operator.run, conveyor.operator.handlers; "
            "print([m for m in ('torch', 'transformers', 'triton', 'fastapi') if importlib.util.find_spec(m)])"
        )
        assert container.run("python", "-c", probe).stdout.strip() == "[]"
        # The root filesystem is the image's; nothing is writable to the operator's user but /tmp.
        assert container.run("touch", "/opt/conveyor/x", check=False).returncode != 0
    finally:
        container.remove()


@pytest.mark.slow
def test_the_cpu_server_image_serves_the_embedded_model(tmp_path: Path) -> None:
    """`conveyor serve` inside the image, with no model mounted, answers /health and a completion
    through the real openai client (chroot isolation shares the host's loopback)."""
    image, log = build("server-cpu", timeout=2400)
    print(log.splitlines()[-1])  # "built NAME: SIZE in N s", for the note
    container = Container(image)
    port = free_port()
    server_log = tmp_path / "server.log"
    process = container.popen(
        "conveyor",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "512",
        log=server_log,
    )
    try:
        deadline = time.monotonic() + 600
        while True:
            assert process.poll() is None, server_log.read_text()[-4000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, server_log.read_text()[-4000:]
            time.sleep(1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        (model,) = client.models.list().data
        answer = client.completions.create(model=model.id, prompt="The capital of France is", max_tokens=8)
        assert answer.choices[0].text.strip()
        assert answer.usage.completion_tokens > 0
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except Exception:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
        container.remove()
