"""The OpenAI-compatible HTTP API as operators deploy it, against live processes through the official
``openai`` client: behind a bearer token (401 without it, the body limit counted on chunked bodies), over
TLS with the router's certificate, and from ``pdserve up --http-port`` on Ray."""

from __future__ import annotations

import http.client
import json
import os
import ssl
import time
import uuid

import openai
import pytest

from pdserve.deploy.processes import spawn_role
from tests.clusters import pdserve_up, stop_pdserve_up
from tests.conftest import CHAT_MODEL as MODEL
from tests.conftest import CHATML
from tests.http_helpers import MESSAGES, PROMPTS, raw
from tests.tls_files import make_tls_files

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def no_env_token(monkeypatch):
    monkeypatch.delenv("PDSERVE_ROUTER_TOKEN", raising=False)


def test_bearer_token_is_required_when_configured(http_cluster, tmp_path, redis_url, chat_model_dir):
    token = "t0k-" + uuid.uuid4().hex
    (tmp_path / "token").write_text(token + "\n")
    router = spawn_role("router", dict(model_dir=chat_model_dir, cluster=http_cluster.cluster, redis_url=redis_url,
                                       token_file=str(tmp_path / "token"), http_port=0,
                                       max_receive_message_bytes=2048), "router-token")
    try:
        base = f"http://{router.http_address}/v1"
        for key in ("wrong-" + token, token[:-1], token + "x"):
            with pytest.raises(openai.AuthenticationError) as info:
                openai.OpenAI(base_url=base, api_key=key, max_retries=0).completions.create(model=MODEL, prompt="Hi")
            assert info.value.status_code == 401 and info.value.response.headers["WWW-Authenticate"] == "Bearer"
        for path, body in (("/v1/models", None), ("/v1/completions", {"prompt": "Hi"}), ("/v1/completions", b"{bad"),
                           ("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1]})):
            status, _, answer = raw(router.http_address, path, body)  # no token: refused before the body is read
            assert status == 401 and "missing" in json.loads(answer)["error"]["message"]
        assert raw(router.http_address, "/v1/models", headers={"Authorization": f"Basic {token}"})[0] == 401
        assert raw(router.http_address, "/health")[0] == 200  # open, as the gRPC health service
        api = openai.OpenAI(base_url=base, api_key=token, max_retries=0)
        deadline = time.monotonic() + 10
        while raw(router.http_address, "/health")[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        got = api.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
        assert got.choices[0].text == http_cluster.complete(PROMPTS[0], max_tokens=8, temperature=0).text
        conn = http.client.HTTPConnection(router.http_address, timeout=30)  # no declared size: counted as it comes
        conn.request("POST", "/v1/completions", body=iter([b'{"prompt": "', b"x" * 4096, b'"}']),
                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
                     encode_chunked=True)
        answer = conn.getresponse()
        assert answer.status == 413 and "2048 bytes" in json.loads(answer.read())["error"]["message"]
        conn.close()
    finally:
        router.stop()
    http_cluster.assert_pools_free()


def test_pdserve_up_serves_the_http_api(redis_url, model_dir, tmp_path):
    """`pdserve up --http-port 0` on Ray prints `http listening on HOST:PORT`, where the OpenAI client is
    served under --served-model-name, chatting through the --chat-template file."""
    template = tmp_path / "chat.jinja"
    template.write_text(CHATML)
    env = {**os.environ, "PDSERVE_REDIS_URL": redis_url}
    with pdserve_up(["--model", model_dir, "--http-port", "0", "--served-model-name", "story", "--chat-template",
                     str(template)], env) as up:
        lines, deadline = [], time.monotonic() + 150
        while not any(line.startswith("http listening on ") for line in lines) and time.monotonic() < deadline:
            line = up.stdout.readline()
            assert line or up.poll() is None, up.stderr.read()
            lines.append(line)
        (http_line,) = [line for line in lines if line.startswith("http listening on ")]
        assert lines[0].startswith("router listening on ") and lines[1].startswith("cluster "), lines
        api = openai.OpenAI(base_url=f"http://{http_line.split()[-1]}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in api.models.list().data] == ["story"]
        got = api.completions.create(model="story", prompt=PROMPTS[0], max_tokens=12, temperature=0)
        assert got.choices[0].text.startswith(". The dog liked to run and play")  # the model's greedy continuation
        chat = api.chat.completions.create(model="story", messages=MESSAGES, max_tokens=5)
        assert chat.usage.completion_tokens == 5
        stop_pdserve_up(up)


def test_http_api_over_tls_with_the_routers_certificate(http_cluster, tmp_path, redis_url, chat_model_dir):
    tls = make_tls_files(tmp_path)
    router = spawn_role("router", dict(model_dir=chat_model_dir, cluster=http_cluster.cluster, redis_url=redis_url,
                                       tls_cert_file=tls["cert"], tls_key_file=tls["key"], http_port=0),
                        "router-tls")
    try:
        verified = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=tls["ca"]))
        api = openai.OpenAI(base_url=f"https://{router.http_address}/v1", api_key="unused", max_retries=0,
                            http_client=verified)
        got = api.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0)
        assert got.choices[0].text == http_cluster.complete(PROMPTS[1], max_tokens=8, temperature=0).text
        with pytest.raises(openai.APIConnectionError):  # plaintext to the TLS port
            openai.OpenAI(base_url=f"http://{router.http_address}/v1", api_key="unused",
                          max_retries=0).models.list()
    finally:
        router.stop()
