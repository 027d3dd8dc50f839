"""`conveyor serve --api-key`: a real process asks OpenAI clients for the key (Bearer), while probes and
Prometheus reach /health and /metrics without it."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.e2e.conftest import ServeProcess, start_serve
from tests.prometheus import stop_process

pytestmark = pytest.mark.slow

KEY = "sk-conveyor-test"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory) -> Iterator[ServeProcess]:
    server = start_serve(tmp_path_factory.mktemp("auth") / "serve.log", "--api-key", KEY)
    try:
        yield server
    finally:
        stop_process(server.proc)


def test_requests_need_the_key_probes_do_not(keyed) -> None:
    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=keyed.base_url + "/v1", api_key=key, max_retries=0)

    with pytest.raises(openai.AuthenticationError) as refused:
        client("sk-wrong").completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2)
    assert refused.value.code == "invalid_api_key"
    for path in ("/v1/completions", "/tokenize"):  # no Authorization header at all
        plain = httpx.post(f"{keyed.base_url}{path}", json={"prompt": "Hi"})
        assert plain.status_code == 401 and plain.json()["error"]["message"] == "Incorrect API key provided."
    reply = client(KEY).completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2)
    assert reply.usage.completion_tokens == 2
    assert [m.id for m in client(KEY).models.list().data] == ["SmolLM2-135M-Instruct"]
    assert httpx.get(f"{keyed.base_url}/health").status_code == 200
    assert "conveyor:num_requests_waiting" in httpx.get(f"{keyed.base_url}/metrics").text


def test_the_schema_says_which_paths_need_the_key(keyed) -> None:
    schema = httpx.get(f"{keyed.base_url}/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert schema["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    paths = schema["paths"]
    assert paths["/v1/chat/completions"]["post"]["security"] == [{"bearer": []}]
    assert "401" in paths["/v1/models"]["get"]["responses"]
    assert "security" not in paths["/health"]["get"] and "security" not in paths["/metrics"]["get"]
