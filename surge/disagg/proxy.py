"""`surge proxy`: an OpenAI-compatible front for N prefill and M decode instances. For Completions, Chat Completions
and Responses, streamed or not, it sends the prefill leg (max_tokens=1, no stream, kv_transfer_params
{"do_remote_decode": true, "transfer_id": ...}) to the prefill instance with the fewest outstanding requests, then
the decode leg (the client's body with the returned kv_transfer_params) to a decode instance, and relays that
instance's response bytes untouched, SSE chunk by chunk.

With --encode (encoder disaggregation), a Chat Completions or Responses request with image parts first goes, as
the client's bytes (answered whole, not streamed), to an encoder instance (`surge serve --ec-transfer-config` with
ec_role ec_producer), which encodes its images and saves their embeddings under their content hashes; then on to
prefill and decode as below, where the prefill (or combined) instance loads them. Requests without images never
go to an encoder instance. An encoder leg that fails (no instance reachable, a 5xx, after one retry) is counted
(surge_proxy:encoder_fallbacks) and the request goes on: the prefill instance encodes its images itself.

Without --prefill it is a plain balancer over the --decode instances (each request served whole by one), the
co-located baseline of a disaggregated deployment.

An instance that cannot be reached, or answers 5xx, before any byte reached the client: the leg is retried once on
another instance of its kind, then the client gets an OpenAI-shaped 503. A decode instance lost mid-stream: the
stream ends with an error event. A client that disconnects: both legs' connections close, so each instance aborts
its request (the decode side's read completes or is released, which frees the prefill side's blocks; blocks held
for a decode leg that was never sent are freed by the prefill instance's --kv-transfer-timeout).
"""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import httpx
import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from surge.disagg.bodies import RawBodies
from surge.disagg.instances import Instance, Pool
from surge.logger import init_logger

logger = init_logger(__name__)

APIS = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/responses": "responses"}
_FORWARDED_HEADERS = ("authorization", "content-type")


class Unavailable(Exception):
    def __init__(self, role: str, reason: str) -> None:
        super().__init__(f"no {role} instance could take the request ({reason})")
        self.role = role


class ClientGone(Exception):
    pass


def error_body(message: str, type_: str = "server_error", code: str | None = "service_unavailable") -> bytes:
    return msgspec.json.encode({"error": {"message": message, "type": type_, "param": None, "code": code}})


def error_response(status: int, message: str, type_: str = "server_error", code: str | None = None) -> Response:
    return Response(error_body(message, type_, code), status, media_type="application/json")


def error_event(api: str, message: str) -> bytes:
    """The last event of a stream whose upstream was lost: OpenAI's clients raise it as an APIError."""
    error = {"message": message, "type": "server_error", "param": None, "code": "upstream_lost"}
    if api == "responses":
        return b"event: error\ndata: " + msgspec.json.encode({"type": "error", "error": error, **error}) + b"\n\n"
    return b"data: " + msgspec.json.encode({"error": error}) + b"\n\n"


