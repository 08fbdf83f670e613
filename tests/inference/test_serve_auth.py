"""`rlix serve`'s bearer token: without one the OpenAI data plane is open (as vLLM's) and the
control plane refused; with one both need it."""

from __future__ import annotations

import asyncio
from importlib.metadata import version

import httpx

from rlix.inference.server.app import create_app
from serve_kit import start_serve, stop_serve

COMPLETION = {"model": "tiny", "prompt": "abc", "max_tokens": 2, "temperature": 0}


def test_rlix_serve_without_a_key_serves_the_openai_api_and_refuses_the_control_plane(tiny_model_dir):
    proc, base = start_serve("--model", str(tiny_model_dir), "--served-model-name", "tiny", "--max-num-seqs", "2",
                             keep_stderr=True)
    try:
        done = httpx.post(f"{base}/v1/completions", json=COMPLETION, timeout=60)
        assert done.status_code == 200 and done.json()["choices"][0]["text"] is not None, done.text
        assert httpx.post(f"{base}/tokenize", json={"model": "tiny", "prompt": "abc"}, timeout=10).status_code == 200
        for path in ("/sleep", "/pause", "/update_weights"):
            assert httpx.post(f"{base}{path}", timeout=10).status_code == 401, path
            assert httpx.post(f"{base}{path}", headers={"Authorization": "Bearer guess"}, timeout=10).status_code == 401
    finally:
        err = stop_serve(proc)
    assert "the OpenAI API is open" in err and "control plane (pause, sleep, weights) is refused" in err, err


def test_with_a_key_the_data_plane_and_the_control_plane_need_it(engine):
    async def main() -> None:
        transport = httpx.ASGITransport(app=create_app(engine, engine.tokenizer, "tiny", "k"))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            assert (await http.post("/v1/completions", json=COMPLETION)).status_code == 401
            assert (await http.post("/sleep")).status_code == 401
            ok = await http.post("/v1/completions", json=COMPLETION, headers={"Authorization": "Bearer k"})
            assert ok.status_code == 200
    asyncio.run(main())


def test_version_and_health_are_open_like_vllms_and_name_rlixs_version(engine):
    """GET /version answers vLLM's shape with the installed rlix's version, with or without a
    token (vLLM guards /v1 and /inference only), beside the routes that do need it."""
    async def main() -> None:
        transport = httpx.ASGITransport(app=create_app(engine, engine.tokenizer, "tiny", "k"))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer k"}):
                r = await http.get("/version", headers=headers)
                assert r.status_code == 200 and r.json() == {"version": version("rlix")}, (headers, r.text)
                assert (await http.get("/health", headers=headers)).status_code == 200
            assert (await http.get("/v1/models")).status_code == 401
            assert (await http.post("/version")).status_code == 405  # a GET page, as in vLLM
    asyncio.run(main())
