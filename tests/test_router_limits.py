"""The router's operator limits (RouterConfig, router/limits.py): concurrent Generate streams in all
and per bearer token, message sizes, ``max_tokens`` per request, and a ``GetClusterState`` that does
not read Redis per call. In-process routers; workers are registry entries pointing at a fake decode
worker whose Generate never answers, so that streams stay open as long as a test needs."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.cluster.registry import WorkerInfo, WorkerLease
from pdserve.deploy import client
from pdserve.model.config import ModelConfig
from pdserve.model.tokenizer import Tokenizer
from pdserve.router.config import RPC_HEADROOM, RouterConfig
from pdserve.router.limits import StreamLimitExceeded, StreamSlots
from pdserve.router.server import Router
from pdserve.router.validation import validate
from tests.http_helpers import raw

TOKENS = ("token-one-0123456789abcdef", "token-two-0123456789abcdef")


@pytest.fixture(autouse=True)
def no_env_token(monkeypatch):
    monkeypatch.delenv("PDSERVE_ROUTER_TOKEN", raising=False)


@asynccontextmanager
async def hanging_worker():
    """A gRPC server whose DecodeWorker.Generate and PrefillWorker.Prefill never answer; yields its address."""
    async def hang_stream(request, context):
        await asyncio.Event().wait()
        yield b""

    async def hang_unary(request, context):
        await asyncio.Event().wait()

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((
        grpc.method_handlers_generic_handler("pdserve.worker.v1.DecodeWorker",
                                             {"Generate": grpc.unary_stream_rpc_method_handler(hang_stream)}),
        grpc.method_handlers_generic_handler("pdserve.worker.v1.PrefillWorker",
                                             {"Prefill": grpc.unary_unary_rpc_method_handler(hang_unary)})))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


def register(redis_url: str, cluster: str, address: str, ids=("p0", "d0")) -> WorkerLease:
    """Registry entries (30 s leases) for a prefill and a decode worker at ``address``."""
    lease = WorkerLease(redis_url, cluster, lease_s=30.0)
    for wid in ids:
        role = "prefill" if wid.startswith("p") else "decode"
        lease.renew(WorkerInfo(worker_id=wid, role=role, address=address,
                               kv_address="127.0.0.1:1" if role == "decode" else "",
                               num_total_blocks=1000, num_free_blocks=1000, block_size=16))
    return lease


@asynccontextmanager
async def running_router(cfg: RouterConfig, num_workers: int = 0):
    """An in-process router, once it lists ``num_workers`` workers."""
    router = Router(cfg)
    await router.start()
    try:
        deadline = time.monotonic() + 10
        while len(router.workers) != num_workers:
            assert time.monotonic() < deadline, f"router lists {router.workers}"
            await asyncio.sleep(0.02)
        yield router
    finally:
        await router.stop()


def config(model_dir: str, redis_url: str, **kw) -> RouterConfig:
    return RouterConfig(model_dir=model_dir, cluster="lim-" + uuid.uuid4().hex[:8], redis_url=redis_url,
                        registry_poll_s=0.05, **kw)


async def open_stream(channel: grpc.aio.Channel, prompt: str = "Once upon a time"):
    """A Generate call, and the error it ends with within 0.5 s (None: still open; a timeout on the
    read itself would cancel the call)."""
    call = client.pdserve_pb2_grpc.RouterStub(channel).Generate(client.make_request(prompt, max_tokens=4))
    read = asyncio.ensure_future(call.read())
    read.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no warning when cancelled
    done, _ = await asyncio.wait({read}, timeout=0.5)
    if not done:
        return call, None
    if isinstance(read.exception(), grpc.aio.AioRpcError):
        return call, read.exception()
    raise AssertionError(f"the fake worker answered: {read.result()}")


# ---- configuration -------------------------------------------------------------------------------------

def test_limits_are_checked_in_the_config(tmp_path):
    for kw, match in ((dict(max_concurrent_streams=0), "max_concurrent_streams"),
                      (dict(max_tokens_limit=0), "max_tokens_limit"),
                      (dict(max_receive_message_bytes=0), "max_receive_message_bytes"),
                      (dict(max_send_message_bytes=-1), "max_send_message_bytes"),
                      (dict(max_streams_per_token=-1), "max_streams_per_token"),
                      (dict(max_tokens_limit=8, default_max_tokens=16), "default_max_tokens.*max_tokens_limit"),
                      (dict(max_streams_per_token=2), "needs bearer tokens")):
        with pytest.raises(ValueError, match=match):
            RouterConfig(model_dir="m", **kw)
    cfg = RouterConfig(model_dir="m")
    assert (cfg.max_concurrent_streams, cfg.max_streams_per_token, cfg.max_tokens_limit) == (1024, 0, 4096)
    assert cfg.max_receive_message_bytes == cfg.max_send_message_bytes == 4 << 20
    assert cfg.max_concurrent_rpcs == 1024 + RPC_HEADROOM

    path = tmp_path / "tokens"
    path.write_text(f"{TOKENS[0]}\n\n  {TOKENS[1]}  \n")
    cfg = RouterConfig(model_dir="m", token_file=str(path), max_streams_per_token=3)
    assert cfg.bearer_tokens() == TOKENS and cfg.bearer_token() == TOKENS[0]
    path.write_text(f"{TOKENS[0]}\nshort-secret\n")
    with pytest.raises(ValueError, match="line 2: the bearer token must have at least 16") as err:
        RouterConfig(model_dir="m", token_file=str(path))
    assert "short-secret" not in str(err.value)
    path.write_text(f"{TOKENS[0]}\n{TOKENS[0]}\n")
    with pytest.raises(ValueError, match="listed twice"):
        RouterConfig(model_dir="m", token_file=str(path))
    path.write_text("\n\n")
    with pytest.raises(ValueError, match="at least 16"):
        RouterConfig(model_dir="m", token_file=str(path))


def test_stream_slots_count_in_all_and_per_token():
    slots = StreamSlots(3, TOKENS, max_per_token=2)
    a = [("authorization", f"Bearer {TOKENS[0]}")]
    held = [slots.acquire(a), slots.acquire(a)]
    with pytest.raises(StreamLimitExceeded, match=r"bearer token 1 of 2 .*2 concurrent.*max_streams_per_token"):
        slots.acquire(a)
    held.append(slots.acquire([("authorization", f"bearer {TOKENS[1]}".encode())]))
    with pytest.raises(StreamLimitExceeded, match="limit of 3 concurrent Generate streams.*max_concurrent_streams"):
        slots.acquire([("authorization", f"Bearer {TOKENS[1]}")])
    for slot in held:
        slot.release()
        slot.release()  # idempotent
    assert slots.num_streams == 0 and not slots.num_by_token


# ---- max_tokens ------------------------------------------------------------------------------------------

def test_validate_refuses_max_tokens_over_the_limit(model_dir):
    cfg = ModelConfig.from_hf_dir(model_dir)
    tok = Tokenizer(model_dir, cfg.bos_token_id)
    req = client.make_request("Once upon a time", max_tokens=33)
    with pytest.raises(ValueError, match=r"max_tokens \(33\) exceeds this router's limit of 32 .*max_tokens_limit"):
        validate(req, cfg, tok, 16, max_tokens_limit=32)
    assert validate(req, cfg, tok, 16, max_tokens_limit=33).sampling.max_tokens == 33
    with pytest.raises(ValueError, match="limit of 8"):  # the default max_tokens is bound as well
        validate(client.make_request("Once upon a time"), cfg, tok, 16, max_tokens_limit=8)


def test_router_answers_invalid_argument_naming_the_max_tokens_limit(model_dir, redis_url):
    async def go():
        async with running_router(config(model_dir, redis_url, max_tokens_limit=32)) as router:
            async with grpc.aio.insecure_channel(router.address) as channel:
                codes = []
                for n in (33, 32):
                    try:
                        await client.complete(channel, client.make_request("Hi", max_tokens=n), timeout_s=10)
                    except grpc.aio.AioRpcError as exc:
                        codes.append((exc.code(), exc.details()))
                return codes

    (over, over_msg), (within, _) = asyncio.run(go())
    assert over == grpc.StatusCode.INVALID_ARGUMENT and "limit of 32" in over_msg and "max_tokens_limit" in over_msg
    assert within == grpc.StatusCode.UNAVAILABLE  # valid; no worker


# ---- concurrent streams ----------------------------------------------------------------------------------

def test_streams_beyond_the_cap_get_resource_exhausted_naming_it(model_dir, redis_url):
    cfg = config(model_dir, redis_url, max_concurrent_streams=2)

    async def go():
        async with hanging_worker() as fake:
            lease = register(redis_url, cfg.cluster, fake)
            try:
                async with running_router(cfg, num_workers=2) as router, \
                        grpc.aio.insecure_channel(router.address) as channel:
                    held = [await open_stream(channel) for _ in range(2)]
                    assert [err for _, err in held] == [None, None]
                    _, refused = await open_stream(channel)
                    assert refused is not None and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert "limit of 2 concurrent Generate streams" in refused.details()
                    assert "max_concurrent_streams" in refused.details()
                    # other RPCs still answer at the cap (gRPC's own cap is above it)
                    assert len((await client.cluster_state(channel)).workers) == 2
                    probe = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
                    assert probe.status == health_pb2.HealthCheckResponse.SERVING
                    held[0][0].cancel()
                    await asyncio.sleep(0.2)
                    again = await open_stream(channel)
                    assert again[1] is None, again[1]  # the cancelled stream's slot was given back
                    for call, _ in (held[1], again):
                        call.cancel()
                    deadline = time.monotonic() + 5
                    while router._slots.num_streams:
                        assert time.monotonic() < deadline
                        await asyncio.sleep(0.02)
            finally:
                redis.Redis.from_url(redis_url).delete(*(f"pdserve:{cfg.cluster}:worker:{w}" for w in ("p0", "d0")))
                lease.close()

    asyncio.run(go())


def test_each_bearer_token_has_its_own_stream_quota(model_dir, redis_url, tmp_path):
    (tmp_path / "tokens").write_text("\n".join(TOKENS) + "\n")
    cfg = config(model_dir, redis_url, token_file=str(tmp_path / "tokens"), max_streams_per_token=1)

    async def go():
        async with hanging_worker() as fake:
            lease = register(redis_url, cfg.cluster, fake)
            try:
                async with running_router(cfg, num_workers=2) as router:
                    channels = [client.open_channel(router.address, token=t) for t in (*TOKENS, "x" * 20)]
                    try:
                        first, err = await open_stream(channels[0])
                        assert err is None
                        _, refused = await open_stream(channels[0])
                        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                        assert "bearer token 1 of 2" in refused.details()
                        assert "max_streams_per_token" in refused.details() and TOKENS[0] not in refused.details()
                        second, err = await open_stream(channels[1])  # the other token's quota is its own
                        assert err is None
                        _, denied = await open_stream(channels[2])
                        assert denied.code() == grpc.StatusCode.UNAUTHENTICATED
                        assert dict(router._slots.num_by_token) == {1: 1, 2: 1}
                        first.cancel()
                        second.cancel()
                        deadline = time.monotonic() + 5
                        while router._slots.num_streams:
                            assert time.monotonic() < deadline
                            await asyncio.sleep(0.02)
                        assert not router._slots.num_by_token
                    finally:
                        for ch in channels:
                            await ch.close()
            finally:
                redis.Redis.from_url(redis_url).delete(*(f"pdserve:{cfg.cluster}:worker:{w}" for w in ("p0", "d0")))
                lease.close()

    asyncio.run(go())


# ---- message sizes ---------------------------------------------------------------------------------------

def test_message_size_limits_are_explicit(model_dir, redis_url):
    cfg = config(model_dir, redis_url, max_receive_message_bytes=1024, max_send_message_bytes=256)

    async def go():
        async with hanging_worker() as fake:
            lease = register(redis_url, cfg.cluster, fake, ids=("d0", "d1", "d2", "p0"))
            try:
                async with running_router(cfg, num_workers=4) as router, \
                        grpc.aio.insecure_channel(router.address) as channel:
                    out = []
                    for prompt in ("a" * 2000, "Hi"):
                        try:
                            await client.complete(channel, client.make_request(prompt, max_tokens=1), timeout_s=1)
                        except grpc.aio.AioRpcError as exc:  # "Hi" is accepted: it waits on the fake worker
                            out.append(exc.code())
                    try:  # four workers do not fit in 256 bytes
                        await client.cluster_state(channel)
                    except grpc.aio.AioRpcError as exc:
                        out.append(exc.code())
                    return out
            finally:
                redis.Redis.from_url(redis_url).delete(
                    *(f"pdserve:{cfg.cluster}:worker:{w}" for w in ("d0", "d1", "d2", "p0")))
                lease.close()

    exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
    assert asyncio.run(go()) == [exhausted, grpc.StatusCode.DEADLINE_EXCEEDED, exhausted]


# ---- GetClusterState from the cached registry read -------------------------------------------------------

def test_cluster_state_does_not_read_redis_per_call(model_dir, private_redis):
    r = redis.Redis.from_url(private_redis.url)
    poll_s = 0.2
    cfg = RouterConfig(model_dir=model_dir, cluster="lim-" + uuid.uuid4().hex[:8], redis_url=private_redis.url,
                       registry_poll_s=poll_s)
    lease = register(private_redis.url, cfg.cluster, "127.0.0.1:1")

    def calls() -> dict[str, int]:
        return {k.removeprefix("cmdstat_"): v["calls"] for k, v in r.info("commandstats").items()}

    async def go():
        async with running_router(cfg, num_workers=2) as router, grpc.aio.insecure_channel(router.address) as ch:
            await client.cluster_state(ch)
            before, t0 = calls(), time.monotonic()
            for _ in range(200):
                state = await client.cluster_state(ch)
                assert len(state.workers) == 2
            elapsed, after = time.monotonic() - t0, calls()
            return elapsed, {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}

    try:
        elapsed, delta = asyncio.run(go())
    finally:
        lease.close()
    # reads (the poller's or a stale call's) start at least poll_s apart: at most elapsed / poll_s + 1, and one in
    # flight as the window opened (the poller once slept a fixed interval after a caller's read: 4 in 0.4 s)
    bound = elapsed / poll_s + 2
    assert delta.get("scan", 0) <= bound, (elapsed, delta)
    commands = sum(v for k, v in delta.items() if k != "info")
    assert commands <= 8 * bound, (elapsed, delta)  # every read of a poll round together, not per call
    assert commands < 200, delta


# ---- a tokenizer larger than its model ----------------------------------------------------------------------

def test_a_tokenizer_past_the_models_vocabulary_is_named_at_start_and_per_prompt(chat_model_dir, redis_url, tmp_path,
                                                                                caplog):
    """A checkpoint whose tokenizer has ids at or past its model's vocab_size: the router starts (most texts
    still serve), warns once naming both sizes, and a text that tokenizes past the vocabulary is refused as
    the checkpoint's doing (INVALID_ARGUMENT naming the tokenizer), where token ids from a client keep their
    own message; a chat whose rendered template tokenizes past it is a 400 naming the same."""
    small = tmp_path / "small-vocab"
    small.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json"):
        shutil.copy(Path(chat_model_dir) / name, small / name)
    tok = Tokenizer(str(small), 1)
    top = tok.max_token_id
    config_json = json.loads((small / "config.json").read_text())
    config_json["vocab_size"] = top                                  # the tokenizer's last id is one past it
    (small / "config.json").write_text(json.dumps(config_json))
    cfg = ModelConfig.from_hf_dir(str(small))
    text = tok.decode([top]) * 2
    assert top in Tokenizer(str(small), cfg.bos_token_id).encode(text)
    with pytest.raises(ValueError, match=rf"tokenizes to ids \[{top}\] outside the model's vocabulary "
                                         rf"\[0, {top}\): this checkpoint's tokenizer has ids up to {top}"):
        validate(client.make_request(text), cfg, tok, 16)
    with pytest.raises(ValueError, match=rf"token ids \[{top}\] are outside the vocabulary"):
        validate(client.make_request([1, top]), cfg, tok, 16)

    async def go():
        async with running_router(config(str(small), redis_url, http_port=0)) as router:
            async with grpc.aio.insecure_channel(router.address) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.complete(channel, client.make_request(text), timeout_s=10)
            chat = {"model": "small-vocab", "messages": [{"role": "user", "content": text}], "max_tokens": 4}
            return err.value, await asyncio.to_thread(raw, router.http_address, "/v1/chat/completions", chat)

    with caplog.at_level(logging.WARNING, logger="pdserve.router.server"):
        exc, (status, _, body) = asyncio.run(go())
    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "checkpoint's tokenizer" in exc.details()
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == "messages" and "checkpoint's tokenizer has ids up to" in error["message"]
    warned = [r.getMessage() for r in caplog.records if "tokenizer has token ids up to" in r.getMessage()]
    assert warned == [f"the checkpoint's tokenizer has token ids up to {top} but its model's vocabulary is "
                      f"[0, {top}): text prompts that tokenize to ids past it are refused (INVALID_ARGUMENT, "
                      f"naming them)"]
