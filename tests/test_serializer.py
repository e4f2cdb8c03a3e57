"""The RQ serializer is JSON only: a pickled payload is refused, never loaded."""

from __future__ import annotations

import pickle

import pytest

from shared.errors import PayloadError
from shared.serializer import serializer


def test_round_trip() -> None:
    data = ["worker.jobs.run_decision", None, [{"custom_id": "a"}], {}]
    assert serializer.loads(serializer.dumps(data)) == data


def test_pickle_refused() -> None:
    evil = pickle.dumps(("os.system", None, ("touch /tmp/pwned",), {}))
    with pytest.raises(PayloadError, match="pickled"):
        serializer.loads(evil)


def test_garbage_refused() -> None:
    with pytest.raises(PayloadError, match="not valid JSON"):
        serializer.loads(b"\x00\x01garbage")
