"""Webhook endpoints (docs/protocol.md, "Webhooks"): POST and GET /lmsp/v1/webhooks, GET and DELETE
/lmsp/v1/webhooks/{id}, GET /lmsp/v1/webhooks/{id}/deliveries, POST /lmsp/v1/webhooks/{id}/test.

Each principal manages its own endpoints, with the scope ``webhooks:manage``. An endpoint's URL is
checked when it is created (its host must resolve to an address the service sends to:
``api.background.webhooks.targets``) and again at every attempt; its signing secret is in the creation's answer
only.
"""

import asyncio
from typing import Annotated

from litestar import Controller, Response, delete, get, post
from litestar.openapi.spec import Example
from litestar.params import Body, Parameter

from api.background.webhooks import targets
from api.http.openapi import document as doc
from api.process import Services
from lmsp_core.requests import webhooks as checks
from lmsp_core.store.objects import webhooks
from lmsp_core.store.objects.webhooks import EndpointRecord
from lmsp_core.store.tenants import credentials
from lmsp_core.wire import ids
from lmsp_core.wire import webhooks as wire
from lmsp_core.wire.errors import NotFound

MAX_PAGE = 100
_SCOPE = {"scope": credentials.WEBHOOKS_MANAGE}

WEBHOOK_ID = "wh_01J8M6Q4W2T7N5R3V9X1Z8B0DF"
DELIVERY_ID = "dlv_01J8M6Q4W5C8H2K9P3S7Y1A6ZE"
# a reserved name (RFC 2606) that never resolves: the document's example creates nothing
EXAMPLE_URL = "https://receiver.example/lmsp-events"
_EVENTS = ["response.completed", "response.failed"]
_CREATE = wire.WebhookCreate(url=EXAMPLE_URL, events=_EVENTS)
_ENDPOINT = wire.WebhookEndpoint(id=WEBHOOK_ID, url=EXAMPLE_URL, events=_EVENTS, created_at=1794200000)
_CREATED = wire.WebhookEndpointWithSecret(id=WEBHOOK_ID, url=EXAMPLE_URL, events=_EVENTS, created_at=1794200000,
                                          secret="whsec_" + "A" * 43 + "=")
_DELIVERY = wire.WebhookDelivery(
    id=DELIVERY_ID, endpoint_id=WEBHOOK_ID, event_id=f"evt_{doc.TASK_ID}_response_completed",
    event_type="response.completed", status="delivered", created_at=1794200003, next_attempt_at=None,
    attempts=[wire.WebhookAttempt(attempted_at=1794200003.2, duration_ms=120, status_code=500,
                                  error="the receiver answered 500"),
              wire.WebhookAttempt(attempted_at=1794200008.4, duration_ms=95, status_code=200, error=None)])
_QUEUED = wire.WebhookDelivery(id=DELIVERY_ID, endpoint_id=WEBHOOK_ID, event_id="evt_01J8M6Q4W2T7N5R3V9X1Z8B0DF",
                               event_type=wire.TEST_EVENT, status="pending", created_at=1794200000,
                               next_attempt_at=1794200000, attempts=[])
# `next_cursor` of the previous page; empty: the first page (schema_extra of a Litestar parameter)
DELIVERY_CURSOR = {"type": "string", "oneOf": None, "pattern": f"^({ids.pattern(wire.DELIVERY_ID)})?$"}


