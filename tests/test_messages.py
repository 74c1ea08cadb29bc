"""The protocol's declarations (`proto/messages.py`): each op's request and reply."""

from __future__ import annotations

import errno

import pytest

from mxfs.fs.fields import BadField, check_fields
from mxfs.proto import BY_NAME, OPS
from mxfs.proto.messages import COMMIT, KV_GET, LAYOUT, STAT

pytestmark = pytest.mark.unit


def test_every_op_declares_its_request_and_reply_once() -> None:
    assert list(BY_NAME) == list(OPS) and len(set(OPS)) == len(OPS)
    for name, op in BY_NAME.items():
        assert op.name == name
        assert not op.fields & {"op", "id"}, name  # the envelope is not an op's
        assert not op.answers & {"ok", "id", "errno", "error"}, name


def test_a_field_the_op_does_not_take_is_refused_naming_it_and_what_it_takes() -> None:
    check_fields({"op": "layout", "id": 1, "path": "/f"}, LAYOUT)  # the envelope is fine
    with pytest.raises(BadField) as e:
        check_fields({"op": "layout", "id": 1, "path": "/f", "pth": "/g"}, LAYOUT)
    assert e.value.errno == errno.EINVAL
    assert "'pth'" in str(e.value) and "path" in str(e.value)
    with pytest.raises(BadField) as e:
        check_fields({"op": "stat", "x" * 10_000: 1}, STAT)
    assert len(str(e.value)) < 400 and "no fields" in str(e.value)


def test_a_reply_straying_from_its_declaration_is_told() -> None:
    good = {"ino": 2, "size": 0, "generation": 1, "mode": 0o644, "sealed": True}
    assert COMMIT.stray(good) is None
    assert COMMIT.stray({**good, "layout": {}}) is None  # (optional)
    assert "undeclared ['seald']" in str(COMMIT.stray({**good, "seald": True}))
    missing = {k: v for k, v in good.items() if k != "generation"}
    assert "missing ['generation']" in str(COMMIT.stray(missing))


def test_an_op_called_makes_a_typed_request_of_it() -> None:
    req = KV_GET({"keys": ["a2V5"], "pin": True})
    assert req.op is KV_GET and req.fields == {"keys": ["a2V5"], "pin": True}
    assert STAT().fields == {}
