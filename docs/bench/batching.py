"""Do concurrent sessions share the target's passes, with and without the batch wait? Target-only
decoding of N requests at once, through one local cluster per ``--batch-wait-ms`` value (the
runs interleaved: every repeat runs each count through each cluster in turn); prints aggregate
tokens/s, median (min-max) over the repeats, and how many of the target's steps (a session's
part of a pass: a token, or a verified block) ran in passes of more than one (its WorkerInfo
counters); ``--out`` writes them as JSON. With ``--speculate`` the requests speculate with the
coordinator's defaults (the draft model, K adaptive) instead: a session's round trip then holds
its draft's call.

Usage, from the repository root:
  PYTHONPATH=. python docs/bench/batching.py TARGET DRAFT [--device cpu|cuda] [--dtype auto]
      [--sessions 1,2,4] [--waits 0,5] [--repeats 3] [--tokens 48] [--speculate] [--out FILE]
The numbers of docs/performance.md (One forward pass per block): on a CPU, a 4-layer, 512-wide random model of Qwen2.5's
shapes made by docs/bench/gpu/random_models.py from a config edited so, as both TARGET and DRAFT;
on a GPU (docs/bench/gpu/run.sh with BATCHING=1) the random models of the benchmark pair's shapes.
On a CPU every worker runs one torch thread and no --cpu-lock-file (a lock turns the wait off).
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import grpc

from specdec.tools.launch import LocalCluster, worker_info
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc


def _counts(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", type=Path)
    parser.add_argument("draft", type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--sessions", type=_counts, default=[1, 2, 4], help="requests at once, e.g. 1,2,4")
    parser.add_argument("--waits", type=_counts, default=[0, 5], help="--batch-wait-ms values, a cluster each")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48, help="new tokens a request")
    parser.add_argument("--speculate", action="store_true", help="the coordinator's default speculation")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    worker = ["--device", args.device, "--dtype", args.dtype]
    worker += ["--torch-threads", "1"] if args.device == "cpu" else []
    # (sessions, wait) -> each repeat's (tokens/s, steps in shared passes, steps)
    runs: dict[tuple[int, int], list[tuple[float, int, int]]] = {(n, w): [] for n in args.sessions for w in args.waits}
    with tempfile.TemporaryDirectory() as run, ExitStack() as stack:
        clusters = {}
        for wait in args.waits:
            workdir = Path(run) / f"wait-{wait}"
            workdir.mkdir()
            cluster = LocalCluster(
                str(args.target), str(args.draft), workdir,
                worker_args=[*worker, "--batch-wait-ms", str(wait)], startup_timeout_s=600,
                coordinator_args=[  # every request pays its prefill (no prefix reuse), as the benchmark's
                    "--prefix-block-tokens", "0", *([] if args.speculate else ["--num-speculative-tokens", "0"])
                ],
            )  # fmt: skip
            clusters[wait] = stack.enter_context(cluster)
        for _ in range(args.repeats):
            for n in args.sessions:
                for wait, cluster in clusters.items():
                    runs[n, wait].append(_run(cluster, n, args.tokens, args.speculate))
    report = []
    for (n, wait), repeats in runs.items():
        rates, shared, steps = (list(column) for column in zip(*repeats, strict=True))
        row = {"sessions": n, "batch_wait_ms": wait}
        report.append({**row, "tokens_per_s": rates, "shared_steps": shared, "steps": steps})
        sys.stdout.write(
            f"{n} sessions, --batch-wait-ms {wait}: {statistics.median(rates):.1f} tok/s "
            f"({min(rates):.1f}-{max(rates):.1f}), steps in shared passes {shared} of {steps}\n"
        )
    if args.out:
        meta = {"device": args.device, "dtype": args.dtype, "speculate": args.speculate}
        args.out.write_text(json.dumps({**meta, "runs": report}, indent=1))


def _run(cluster: LocalCluster, n: int, tokens: int, speculate: bool) -> tuple[float, int, int]:
    """Aggregate tokens/s of ``n`` requests at once (target-only unless ``speculate``), the
    target's steps in shared passes and its steps in all."""
    target = cluster.processes["target-0"].address
    before = worker_info(target, "target")
    requests = [
        coordinator_pb2.GenerateRequest(
            prompt_token_ids=common_pb2.TokenIds(ids=[100 + i + j for j in range(20)]),
            sampling=common_pb2.SamplingParams(max_new_tokens=tokens, ignore_eos=True),
            speculation=coordinator_pb2.SpeculationParams(disable=not speculate),
        )
        for i in range(n)
    ]
    with grpc.insecure_channel(cluster.address) as channel, ThreadPoolExecutor(n) as pool:
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        started = time.perf_counter()
        replies = list(pool.map(lambda r: stub.Generate(r, timeout=600), requests))
        seconds = time.perf_counter() - started
    after = worker_info(target, "target")
    steps = sum(r.stats.target_forward_passes for r in replies)
    return sum(len(r.token_ids) for r in replies) / seconds, after.batched_requests - before.batched_requests, steps


if __name__ == "__main__":
    main()
