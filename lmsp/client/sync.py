"""The blocking client: ``Client(url, token=...)`` with ``responses``, ``tasks``, ``models``, and
OpenAI's ``files`` and ``batches``."""

import time
from collections.abc import Generator, Iterator
from contextlib import closing
from types import TracebackType
from typing import Any

import httpx
from httpx_sse import connect_sse

from lmsp.client import batches, common
from lmsp.client.batches import Batch, BatchList, BatchResult, FileObject, FileSource, Progress
from lmsp.client.common import Event, EventDecoder, Form, InputLike, Reconnects
from lmsp.client.errors import APIConnectionError, APIStatusError, EventHistoryExpired, StreamError, status_error
from lmsp_core import wire


class Client:
    """``url`` defaults to ``$LMSP_URL`` or http://127.0.0.1:8000, ``token`` to ``$LMSP_TOKEN``."""

    def __init__(self, url: str | None = None, *, token: str | None = None,
                 timeout: httpx.Timeout | float = common.DEFAULT_TIMEOUT) -> None:
        self.config = common.Config.create(url, token)
        self.http = httpx.Client(base_url=self.config.url, headers=self.config.headers, timeout=timeout)
        self.responses = Responses(self)
        self.tasks = Tasks(self)
        self.models = Models(self)
        self.files = Files(self)
        self.batches = Batches(self)

    def request(self, method: str, path: str, *, content: bytes | None = None,
                params: dict[str, Any] | None = None, form: Form | None = None) -> bytes:
        """``content`` is a JSON body; ``form`` a multipart one (``files``, ``data``)."""
        headers = {"Content-Type": "application/json"} if content is not None else None
        files, data = form or (None, None)
        try:
            response = self.http.request(method, path, content=content, params=params, headers=headers,
                                          files=files, data=data)
        except httpx.TransportError as exc:
            raise APIConnectionError(f"{method} {path}: {exc!r}") from exc
        if response.status_code >= 400:
            raise status_error(response.status_code, response.headers, response.content)
        return response.content

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class Responses:
    def __init__(self, client: Client) -> None:
        self._client = client

    def create(self, *, model: str, input: InputLike, **options: Any) -> wire.Response:
        """A synchronous response (6.2). Options are the request's other fields (``max_output_tokens``,
        ``temperature``, ``previous_response_id``, ...)."""
        body = common.request_body(model, input, **options, stream=False)
        result: wire.Response = common.decode(self._client.request("POST", "/lmsp/v1/responses", content=body),
                                              wire.Response)
        return result

    def stream(self, *, model: str, input: InputLike, **options: Any) -> "ResponseStream":
        """A streamed response (6.3): iterate over the events. A direct stream belongs to its
        connection and cannot be resumed; use ``tasks`` for that."""
        return ResponseStream(self._client, common.request_body(model, input, **options, stream=True))


class ResponseStream:
    """Iterate for events; ``text`` is the text so far, ``final`` the final event once received."""

    def __init__(self, client: Client, body: bytes) -> None:
        self._client = client
        self._body = body
        self.text = ""
        self.final: Event | None = None
        self._events: Generator[Event, None, None] | None = None

    def __iter__(self) -> Generator[Event, None, None]:
        self._events = self._read()  # kept, so that leaving ``with`` hangs up at once
        return self._events

    def _read(self) -> Generator[Event, None, None]:
        decoder = EventDecoder()
        headers = {"Content-Type": "application/json"}
        try:
            with connect_sse(self._client.http, "POST", "/lmsp/v1/responses", content=self._body,
                             headers=headers) as source:
                if source.response.status_code >= 400:
                    source.response.read()
                    raise status_error(source.response.status_code, source.response.headers,
                                       source.response.content)
                for sse in source.iter_sse():
                    if (event := common.checked_event(decoder, sse)) is None:
                        continue
                    self.text += event.delta
                    yield event
                    if event.final:
                        self.final = event
                        return
        except httpx.TransportError as exc:
            raise APIConnectionError(f"the response stream broke: {exc!r}") from exc
        raise APIConnectionError("the response stream ended before its final event")

    def __enter__(self) -> "ResponseStream":
        return self

    def __exit__(self, *exc: object) -> None:
        if self._events is not None:
            self._events.close()


