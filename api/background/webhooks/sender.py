"""The sender: every API process sends the webhook deliveries that are due, whoever created them.

It takes due deliveries from the index in Redis, each held from the other processes' senders for
longer than an attempt can take (``lmsp_core.store.objects.webhooks.take_due``), and sends each: a POST of
the event as it was first encoded, signed afresh (``signing``), to the address its URL's host
resolves to now, if that address is allowed (``targets``). The attempt is recorded whatever
happened; a 2xx answer delivers it, anything else (another status, a refused address, no answer
within ``LMSP_WEBHOOK_TIMEOUT``) schedules the next attempt after the next of
``LMSP_WEBHOOK_RETRY_DELAYS``, or fails the delivery when none is left. Redirects are not followed
(a 3xx is a failure), and a proxy from the environment is not used: it would resolve the host itself.
A process that dies mid-attempt leaves the delivery to another once the hold lapses: at least once.
"""

import asyncio
import contextlib
import logging
import time

import httpx
from redis.asyncio import Redis
from redis.exceptions import RedisError

from api.background.outage import Outage, poll
from api.background.webhooks import signing, targets
from lmsp_core import tracing
from lmsp_core.settings import Settings
from lmsp_core.store.objects import webhooks
from lmsp_core.store.objects.webhooks import DeliveryRecord, EndpointRecord
from lmsp_core.wire.webhooks import WebhookAttempt

logger = logging.getLogger(__name__)

IN_FLIGHT = 16  # attempts a process makes at once
HOLD_MARGIN = 30.0  # seconds a taken delivery is held beyond an attempt's limit
IDLE_POLL = 0.5  # seconds between looks at the due index while nothing is due
MAX_ANSWER_BYTES = 64 * 1024  # of a receiver's answer, read (and dropped) before the connection closes
USER_AGENT = "lmsp-webhooks/1.0"


class Sender:
    def __init__(self, redis: Redis, settings: Settings) -> None:
        self.redis = redis
        self.settings = settings
        self.delays = settings.webhook_retry_schedule
        self.hold = settings.webhook_timeout + HOLD_MARGIN
        # no keep-alive: connections go to checked addresses, and one kept for a host must not
        # carry another host's request (the pool knows them by address only)
        self.client = httpx.AsyncClient(follow_redirects=False, trust_env=False, timeout=settings.webhook_timeout,
                                        limits=httpx.Limits(max_keepalive_connections=0),
                                        headers={"User-Agent": USER_AGENT})
        self._sending: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        await poll(self._take, self._start, idle=IDLE_POLL, outage=Outage("webhook sender", logger))

    async def _take(self) -> list[str]:
        free = IN_FLIGHT - len(self._sending)
        return await webhooks.take_due(self.redis, free, self.hold) if free > 0 else []

    async def _start(self, due: list[str]) -> None:
        for delivery_id in due:
            task = asyncio.create_task(self.send(delivery_id), name=f"webhook-{delivery_id}")
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def close(self) -> None:
        for task in list(self._sending):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._sending, return_exceptions=True)
        await self.client.aclose()

    async def send(self, delivery_id: str) -> None:
        """One attempt of a delivery taken from the due index, recorded."""
        try:
            delivery = await webhooks.get_delivery(self.redis, delivery_id)
            endpoint = None if delivery is None else await webhooks.get_endpoint(self.redis, delivery.endpoint)
            if delivery is None or endpoint is None or delivery.status != "pending":
                await webhooks.drop_due(self.redis, delivery_id)  # expired, or its endpoint was deleted
                return
            attempt = await self.attempt(endpoint, delivery)
            status = await webhooks.record_attempt(self.redis, delivery, attempt, self.delays)
        except (RedisError, OSError) as exc:  # the hold lapses and a sender tries again
            logger.warning("webhook delivery %s: Redis unavailable (%s)", delivery_id, type(exc).__name__)
            return
        logger.info("webhook delivery %s to endpoint %s, attempt %d: %s (%s)", delivery.id, endpoint.id,
                    delivery.attempts + 1, attempt.status_code or attempt.error, status)

    async def attempt(self, endpoint: EndpointRecord, delivery: DeliveryRecord) -> WebhookAttempt:
        """POST the delivery once; what happened, as its attempt. The attempt is a span of the trace of
        what the delivery reports (a task's, a batch's), and tells the receiver so (``traceparent``)."""
        started, clock = time.time(), time.monotonic()
        span = tracing.start("webhook delivery", delivery.trace, kind="client", attributes={
            "lmsp.webhook.endpoint": endpoint.id, "lmsp.webhook.event_type": delivery.event_type,
            "lmsp.webhook.attempt": delivery.attempts + 1})
        status: int | None = None
        error: str | None = None
        try:
            async with asyncio.timeout(self.settings.webhook_timeout):
                target = await targets.resolve(endpoint.url, self.settings.webhook_allow_private)
                status = await self._post(target, endpoint.secret, delivery, span.traceparent)
        except targets.TargetRefused as exc:
            error = f"refused: {exc.detail}"
        except targets.TargetUnresolved as exc:
            error = exc.detail
        except TimeoutError:
            error = f"no answer within {self.settings.webhook_timeout:g} s"
        except httpx.HTTPError as exc:
            error = f"no answer: {type(exc).__name__}"
        if status is not None and not 200 <= status < 300:
            error = f"the receiver answered {status}"
        if status is not None:
            span.set({"http.response.status_code": status})
        if error is not None:
            span.fail(error)
        span.end()
        return WebhookAttempt(attempted_at=round(started, 3), duration_ms=int((time.monotonic() - clock) * 1000),
                              status_code=status, error=error)

    async def _post(self, target: targets.Target, secret: str, delivery: DeliveryRecord,
                    traceparent: str | None) -> int:
        url = httpx.URL(target.url)
        headers = {"Host": url.netloc.decode("ascii"), "Content-Type": "application/json",
                   **signing.headers(secret, delivery.event_id, delivery.body)}
        if traceparent is not None:
            headers[tracing.TRACEPARENT] = traceparent
        extensions = {"sni_hostname": target.hostname} if url.scheme == "https" else {}
        request = self.client.build_request("POST", url.copy_with(host=str(target.address)), content=delivery.body,
                                            headers=headers, extensions=extensions)
        response = await self.client.send(request, stream=True)
        try:
            read = 0
            async for chunk in response.aiter_raw():
                read += len(chunk)
                if read >= MAX_ANSWER_BYTES:
                    break
        finally:
            await response.aclose()
        return response.status_code
