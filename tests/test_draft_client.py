"""How long the coordinator waits for a draft proposal."""

from __future__ import annotations

import pytest

from coordinator.settings import CoordinatorSettings
from coordinator.workers import DraftClient


@pytest.mark.asyncio
async def test_patience_stretches_for_a_busy_draft_but_not_below_the_timeout() -> None:
    settings = CoordinatorSettings(target_addresses=["127.0.0.1:1"])
    draft = DraftClient("127.0.0.1:1", settings, retry_s=1.0, timeout_s=2.0)
    try:
        assert draft.patience_s == 2.0  # nothing measured yet
        draft.observe_latency(0.1)
        assert draft.patience_s == 2.0  # a fast draft: the configured timeout
        for _ in range(30):
            draft.observe_latency(1.5)  # proposals queue behind other sessions' passes
        assert draft.patience_s == pytest.approx(4.5, rel=0.01)
    finally:
        await draft.close()