class Tasks:
    def __init__(self, client: Client) -> None:
        self._client = client

    def create(self, *, model: str, input: InputLike, **options: Any) -> wire.Task:
        body = common.request_body(model, input, **options)
        task: wire.Task = common.decode(self._client.request("POST", "/lmsp/v1/tasks", content=body), wire.Task)
        return task

    def get(self, task_id: str) -> wire.Task:
        task: wire.Task = common.decode(self._client.request("GET", f"/lmsp/v1/tasks/{task_id}"), wire.Task)
        return task

    def cancel(self, task_id: str) -> wire.Task:
        task: wire.Task = common.decode(self._client.request("POST", f"/lmsp/v1/tasks/{task_id}/cancel"),
                                        wire.Task)
        return task

    def list(self, *, limit: int = 20, cursor: str | None = None) -> wire.TaskList:
        params: dict[str, Any] = {"limit": limit} | ({"cursor": cursor} if cursor else {})
        page: wire.TaskList = common.decode(self._client.request("GET", "/lmsp/v1/tasks", params=params),
                                            wire.TaskList)
        return page

    def events(self, task_id: str, *, after: int = 0, reconnects: Reconnects | None = None,
               queue_events: bool = False) -> "TaskEvents":
        """The task's events after ``after``, reconnecting with ``Last-Event-ID`` when the connection
        drops; on ``410 event_history_expired`` the iteration ends and ``task`` holds the result.
        With ``queue_events`` a waiting task's queue position comes as ``task.queued`` events (their
        ``id`` is None), else the service sends it as comments, which the iteration does not show."""
        return TaskEvents(self._client, task_id, after, reconnects or Reconnects(), queue_events)


class TaskEvents:
    """An iterator over a task's events that survives dropped connections.

    ``last_event_id`` is the resume cursor, ``reconnects`` the policy (its ``total`` counts the
    reconnections), ``text`` the text received. ``expired`` is True when the events were past
    retention: then ``task`` is the final task, fetched instead (6.4)."""

    def __init__(self, client: Client, task_id: str, after: int, reconnects: Reconnects,
                 queue_events: bool = False) -> None:
        self._client = client
        self.task_id = task_id
        self.queue_events = queue_events
        self._decoder = EventDecoder(after)
        self.reconnects = reconnects
        self.text = ""
        self.expired = False
        self.task: wire.Task | None = None

    @property
    def last_event_id(self) -> int:
        return self._decoder.cursor

    def __iter__(self) -> Iterator[Event]:
        while True:
            try:
                with closing(self._connection()) as events:
                    for event in events:
                        self.text += event.delta
                        yield event
                        if event.final:
                            return
            except EventHistoryExpired:
                self.expired = True
                self.task = self._client.tasks.get(self.task_id)
                return
            except StreamError as exc:
                if exc.problem.status not in common.RESUMABLE_STATUSES:
                    raise
                cause: BaseException = exc
            except (httpx.TransportError, common.Retry) as exc:
                cause = exc
            else:
                cause = APIConnectionError("the stream ended before the final event")
            delay = self.reconnects.next_delay()
            if delay is None:
                raise APIConnectionError(f"task {self.task_id}: the event stream kept failing") from cause
            time.sleep(delay)

    def _connection(self) -> Generator[Event, None, None]:
        url = f"/lmsp/v1/tasks/{self.task_id}/events"
        headers = common.resume_headers(self.last_event_id)
        params = common.queue_params(self.queue_events)
        with connect_sse(self._client.http, "GET", url, headers=headers, params=params) as source:
            response = source.response
            if response.status_code >= 400:
                response.read()
                raise common.connect_error(status_error(response.status_code, response.headers, response.content))
            for sse in source.iter_sse():
                if (event := common.checked_event(self._decoder, sse)) is None:
                    continue
                if event.id is not None:
                    self.reconnects.progressed()
                yield event


