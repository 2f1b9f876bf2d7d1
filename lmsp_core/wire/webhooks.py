"""Webhook wire types: the events the service sends (OpenAI's webhook event objects, signed per
Standard Webhooks) and the objects of ``/lmsp/v1/webhooks`` (docs/protocol.md, "Webhooks")."""

from typing import Annotated, Literal

from msgspec import Meta, Struct

# what a background response's end sends (OpenAI's names; data: {"id": response id})
RESPONSE_EVENTS = ("response.completed", "response.failed", "response.cancelled", "response.incomplete")
# what an LMSP task's end sends (data: {"id": task id, "response_id": ...})
TASK_EVENTS = ("task.completed", "task.failed", "task.cancelled", "task.incomplete")
# what a batch's end sends (OpenAI's names; data: {"id": batch id})
BATCH_EVENTS = ("batch.completed", "batch.failed", "batch.cancelled", "batch.expired")
EVENT_TYPES = (*RESPONSE_EVENTS, *TASK_EVENTS, *BATCH_EVENTS)  # what an endpoint may subscribe to
TEST_EVENT = "webhook.test"  # sent on request (POST .../test) to one endpoint, whatever it subscribes to

WEBHOOK_ID = "wh"
EVENT_ID = "evt"
DELIVERY_ID = "dlv"
SECRET_PREFIX = "whsec_"

MAX_URL_LENGTH = 2048
DeliveryStatus = Literal["pending", "delivered", "failed"]


class WebhookEvent(Struct, frozen=True, kw_only=True):
    """The body of a delivery, as OpenAI's webhook events are shaped (``openai.types.webhooks``)."""

    id: str  # also the ``webhook-id`` header: the same on every retry and duplicate
    type: str
    created_at: int  # when what the event reports happened (a task's end), Unix seconds
    data: dict[str, str]
    object: Literal["event"] = "event"


class WebhookCreate(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``POST /lmsp/v1/webhooks``: where to send which events."""

    url: Annotated[str, Meta(min_length=1, max_length=MAX_URL_LENGTH)]
    # checked by the handler, each against EVENT_TYPES (unknown_event_type)
    events: Annotated[list[str], Meta(min_length=1, max_length=len(EVENT_TYPES))]


class WebhookEndpoint(Struct, frozen=True, kw_only=True):
    id: str
    url: str
    events: list[str]
    created_at: int
    object: Literal["webhook_endpoint"] = "webhook_endpoint"


class WebhookEndpointWithSecret(WebhookEndpoint, frozen=True, kw_only=True):
    """The endpoint as created: the only answer that carries its signing secret."""

    secret: str


class WebhookEndpointList(Struct, frozen=True, kw_only=True):
    object: Literal["list"] = "list"
    data: list[WebhookEndpoint]


class WebhookAttempt(Struct, frozen=True, kw_only=True):
    """One try of a delivery: when, how long it took, the receiver's status or what went wrong."""

    attempted_at: float
    duration_ms: int
    status_code: int | None  # None: no answer (refused target, connection error, timeout)
    error: str | None  # None: the receiver answered 2xx


class WebhookDelivery(Struct, frozen=True, kw_only=True):
    id: str
    endpoint_id: str
    event_id: str
    event_type: str
    status: DeliveryStatus
    created_at: int
    next_attempt_at: int | None  # while pending
    attempts: list[WebhookAttempt]
    object: Literal["webhook_delivery"] = "webhook_delivery"


class WebhookDeliveryList(Struct, frozen=True, kw_only=True):
    """A page of an endpoint's deliveries, newest first; ``next_cursor`` asks for the next page."""

    object: Literal["list"] = "list"
    data: list[WebhookDelivery]
    has_more: bool = False
    next_cursor: str | None = None
