"""Do concurrent sessions share the target's passes? Target-only decoding of N requests at once
through a local cluster; prints aggregate tokens/s and how many of the rows ran in passes of
more than one row (the target worker's WorkerInfo counters).

Usage, from the repository root: PYTHONPATH=. python docs/bench/batching.py TARGET DRAFT [--batch-wait-ms MS]
(the README's "How it goes fast" numbers: a 4-layer, 512-wide random model of Qwen2.5's shapes
made by docs/bench/gpu/random_models.py from a config edited so, as both TARGET and DRAFT).
"""

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from specdec.tools.launch import worker_info
from specdec.v1 import coordinator_pb2_grpc
from tests.clusters import fault_cluster
from tests.reference import make_request


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("target", type=Path)
    parser.add_argument("draft", type=Path)
    parser.add_argument("--batch-wait-ms", default="5")
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory() as run,
        fault_cluster(
            Path(run),
            args.target,
            args.draft,
            coordinator_args=["--num-speculative-tokens", "0"],
            worker_args=["--batch-wait-ms", args.batch_wait_ms],
        ) as cluster,
        grpc.insecure_channel(cluster.address) as channel,
    ):
        stub, target = coordinator_pb2_grpc.GenerationStub(channel), cluster.processes["target-0"].address
        for n in (1, 2, 4):
            before = worker_info(target, "target")
            requests = [
                make_request([100 + i + j for j in range(20)], k=0, max_new=args.tokens, ignore_eos=True)
                for i in range(n)
            ]
            started = time.perf_counter()
            with ThreadPoolExecutor(n) as pool:
                replies = list(pool.map(lambda r: stub.Generate(r, timeout=120), requests))
            seconds = time.perf_counter() - started
            after = worker_info(target, "target")
            tokens = sum(len(r.token_ids) for r in replies)
            shared = after.batched_requests - before.batched_requests
            rate = tokens / seconds
            sys.stdout.write(f"{n} sessions: {rate:.1f} tok/s, {shared} of {tokens} rows in shared passes\n")


if __name__ == "__main__":
    main()