class Models:
    def __init__(self, client: Client) -> None:
        self._client = client

    def list(self) -> wire.ModelList:
        models: wire.ModelList = common.decode(self._client.request("GET", "/lmsp/v1/models"), wire.ModelList)
        return models

    def get(self, model_id: str) -> wire.ModelObject:
        model: wire.ModelObject = common.decode(self._client.request("GET", f"/lmsp/v1/models/{model_id}"),
                                                wire.ModelObject)
        return model


class Files:
    """OpenAI's Files API (``/v1/files``): the input and output files of batches."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def upload(self, source: FileSource, *, purpose: str = "batch", filename: str | None = None) -> FileObject:
        """Upload a file's content (a path, or bytes named ``filename``)."""
        form = batches.upload_form(source, purpose, filename)
        uploaded: FileObject = common.decode(self._client.request("POST", batches.FILES, form=form), FileObject)
        return uploaded

    def get(self, file_id: str) -> FileObject:
        found: FileObject = common.decode(self._client.request("GET", batches.file_path(file_id)), FileObject)
        return found

    def content(self, file_id: str) -> bytes:
        return self._client.request("GET", f"{batches.file_path(file_id)}/content")

    def delete(self, file_id: str) -> None:
        self._client.request("DELETE", batches.file_path(file_id))


class Batches:
    """OpenAI's Batch API (``/v1/batches``): many requests from one JSONL file, run as tasks."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def create(self, *, input_file_id: str, endpoint: str, completion_window: str = "24h",
               metadata: dict[str, str] | None = None) -> Batch:
        body = batches.create_body(input_file_id, endpoint, completion_window, metadata)
        return self._batch(self._client.request("POST", batches.BATCHES, content=body))

    def get(self, batch_id: str) -> Batch:
        return self._batch(self._client.request("GET", batches.batch_path(batch_id)))

    def cancel(self, batch_id: str) -> Batch:
        return self._batch(self._client.request("POST", f"{batches.batch_path(batch_id)}/cancel"))

    def list(self, *, limit: int = 20, after: str | None = None) -> BatchList:
        """The caller's batches, newest first; ``after`` is the last id of the previous page."""
        raw = self._client.request("GET", batches.BATCHES, params=batches.list_params(limit, after))
        page: BatchList = common.decode(raw, BatchList)
        return page

    def wait(self, batch_id: str, *, poll: float = 1.0, on_progress: Progress | None = None) -> Batch:
        """Poll the batch every ``poll`` seconds until it ends; ``on_progress`` gets it at each change."""
        watch = batches.Watch(on_progress)
        while True:
            try:
                batch = self.get(batch_id)
            except (APIConnectionError, APIStatusError) as exc:
                time.sleep(watch.failed(exc))
                continue
            if watch.seen(batch):
                return batch
            time.sleep(poll)

    def results(self, batch: Batch) -> BatchResult:
        """The batch with the content of its output and error files (``b""`` for one it has not)."""
        files = self._client.files
        output = files.content(batch.output_file_id) if batch.output_file_id else b""
        errors = files.content(batch.error_file_id) if batch.error_file_id else b""
        return BatchResult(batch, output, errors)

    def run(self, source: FileSource, *, endpoint: str, completion_window: str = "24h",
            metadata: dict[str, str] | None = None, poll: float = 1.0,
            on_progress: Progress | None = None) -> BatchResult:
        """Upload ``source`` (a JSONL path or bytes), run it as a batch, wait for the end and download
        what it wrote."""
        uploaded = self._client.files.upload(source, purpose="batch")
        batch = self.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window=completion_window,
                            metadata=metadata)
        return self.results(self.wait(batch.id, poll=poll, on_progress=on_progress))

    @staticmethod
    def _batch(raw: bytes) -> Batch:
        batch: Batch = common.decode(raw, Batch)
        return batch
