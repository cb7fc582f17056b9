"""A separate process of racing committers (used by test_state_properties).

Usage: python -m tests.committer_proc REDIS_URL SESSION BASE N
Each task commits its own token with compare-and-set, then re-sends the same commit (as after a
lost reply). The re-send must never apply again: it reports ALREADY_APPLIED, or, when more than
RECENT_STEPS other commits came in between, a conflict. Prints "<applied> <already_applied>".
"""

from __future__ import annotations

import asyncio
import sys

from specdec.serving.errors import StateConflict
from specdec.state import Commit, CommitOutcome, open_store


async def main(url: str, session: str, base: int, n: int) -> None:
    store = open_store(url, ttl_s=60, lease_s=60, timeout_s=2)
    await store.start()

    async def committer(token: int) -> tuple[int, int]:
        while True:
            record = await store.get(session)
            assert record is not None
            commit = Commit(record.version, f"step-{token}", [token])
            try:
                first = await store.commit(session, "owner", commit)
            except StateConflict:
                await asyncio.sleep(0.001 * (token % 7))
                continue
            try:
                again = await store.commit(session, "owner", commit)  # a retry after a lost reply
            except StateConflict:
                return int(first.outcome is CommitOutcome.APPLIED), 0
            assert again.outcome is CommitOutcome.ALREADY_APPLIED
            return int(first.outcome is CommitOutcome.APPLIED), 1

    results = await asyncio.gather(*(committer(base + i) for i in range(n)))
    await store.close()
    sys.stdout.write(f"{sum(r[0] for r in results)} {sum(r[1] for r in results)}\n")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