class WebhooksController(Controller):
    path = "/lmsp/v1/webhooks"
    tags = ["webhooks"]

    @post(status_code=201, summary="Create a webhook endpoint", opt=_SCOPE,
          description="Events of the caller's tasks, background responses and batches are POSTed to `url`, signed "
                      "per Standard Webhooks with the endpoint's `secret`, which this answer alone carries. The "
                      "URL's host must resolve (`400 webhook_url_unresolved` otherwise) to global addresses (`400 "
                      "webhook_url_not_allowed` otherwise, unless the service allows private targets). `events`: "
                      "the types to send, of "
                      + ", ".join(f"`{name}`" for name in wire.EVENT_TYPES) + ".",
          responses={201: doc.ok(wire.WebhookEndpointWithSecret, "The endpoint, with its signing secret (shown once)",
                                 doc.example("Created", _CREATED)),
                     **doc.problems("invalid_request", "invalid_webhook_url", "webhook_url_unresolved",
                                    "webhook_url_not_allowed", "unknown_event_type", "too_many_webhooks",
                                    "service_unavailable", *doc.GUARDED)})
    async def create_webhook(
        self, data: Annotated[wire.WebhookCreate, Body(examples=[doc.example("Responses' ends", _CREATE)])],
        services: Services, owner: str,
    ) -> Response[wire.WebhookEndpointWithSecret]:
        events = checks.check_events(data.events)
        url = checks.check_url(data.url)
        try:  # as long as an attempt may take, at most
            async with asyncio.timeout(services.settings.webhook_timeout):
                await targets.resolve(url, services.settings.webhook_allow_private)
        except TimeoutError:
            raise targets.TargetUnresolved("The webhook URL's host does not resolve (in time).") from None
        record = await webhooks.create_endpoint(services.redis, owner, url, events, replicas=services.replicas)
        return Response(record.with_secret(), status_code=201, headers={"Location": f"{self.path}/{record.id}"})

    @get(summary="List webhook endpoints", opt=_SCOPE,
         description="The caller's endpoints, oldest first (without secrets).",
         responses={200: doc.ok(wire.WebhookEndpointList, "The endpoints",
                                doc.example("One endpoint", wire.WebhookEndpointList(data=[_ENDPOINT]))),
                    **doc.problems("invalid_request", "service_unavailable", *doc.GUARDED)})
    async def list_webhooks(self, services: Services, owner: str) -> wire.WebhookEndpointList:
        return wire.WebhookEndpointList(data=[record.to_wire()
                                              for record in await webhooks.list_endpoints(services.redis, owner)])

    @get("/{webhook_id:str}", summary="Get a webhook endpoint", opt=_SCOPE,
         description="The endpoint (without its secret).",
         responses={200: doc.ok(wire.WebhookEndpoint, "The endpoint", doc.example("An endpoint", _ENDPOINT)),
                    **doc.problems("invalid_request", "webhook_not_found", "service_unavailable", *doc.GUARDED)})
    async def get_webhook(self, webhook_id: str, services: Services, owner: str) -> wire.WebhookEndpoint:
        return (await load_endpoint(services, webhook_id, owner)).to_wire()

    @delete("/{webhook_id:str}", status_code=204, summary="Delete a webhook endpoint", opt=_SCOPE,
            description="The endpoint and its deliveries go; a pending delivery is never sent.",
            responses=doc.problems("invalid_request", "webhook_not_found", "service_unavailable", *doc.GUARDED))
    async def delete_webhook(self, webhook_id: str, services: Services, owner: str) -> None:
        if not await webhooks.delete_endpoint(services.redis, webhook_id, owner, replicas=services.replicas):
            raise _not_found(webhook_id)

    @get("/{webhook_id:str}/deliveries", summary="List an endpoint's deliveries", opt=_SCOPE,
         description="Its recent deliveries (kept 7 days after their last attempt, the newest 1000), newest first, "
                     "each with its attempts; `limit` per page (default 20, at most 100). When `has_more` is "
                     "true, pass `next_cursor` as `cursor` for the next page.",
         responses={200: doc.ok(wire.WebhookDeliveryList, "A page of deliveries, newest first",
                                doc.example("A page", wire.WebhookDeliveryList(data=[_DELIVERY]))),
                    **doc.problems("invalid_request", "invalid_cursor", "webhook_not_found", "service_unavailable",
                                   *doc.GUARDED)})
    async def list_deliveries(
        self, webhook_id: str, services: Services, owner: str,
        limit: Annotated[int, Parameter(ge=1, le=MAX_PAGE, description="deliveries per page")] = 20,
        cursor: Annotated[str | None, Parameter(description="`next_cursor` of the previous page",
                                                examples=[Example(value=DELIVERY_ID)],
                                                schema_extra=DELIVERY_CURSOR)] = None,
    ) -> wire.WebhookDeliveryList:
        endpoint = await load_endpoint(services, webhook_id, owner)
        records, more = await webhooks.list_deliveries(services.redis, endpoint.id, limit, cursor or None)
        return wire.WebhookDeliveryList(data=[record.to_wire() for record in records], has_more=more,
                                        next_cursor=records[-1].id if more and records else None)

    @post("/{webhook_id:str}/test", status_code=202, summary="Send a test event", opt=_SCOPE,
          description=f"Queues a `{wire.TEST_EVENT}` event (`data.id`: the endpoint's id) for the endpoint, whatever "
                      "it subscribes to, through the same queue as every event; answers its delivery, which "
                      "`/deliveries` then shows with its attempts.",
          responses={202: doc.ok(wire.WebhookDelivery, "The queued delivery", doc.example("Queued", _QUEUED)),
                     **doc.problems("invalid_request", "webhook_not_found", "service_unavailable", *doc.GUARDED)})
    async def test_webhook(self, webhook_id: str, services: Services, owner: str) -> Response[wire.WebhookDelivery]:
        endpoint = await load_endpoint(services, webhook_id, owner)
        delivery = await webhooks.get_delivery(services.redis, await webhooks.send_test(services.redis, endpoint))
        assert delivery is not None  # just created
        return Response(delivery.to_wire(), status_code=202)


async def load_endpoint(services: Services, webhook_id: str, owner: str) -> EndpointRecord:
    record = await webhooks.get_endpoint(services.redis, webhook_id, owner)
    if record is None:
        raise _not_found(webhook_id)
    return record


def _not_found(webhook_id: str) -> NotFound:
    return NotFound(f"Webhook endpoint {webhook_id[:100]!r} does not exist.", code="webhook_not_found")
