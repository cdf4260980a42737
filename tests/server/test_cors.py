"""Browser clients (`--allowed-origin`): a web page of a listed origin may call the API from its script (CORS), its
preflight answered before the key is checked; other pages stay refused; '*' only with --api-key."""

from __future__ import annotations

import pytest
from harness import start_server

from k6serve.serve.app import CORS_EXPOSED
from k6serve.serve.settings import settings_from_options
from k6serve.serve.settings import ServerSettings, normal_origin

PAGE = "http://localhost:5173"
BODY = {"prompt": "from a page", "size": "32x32", "num_frames": 5}


def _preflight(client, origin: str, method: str = "POST", headers: str = "content-type"):
    return client.options("/v1/videos", headers={"Origin": origin, "Access-Control-Request-Method": method,
                                                 "Access-Control-Request-Headers": headers})


@pytest.fixture
def servers(tmp_path):
    """Start servers with the given settings (each in its own folder); all are stopped after the test."""
    started = []

    def start(**settings):
        started.append(start_server(tmp_path / str(len(started)), **settings))
        return started[-1]

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def page_server(servers):
    return servers(allowed_origins=(PAGE,))


def test_a_listed_page_may_make_jobs_and_read_the_answers_without_a_key(page_server):
    with page_server.client() as client:
        preflight = _preflight(client, PAGE, headers="content-type,idempotency-key,x-stainless-os")
        assert preflight.status_code == 200, preflight.text
        assert preflight.headers["access-control-allow-origin"] == PAGE
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert "x-stainless-os" in preflight.headers["access-control-allow-headers"].lower()
        assert "access-control-allow-credentials" not in preflight.headers  # bearer keys, never cookies
        created = client.post("/v1/videos", json=BODY, headers={"Origin": PAGE})
        assert created.status_code == 200, created.text
        assert created.headers["access-control-allow-origin"] == PAGE
        exposed = {name.strip().lower() for name in created.headers["access-control-expose-headers"].split(",")}
        assert {"openai-poll-after-ms", "retry-after", "content-range"} <= exposed
        assert client.get(f"/v1/videos/{created.json()['id']}", headers={"Origin": PAGE}).status_code == 200


def test_a_page_not_listed_stays_refused_and_reads_nothing(page_server):
    with page_server.client() as client:
        refused = client.post("/v1/videos", json=BODY, headers={"Origin": "https://evil.example"})
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "cross_site_request"
        assert "access-control-allow-origin" not in refused.headers
        assert "--allowed-origin" in refused.json()["error"]["message"]
        preflight = _preflight(client, "https://evil.example")
        assert preflight.status_code == 400 and "access-control-allow-origin" not in preflight.headers
        # The origin is compared whole: another port of the same host is another site.
        assert client.post("/v1/videos", json=BODY, headers={"Origin": "http://localhost:5174"}).status_code == 403
        assert client.get("/v1/videos").json()["data"] == []


def test_any_page_with_a_key_gets_the_preflight_without_the_key_and_the_reason_of_a_401(servers):
    with servers(api_key="k3y", allowed_origins=("*",)).client(headers={}) as client:
        origin = "https://app.example"
        preflight = _preflight(client, origin, method="DELETE", headers="authorization")
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"
        unauthorized = client.get("/v1/videos", headers={"Origin": origin})
        # The page's script reads why (a 401 without the header is a bare network error to it).
        assert unauthorized.status_code == 401 and unauthorized.headers["access-control-allow-origin"] == "*"
        assert unauthorized.json()["error"]["code"] == "invalid_api_key"
        listed = client.get("/v1/videos", headers={"Origin": origin, "Authorization": "Bearer k3y"})
        assert listed.status_code == 200 and listed.headers["access-control-allow-origin"] == "*"


def test_without_the_flag_no_cors_headers_are_sent(servers):
    with servers(api_key="k3y").client() as client:
        answer = client.get("/v1/videos", headers={"Origin": "https://app.example"})
        assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


def test_every_page_without_a_key_is_refused_at_start():
    with pytest.raises(ValueError, match=r"--allowed-origin '\*' lets every web page.*Add --api-key"):
        ServerSettings(allowed_origins=("*",))
    assert ServerSettings(allowed_origins=("*",), api_key="k").allowed_origins == ("*",)


@pytest.mark.parametrize(("given", "written"), [
    ("https://App.Example.com/", "https://app.example.com"),
    ("https://app.example.com:443", "https://app.example.com"),
    ("http://app.example.com:80", "http://app.example.com"),
    ("http://localhost:5173", "http://localhost:5173"),
    ("http://[::1]:8080", "http://[::1]:8080"),
    ("https://пример.рф", "https://xn--e1afmkfd.xn--p1ai"),
    ("tauri://localhost", "tauri://localhost"),
    (" * ", "*"),
])
def test_origins_are_written_as_browsers_send_them(given, written):
    assert normal_origin(given) == written


