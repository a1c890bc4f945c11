"""One job's broker limits (``BrokerConfig``) and the bounds every part of the broker shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from service.settings import Settings

UNBOUNDED = 1 << 62
REPORT_FIELD_CAP = 2000  # characters of an error message, a report's text or a reason kept (and sent back)


@dataclass(frozen=True)
class BrokerConfig:
    """One job's broker settings: its limits (counts, bytes), timeouts and fairness group, fixed for its life.

    Attributes:
        max_calls: tool calls accepted for the job; later ones are refused without a record
            (``CallRecords.calls_over_limit``).
        max_line_bytes: the longest request line accepted (bytes); a longer one closes its connection.
        max_record_bytes: bytes of arguments and results the job's records may hold (JSON bytes); past it a record
            keeps its call but not its data (``*_dropped_bytes``).
        max_in_flight_bytes: bytes of the job's request lines handled at once; past it the broker stops reading.
        client_call_timeout_s: how long a client-executed call waits for its answer, for tools without
            ``timeout_s`` (s).
        approval_timeout_s: how long a call waits for approval, for tools without ``approval_timeout_s`` (s).
        max_pause_s: the longest any call waits for the harness, whatever its tool says (``PTC_MAX_PARK_S``, s).
        check_group: the fairness group of the job's checks (the API key that owns the job,
            ``CheckScheduler``); empty for a broker used alone.
    """

    max_calls: int
    max_line_bytes: int
    max_record_bytes: int
    max_in_flight_bytes: int = UNBOUNDED
    client_call_timeout_s: float = 270.0
    approval_timeout_s: float = 270.0
    max_pause_s: float = 7 * 86400.0
    check_group: str = ""

    @classmethod
    def from_settings(cls, settings: Settings, check_group: str) -> BrokerConfig:
        """The limits of a job owned by ``check_group`` (its API key), from ``PTC_MAX_TOOL_CALLS``,
        ``PTC_MAX_REQUEST_LINE_BYTES``, ``PTC_MAX_RECORD_BYTES``, ``PTC_MAX_CALL_BYTES_IN_FLIGHT``,
        ``PTC_CLIENT_CALL_TIMEOUT_S``, ``PTC_APPROVAL_TIMEOUT_S`` and ``PTC_MAX_PARK_S``."""
        return cls(
            max_calls=settings.max_tool_calls,
            max_line_bytes=settings.max_request_line_bytes,
            max_record_bytes=settings.max_record_bytes,
            max_in_flight_bytes=settings.max_call_bytes_in_flight,
            client_call_timeout_s=settings.client_call_timeout_s,
            approval_timeout_s=settings.approval_timeout_s,
            max_pause_s=settings.max_park_s,
            check_group=check_group,
        )
