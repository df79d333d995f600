"""The promotion plan's layout of a one-group request (``chunk_run``, native)
equals the layout the general path computes from the same record, on random
records (``tests.unit.test_chunk_run``'s). About a second."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from vllm.v1.kv_offload.base import ReqContext

from nvmetier.vllm.cpu_view import POSITIONS_ATTR
from nvmetier.vllm.promotion import PromotionGuard
from tests.unit.test_chunk_run import model, records


@settings(max_examples=80, deadline=None)
@given(records())
def test_the_plans_one_group_layout_equals_the_general_path(
    record: tuple[dict[Any, Any], bytes, int],
) -> None:
    positions, suffix, tpc = record
    if len(suffix) != 4 or not all(isinstance(k, bytes) and len(k) >= 4 for k in positions):
        return  # offload keys end with their 4-byte group (make_offload_key)
    index = int.from_bytes(suffix, "big")
    guard = PromotionGuard(64, 1.0, groups=((index, tpc, None),))
    ctx = ReqContext(req_id="r")
    setattr(ctx, POSITIONS_ATTR, dict(positions))
    fast = guard._layout_one_group(ctx)
    general = guard._layout_of_groups(ctx)
    if fast is None:  # no record, or a key of another group: the general path's
        assert not positions or model(positions, suffix, tpc) is None
    else:
        assert [(g.index, g.tokens_per_chunk, g.window, g.keys) for g in fast] == [
            (g.index, g.tokens_per_chunk, g.window, g.keys) for g in general
        ]