@pytest.mark.parametrize(("given", "message"), [
    ("null", "Origin: null from a page opened as a file"),
    ("app.example.com", "has no scheme and host"),
    ("https://app.example.com/ui", "more than an origin"),
    ("https://user@app.example.com", "more than an origin"),
    ("https://*.example.com", "a wildcard inside an origin is not supported"),
    ("http://app.example.com:99999", "is not an origin"),
    ("", "is empty"),
])
def test_what_is_no_origin_is_refused_with_the_fix(given, message):
    with pytest.raises(ValueError, match=message) as raised:
        normal_origin(given)
    assert "http://localhost:" in str(raised.value)  # an example of what to pass


def test_the_flag_values_are_normalised_and_kept_once():
    settings = settings_from_options({"allowed_origin": ["https://A.example/", "https://a.example", "http://b:8"],
                                      "api_key": "k"})
    assert settings.allowed_origins == ("https://a.example", "http://b:8")


def test_exposed_headers_are_ones_the_server_sends():
    # A typo here would leave the SDK's poll hint unreadable to a page with nothing failing.
    assert "openai-poll-after-ms" in CORS_EXPOSED and "Retry-After" in CORS_EXPOSED


def test_while_loading_a_listed_page_reads_the_503_and_its_preflight_passes():
    import socket

    import httpx

    from k6serve.serve.loading import LoadingResponder

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    loading = LoadingResponder(sock, allowed_origins=(PAGE,))
    loading.start()
    try:
        host, port = sock.getsockname()
        url = f"http://{host}:{port}"
        health = httpx.get(f"{url}/health", headers={"Origin": PAGE})
        assert health.status_code == 503 and health.json()["status"] == "loading"
        assert health.headers["access-control-allow-origin"] == PAGE
        assert health.headers["access-control-expose-headers"] == "retry-after"
        preflight = httpx.options(f"{url}/v1/videos", headers={
            "Origin": PAGE, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type,authorization"})
        assert preflight.status_code == 204 and preflight.headers["access-control-allow-origin"] == PAGE
        assert preflight.headers["access-control-allow-headers"] == "content-type,authorization"
        # Another page gets the 503 without the header (its browser hides it), and no preflight.
        other = httpx.get(f"{url}/health", headers={"Origin": "https://evil.example"})
        assert other.status_code == 503 and "access-control-allow-origin" not in other.headers
        preflight = httpx.options(f"{url}/v1/videos", headers={"Origin": "https://evil.example",
                                                               "Access-Control-Request-Method": "POST"})
        assert preflight.status_code == 503 and "access-control-allow-origin" not in preflight.headers
    finally:
        loading.stop()
        sock.close()


@pytest.mark.parametrize("expect", [False, True])
@pytest.mark.parametrize("refusal", ["wrong key", "other site"])
def test_a_refusal_reads_the_body_before_it_answers(refusal, expect):
    # The 401 / 403 was sent and the connection closed over a body still unread in the kernel's buffer, which
    # resets the connection: about 1 in 100 such clients read "Connection reset by peer", not the answer (the OpenAI
    # SDK: retries, then "Connection error"). The body is drained first now, except from a client that waits for
    # "100 Continue", which has sent none (reading would ask it for the body).
    import asyncio

    from k6serve.serve.middleware import BearerAuth, RefuseOtherSites

    events: list[str] = []
    chunks = [b'{"prompt": ', b'"x"}']

    async def receive():
        chunk = chunks.pop(0)
        events.append("read")
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    async def send(message):
        events.append(message["type"])

    async def app(scope, receive, send):
        raise AssertionError("a refused request reached the app")

    headers = [(b"host", b"127.0.0.1:30001"), (b"content-length", b"15")]
    headers += [(b"expect", b"100-Continue")] if expect else []
    headers += [(b"origin", b"https://evil.example")] if refusal == "other site" else []
    scope = {"type": "http", "method": "POST", "path": "/v1/videos", "headers": headers, "query_string": b""}
    middleware = (BearerAuth(app, api_key="k3y") if refusal == "wrong key"
                  else RefuseOtherSites(app, bound_host="127.0.0.1"))
    asyncio.run(middleware(scope, receive, send))
    assert events == (["http.response.start", "http.response.body"] if expect
                      else ["read", "read", "http.response.start", "http.response.body"])