class ProxyMetrics:
    def __init__(self, pools: list[Pool]) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("surge_proxy:requests", "Requests by API and outcome.", ["api", "outcome"],
                                registry=r)
        self.retries = Counter("surge_proxy:leg_retries", "Legs retried on another instance.", ["role"], registry=r)
        self.encoder_fallbacks = Counter("surge_proxy:encoder_fallbacks", "Requests with images whose encoder "
                                         "leg failed: the prefill instance encoded them.", registry=r)
        self.prefill_seconds = Histogram("surge_proxy:prefill_leg_seconds", "Time of the prefill leg.",
                                         registry=r, buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
                                                              10, 30, 60))
        outstanding = Gauge("surge_proxy:outstanding_requests", "Requests in flight per instance.",
                            ["role", "instance"], registry=r)
        for pool in pools:
            for inst in pool.instances:
                outstanding.labels(pool.role, inst.url).set_function(lambda i=inst: i.outstanding)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], codec=None, timeout_s: float = 600.0,
                 encode: list[str] | None = None) -> None:
        self.encode = Pool("encode", encode) if encode else None  # encoder instances, for requests with images
        # No prefill instance: a plain balancer, each request served whole by one instance (the co-located
        # baseline a disaggregated deployment is measured against).
        self.prefill = Pool("prefill", prefill) if prefill else None
        self.decode = Pool("decode", decode)
        self.codec = codec if codec is not None else RawBodies()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        self.metrics = ProxyMetrics([p for p in (self.encode, self.prefill, self.decode) if p is not None])
        self._models: bytes | None = None
        routes = [Route(path, self._handler(path, api), methods=["POST"]) for path, api in APIS.items()]
        routes += [Route("/health", self.health, methods=["GET"]), Route("/metrics", self.render_metrics),
                   Route("/v1/models", self.models, methods=["GET"])]
        self.app = Starlette(routes=routes, lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        yield
        await self.client.aclose()

    # ---- one request ----
    def _handler(self, path: str, api: str):
        async def handle(request: Request) -> Response:
            try:
                response = await self.serve(request, path, api)
            except Unavailable as e:
                self.metrics.requests.labels(api, "unavailable").inc()
                return error_response(503, str(e), code="service_unavailable")
            except ClientGone:
                self.metrics.requests.labels(api, "client_gone").inc()
                return Response(status_code=499)
            self.metrics.requests.labels(api, "relayed").inc()
            return response
        return handle

    async def serve(self, request: Request, path: str, api: str) -> Response:
        body = await request.body()
        try:
            route = self.codec.parse(body, api)
        except (msgspec.DecodeError, ValueError, TypeError) as e:
            return error_response(400, f"the request body must be a JSON object: {e}", "invalid_request_error")
        headers = {k: v for k in _FORWARDED_HEADERS if (v := request.headers.get(k)) is not None}
        if route.images and self.encode is not None:
            answer = await self._encode_leg(request, path, route, headers)
            if answer is not None and 400 <= answer.status_code < 500:  # the client's mistake: as the instance gave it
                return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))
        decode_body = body
        if route.split and self.prefill is not None:
            start = time.perf_counter()
            prefill_body = self.codec.prefill_body(route, api, uuid.uuid4().hex)
            _, answer = await self._until_disconnect(request, self._send(self.prefill, path, prefill_body, headers))
            self.metrics.prefill_seconds.observe(time.perf_counter() - start)
            if answer.status_code != 200:  # the client's mistake (4xx): its answer, as the instance gave it
                return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))
            try:
                params = self.codec.transfer_params(answer.content)
            except (msgspec.DecodeError, ValueError, TypeError) as e:  # then the decode instance computes it all
                logger.warning("a prefill answer without readable kv_transfer_params (%s)", e)
                params = None
            if params is not None:
                decode_body = self.codec.decode_body(route, params)
        if not route.stream:
            _, answer = await self._until_disconnect(request, self._send(self.decode, path, decode_body, headers))
            return Response(self.codec.relay(answer.content), answer.status_code,
                            media_type=answer.headers.get("content-type"))
        inst, upstream = await self._until_disconnect(
            request, self._send(self.decode, path, decode_body, headers, stream=True))
        if upstream.status_code != 200:
            try:
                content = await upstream.aread()
            finally:
                await upstream.aclose()
                inst.outstanding -= 1
            return Response(content, upstream.status_code, media_type=upstream.headers.get("content-type"))
        return StreamingResponse(self._relay(api, inst, upstream), media_type=upstream.headers.get("content-type"))

    async def _encode_leg(self, request: Request, path: str, route, headers: dict) -> httpx.Response | None:
        """The encoder instance's answer, or None when no encoder instance could take the leg (then the prefill
        instance encodes the images itself: counted)."""
        try:
            _, answer = await self._until_disconnect(
                request, self._send(self.encode, path, self.codec.encode_body(route), headers))
        except Unavailable as e:
            self.metrics.encoder_fallbacks.inc()
            logger.warning("%s; the prefill instance encodes the images", e)
            return None
        return answer

    async def _relay(self, api: str, inst: Instance, upstream: httpx.Response):
        """The decode instance's stream, whole events at a time as they arrive (a cut-off event never reaches the
        client); if the instance is lost, an error event ends it. Cancelled (client gone): the connection closes."""
        pending = b""
        try:
            async for chunk in upstream.aiter_raw():
                data = pending + chunk if pending else chunk
                end = data.rfind(b"\n\n") + 2
                if end == 1:  # no event ends in it yet
                    pending = data
                    continue
                pending = data[end:]
                yield self.codec.relay(data[:end])
        except httpx.HTTPError as e:
            inst.failed_at, inst.num_failures = time.monotonic(), inst.num_failures + 1
            logger.warning("decode instance %s was lost mid-stream: %s", inst.url, e)
            yield error_event(api, f"the decode instance was lost mid-stream ({type(e).__name__})")
        finally:
            await upstream.aclose()
            inst.outstanding -= 1

    async def _send(self, pool: Pool, path: str, body: bytes, headers: dict,
                    stream: bool = False) -> tuple[Instance, httpx.Response]:
        """One leg: the best instance, and once more on another (or the same, when it is the only one) if it cannot
        be reached or answers 5xx. A streamed answer is returned open, its instance still counted outstanding."""
        tried: Instance | None = None
        reason = ""
        for attempt in range(2):
            inst = pool.order(exclude=tried)[0]
            if attempt:
                self.metrics.retries.labels(pool.role).inc()
            inst.outstanding += 1
            inst.num_requests += 1
            keep_open = False
            try:
                request = self.client.build_request("POST", inst.url + path, content=body, headers=headers)
                answer = await self.client.send(request, stream=stream)
                if answer.status_code >= 500:
                    reason = f"{inst.url} answered {answer.status_code}"
                    if stream:
                        await answer.aclose()
                else:
                    keep_open = stream
                    return inst, answer
            except httpx.TransportError as e:
                reason = f"{inst.url}: {type(e).__name__} {e}".rstrip()
            finally:
                if not keep_open:
                    inst.outstanding -= 1
            inst.failed_at, inst.num_failures, tried = time.monotonic(), inst.num_failures + 1, inst
            logger.warning("%s instance %s failed (%s)%s", pool.role, inst.url, reason,
                           "; retrying once" if not attempt else "")
        raise Unavailable(pool.role, reason)

    @staticmethod
    async def _until_disconnect(request: Request, leg):
        """Await a leg unless the client goes first: then cancel it (its connection closes, the instance aborts)."""
        work = asyncio.ensure_future(leg)
        watch = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
        if work.cancelled():
            raise ClientGone()
        return work.result()

    # ---- the proxy's own endpoints ----
    async def health(self, request: Request) -> Response:
        """200 when at least one prefill and one decode instance answer their /health (encoder instances are
        reported, not required: without one, prefill instances encode)."""
        async def up(inst: Instance) -> bool:
            try:
                return (await self.client.get(inst.url + "/health", timeout=2.0)).status_code == 200
            except httpx.HTTPError:
                return False
        pools = [p for p in (self.prefill, self.decode) if p is not None]
        states = [await asyncio.gather(*(up(i) for i in pool.instances)) for pool in pools]
        ok = all(any(s) for s in states)
        if self.encode is not None:
            pools.append(self.encode)
            states.append(await asyncio.gather(*(up(i) for i in self.encode.instances)))
        report = {pool.role: dict(zip([i.url for i in pool.instances], s)) for pool, s in zip(pools, states)}
        return Response(msgspec.json.encode({"status": "ok" if ok else "unavailable", **report}),
                        200 if ok else 503, media_type="application/json")

    async def render_metrics(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def models(self, request: Request) -> Response:
        """The decode instances' models, as one list (asked once, then remembered)."""
        if self._models is None:
            ids: dict[str, dict] = {}
            headers = {k: v for k in ("authorization",) if (v := request.headers.get(k)) is not None}
            for inst in self.decode.instances:
                try:
                    answer = await self.client.get(inst.url + "/v1/models", headers=headers, timeout=5.0)
                    if answer.status_code == 200:
                        for card in msgspec.json.decode(answer.content).get("data", []):
                            ids.setdefault(card["id"], card)
                except (httpx.HTTPError, msgspec.DecodeError, KeyError, TypeError, AttributeError):
                    continue
            if not ids:
                return error_response(503, "no decode instance listed its models", code="service_unavailable")
            self._models = msgspec.json.encode({"object": "list", "data": list(ids.values())})
        return Response(self._models, media_type="application/json")


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def run_proxy(prefill: list[str], decode: list[str], host: str, port: int, timeout_s: float = 600.0,
              log_level: str = "warning", encode: list[str] | None = None) -> None:
    import uvicorn
    if not timeout_s > 0:
        raise ValueError(f"--timeout={timeout_s} must be a positive number of seconds")
    if not 0 < port < 65536:
        raise ValueError(f"--port={port} must be in [1, 65535]")
    proxy = Proxy(prefill, decode, timeout_s=timeout_s, encode=encode)
    logger.info("surge proxy on http://%s:%d: encode %s, prefill %s, decode %s", host, port,
                [i.url for i in proxy.encode.instances] if proxy.encode else "none",
                [i.url for i in proxy.prefill.instances] if proxy.prefill else "none (plain balancing)",
                [i.url for i in proxy.decode.instances])
    uvicorn.run(proxy.app, host=host, port=port, log_level=log_level, access_log=False)
