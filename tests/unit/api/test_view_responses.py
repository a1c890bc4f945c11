"""How a view is answered: a small one whole (one body message, no streaming task group), a large one in slices."""

from __future__ import annotations

from fastapi.responses import StreamingResponse

from service.api.responses import WHOLE_BYTES, view_response
from service.views.render import BATCH_BYTES


def test_a_small_view_is_sent_whole_with_its_length() -> None:
    body = b'{"job_id": "job_1", "status": "succeeded"}'
    response = view_response(body, 202, {"Location": "/jobs/job_1"})
    assert not isinstance(response, StreamingResponse)
    assert response.body == body and response.status_code == 202
    assert response.headers["content-length"] == str(len(body)) and response.headers["location"] == "/jobs/job_1"
    assert response.media_type == "application/json"


def test_a_large_view_is_streamed_in_slices_with_its_length() -> None:
    body = b"x" * (WHOLE_BYTES + 1)
    response = view_response(body)
    assert isinstance(response, StreamingResponse)
    assert response.headers["content-length"] == str(len(body))
    assert WHOLE_BYTES <= BATCH_BYTES
