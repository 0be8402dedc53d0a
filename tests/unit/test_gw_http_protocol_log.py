"""uvicorn's client-fault warnings are rate-limited: a client sending garbage cannot flood
the gateway's log (sal_gateway.http_protocol.ClientFaultLogLimit)."""

from __future__ import annotations

import logging

import pytest

from sal_gateway.http_protocol import ClientFaultLogLimit, limit_client_fault_logs


def _record(msg: str) -> logging.LogRecord:
    return logging.LogRecord("uvicorn.error", logging.WARNING, __file__, 1, msg, None, None)


def test_one_client_fault_warning_per_interval_then_the_count_of_dropped_ones() -> None:
    now = [0.0]
    limit = ClientFaultLogLimit(every_s=10.0, clock=lambda: now[0])
    passed = [limit.filter(_record("Invalid HTTP request received.")) for _ in range(500)]
    assert passed.count(True) == 1
    now[0] = 10.5
    record = _record("Invalid HTTP request received.")
    assert limit.filter(record)
    assert record.getMessage() == "Invalid HTTP request received. (499 similar since last logged)"
    # Other messages are never held back.
    assert all(limit.filter(_record("Application startup complete.")) for _ in range(5))


def test_installed_once_on_uvicorns_logger(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test-uvicorn-error")
    limit_client_fault_logs(logger)
    limit_client_fault_logs(logger)
    assert sum(isinstance(f, ClientFaultLogLimit) for f in logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger="test-uvicorn-error"):
        for _ in range(100):
            logger.warning("Invalid HTTP request received.")
    assert len(caplog.records) == 1
