"""A draft with another tokenizer, end to end over real processes: a tiny model with SmolLM2's
tokenizer drafts for a tiny model with Qwen2.5's (both know one text, tokenized differently: some
words are one token for one and two for the other). TLI and SLEM; greedy output equals HF
``generate`` on the target alone; sampled replies follow the target's exact distribution
(chi-square, as tests/test_exactness_production.py checks the workers' jobs)."""

from __future__ import annotations

import collections
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from transformers import PreTrainedTokenizerBase

from specdec.runtime.tokenizer import tokenizer_fingerprint
from specdec.tools.launch import LaunchError, LocalCluster, worker_info
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from tests.clusters import metric, wait_for
from tests.conftest import CLUSTER_COORDINATOR_ARGS, CLUSTER_WORKER_ARGS
from tests.forkserver import run_command
from tests.helpers import RedisServer, real_tokenizer
from tests.netproxy import LateLink
from tests.reference import coordinator_stub, make_request, reference_greedy, seeded_replies
from tests.spec_oracle import PASS_P, Enumerator, chi_square_pvalue, rejects
from tests.test_combinations import decode_random_mixes
from tests.tiny_models import build_text_bigram

# " warms" is one SmolLM2 token and two Qwen tokens; " fibonacci", " recursion" and " rollback"
# the other way round. The rest are one token in both.
TEXT = " the cat sat on a mat and warms fibonacci recursion with blue sky over green rollback hills"
MAX_NEW = 40
TRANSLATIONS = {"tli": common_pb2.VOCAB_TRANSLATION_TLI, "slem": common_pb2.VOCAB_TRANSLATION_SLEM}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedTokenizerBase, PreTrainedTokenizerBase]:
    """(target's, draft's): Qwen2.5's and SmolLM2's."""
    return real_tokenizer("qwen2.5-coder-0.5b", tmp_path_factory), real_tokenizer("smollm2-135m", tmp_path_factory)


@pytest.fixture(scope="module")
def pair(
    tmp_path_factory: pytest.TempPathFactory, tokenizers: tuple[PreTrainedTokenizerBase, PreTrainedTokenizerBase]
) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("cross-vocab-models")
    qwen, smollm = tokenizers
    target = build_text_bigram(root / "target", qwen, TEXT, seed=0, strength=8.0, noise=1.0)
    draft = build_text_bigram(root / "draft", smollm, TEXT, seed=1, strength=8.0, noise=1.0)
    return target, draft


@pytest.fixture(scope="module", params=["tli", "slem"])
def cluster(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    pair: tuple[Path, Path],
    redis_server: RedisServer,
) -> Iterator[tuple[LocalCluster, str]]:
    """The TLI cluster pipelines (the draft answers every request to draft ahead with "none")."""
    method = request.param
    target, draft = pair
    mode = ["--speculation-mode", "pipelined" if method == "tli" else "sequential"]
    cluster = LocalCluster(
        str(target), str(draft), tmp_path_factory.mktemp(f"cross-{method}"), worker_args=CLUSTER_WORKER_ARGS,
        draft_args=["--target-tokenizer", str(target), "--vocab-method", method],
        coordinator_args=[*CLUSTER_COORDINATOR_ARGS, "--state-url", redis_server.url, *mode], startup_timeout_s=180,
    )  # fmt: skip
    with cluster:
        yield cluster, method


def generate(cluster: LocalCluster, request: coordinator_pb2.GenerateRequest) -> coordinator_pb2.GenerateResponse:
    for stub in coordinator_stub(cluster):
        return stub.Generate(request, timeout=120)
    raise AssertionError("no stub")


PROMPTS = {
    "in-text": " the cat sat",
    "mid-word": " blue sky over green roll",  # the target's text continues inside a word
    "foreign": "Ein Satz 世界 𓀀 and the",  # tokens the models never saw, a character split over tokens
}


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "adaptive"])
@pytest.mark.parametrize("prompt", list(PROMPTS), ids=list(PROMPTS))
def test_greedy_output_is_the_target_s(
    cluster: tuple[LocalCluster, str],
    pair: tuple[Path, Path],
    tokenizers: tuple[PreTrainedTokenizerBase, PreTrainedTokenizerBase],
    prompt: str,
    fixed: bool,
) -> None:
    service, method = cluster
    ids = tokenizers[0].encode(PROMPTS[prompt])
    request = make_request(ids, k=4, max_new=MAX_NEW, fixed=fixed, ignore_eos=True)
    request.speculation.method = coordinator_pb2.DRAFT_METHOD_MODEL
    reply = generate(service, request)
    assert list(reply.token_ids) == reference_greedy(str(pair[0]), tuple(ids), MAX_NEW, True)
    s = reply.stats
    assert s.draft_tokens_accepted > 0 and s.rounds < MAX_NEW  # the draft's proposals saved target passes
    if method == "slem" and fixed:  # the draft knows the text; SLEM proposes its words in the target's tokens
        assert s.draft_tokens_accepted >= 0.7 * s.draft_tokens_proposed


def test_a_session_goes_on_across_turns(
    cluster: tuple[LocalCluster, str], pair: tuple[Path, Path], tokenizers: tuple[PreTrainedTokenizerBase, ...]
) -> None:
    """The draft's mirror of the session carries over to the next turn (a prefix it proves by hash)."""
    service, method = cluster
    qwen = tokenizers[0]
    session = f"cross-turns-{method}"
    first_prompt, second_prompt = qwen.encode(" the cat"), qwen.encode(" and the dog")
    first = generate(service, make_request(first_prompt, max_new=12, session_id=session, ignore_eos=True))
    second = generate(service, make_request(second_prompt, max_new=20, session_id=session, ignore_eos=True))
    history = (*first_prompt, *first.token_ids, *second_prompt)
    assert list(first.token_ids) == reference_greedy(str(pair[0]), tuple(first_prompt), 12, True)
    assert list(second.token_ids) == reference_greedy(str(pair[0]), history, 20, True)
    assert second.stats.draft_tokens_accepted > 0 and second.stats.cache_resyncs == 0


def test_sampled_requests_repeat_with_their_seed(cluster: tuple[LocalCluster, str]) -> None:
    service, _ = cluster
    request = make_request([279, 8251], k=3, max_new=24, ignore_eos=True, temperature=0.9, seed=11)
    first, again = generate(service, request), generate(service, request)
    assert list(first.token_ids) == list(again.token_ids) and len(first.token_ids) == 24
    assert first.stats.draft_tokens_proposed > 0


MIX_CASES = 10  # random mixes per translation: 14-16 s each on the 2-core host
# Seeds whose valid mixes hold greedy session turns, structured output, stop strings, penalties, logprobs
# and fixed-K model drafts (proposed whatever adaptive K would price).
MIX_SEEDS = {"tli": "tli-44", "slem": "slem-73"}


def test_random_feature_mixes_decode_as_the_target_alone(cluster: tuple[LocalCluster, str]) -> None:
    """The suite's random feature mixes (tests/test_combinations.py: stop strings and ids,
    min_tokens, penalties, logit bias, logprobs, prompt logprobs, structured output, drafting
    method, K, confidence stops, sessions of 2-3 turns, unary and stream calls) with the draft's
    proposals translated: each greedy reply equals the same request decoded with speculation
    disabled, and the translated model drafts are accepted inside the mixes."""
    service, method = cluster

    def accepted() -> float:
        return metric(service, "coordinator", "specdec_proposer_tokens_accepted_total", 'proposer="model"')

    before = accepted()
    with grpc.insecure_channel(service.address) as channel:
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        seen = decode_random_mixes(stub, random.Random(MIX_SEEDS[method]), MIX_CASES, f"cross-mix-{method}")
    assert seen.get("OK", 0) >= MIX_CASES, seen  # most mixes are valid: the comparison is not vacuous
    assert accepted() > before


SAMPLES = 1500  # seeded requests


@pytest.mark.slow
def test_sampled_replies_follow_the_target_distribution(
    cluster: tuple[LocalCluster, str], pair: tuple[Path, Path]
) -> None:
    """Through the whole service, with the draft's proposals translated into the target's tokens
    (TLI: pipelined; SLEM): the first three tokens of SAMPLES seeded replies follow the target's
    exact distribution (chi-square against an enumeration with plain forward passes), and reject
    that of a service that ignored the request's temperature (the power check). At temperature 3
    with top-k 4 the text's next token has about three chances in four: about two in three of the
    draft's translated proposals are accepted. Planted in the target worker by hand, a residual
    drawn from p after a rejection failed both (p = 8e-70 with TLI, 3e-116 with SLEM)."""
    service, _ = cluster
    enumerator = Enumerator(str(pair[0]), 3)
    prompt = enumerator.tokenizer.encode(PROMPTS["in-text"])
    asked = make_request(prompt, k=4, max_new=3, ignore_eos=True, temperature=3.0, top_k=4)
    asked.speculation.method = coordinator_pb2.DRAFT_METHOD_MODEL
    replies = seeded_replies(service.address, asked, SAMPLES)
    counts = collections.Counter(tuple(reply.token_ids[:3]) for reply in replies)
    proposed = sum(reply.stats.draft_tokens_proposed for reply in replies)
    accepted = sum(reply.stats.draft_tokens_accepted for reply in replies)
    assert 0.3 * proposed < accepted < 0.95 * proposed, (accepted, proposed)  # rejections decide tokens too
    assert chi_square_pvalue(counts, enumerator.distribution(tuple(prompt), asked.sampling), SAMPLES) > PASS_P
    assert rejects(counts, enumerator.distribution(tuple(prompt), asked.sampling, "the temperature ignored"))


def test_info_names_the_translation(
    cluster: tuple[LocalCluster, str], tokenizers: tuple[PreTrainedTokenizerBase, PreTrainedTokenizerBase]
) -> None:
    service, method = cluster
    for stub in coordinator_stub(service):
        assert stub.GetInfo(coordinator_pb2.GetInfoRequest()).draft_vocab_method == method
    info = worker_info(service.processes["draft"].address, "draft")
    qwen, smollm = tokenizers
    assert info.vocab_translation == TRANSLATIONS[method]
    assert info.tokenizer_hash == tokenizer_fingerprint(qwen)  # the ids it speaks: the target's
    assert info.model_tokenizer_hash == tokenizer_fingerprint(smollm)
    assert info.vocab_size == len(qwen) and 30_000 < info.shared_vocab_tokens < len(smollm)


def test_a_draft_of_another_tokenizer_needs_a_translation(tmp_path: Path, pair: tuple[Path, Path]) -> None:
    target, draft = pair
    cluster = LocalCluster(
        str(target), str(draft), tmp_path, worker_args=CLUSTER_WORKER_ARGS, coordinator_args=CLUSTER_COORDINATOR_ARGS,
        startup_timeout_s=120,
    )  # fmt: skip
    with pytest.raises(LaunchError, match="--target-tokenizer"), cluster:
        pass


def test_a_draft_of_another_tokenizer_that_joins_late_is_not_used(tmp_path: Path, pair: tuple[Path, Path]) -> None:
    """The same draft, unreachable until the coordinator has started without it: once it serves,
    the coordinator logs `draft_not_used` naming the fix and goes on without it (greedy output the
    target's, GetInfo without a draft) instead of drafting ids of another tokenizer."""
    target, draft = pair
    link = LateLink("draft")

    def refused(log: str) -> bool:
        return any("draft_not_used" in line and "--target-tokenizer" in line for line in log.splitlines())

    cluster = LocalCluster(
        str(target), str(draft), tmp_path, worker_args=CLUSTER_WORKER_ARGS, startup_timeout_s=120, route=link,
        coordinator_args=[*CLUSTER_COORDINATOR_ARGS, "--draft-startup-wait-s", "2"],
    )  # fmt: skip
    with link, cluster, grpc.insecure_channel(cluster.address) as channel:
        link.come_up()
        wait_for(lambda: refused(cluster.processes["coordinator"].log_tail(200)), 30, 0.2)
        stub = coordinator_pb2_grpc.GenerationStub(channel)
        assert stub.GetInfo(coordinator_pb2.GetInfoRequest()).draft_model_id == ""
        reply = stub.Generate(make_request([5, 17, 99, 3], k=4, max_new=8, ignore_eos=True))
        assert list(reply.token_ids) == reference_greedy(str(target), (5, 17, 99, 3), 8, ignore_eos=True)
        assert reply.stats.draft_tokens_proposed == reply.stats.lookup_tokens_proposed
        assert worker_info(cluster.processes["draft"].address, "draft").prefill_tokens_total == 0


def test_bench_measures_drafts_of_another_tokenizer(pair: tuple[Path, Path], tmp_path: Path) -> None:
    """`specdec bench --cross-draft-model`: TLI and SLEM rows, fixed K and the adaptive default,
    with their ratios to target-only and to the same-family draft's default."""
    import json

    target, draft = pair
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(" the cat sat\n---\n blue sky over green roll\n")
    out = tmp_path / "bench.json"
    rows = [
        "hf target-only", "service target-only", "service default (hybrid, adaptive)", "service cross-tli model K",
        "service cross-tli default", "service cross-slem model K", "service cross-slem default",
    ]  # fmt: skip
    args = [
        "bench", "--model", str(target), "--draft-model", str(target), "--cross-draft-model", str(draft),
        "--prompts", str(prompts), "--max-new-tokens", "24", "--repeats", "1", "--concurrency", "",
        *(arg for row in rows for arg in ("--method", row)), "--no-plots", "--out", str(out),
    ]  # fmt: skip
    done = run_command(args, 600)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())["workloads"]["file"]
    assert list(data["methods"]) == rows
    identical = data["greedy_tokens_identical"]
    assert identical.pop("reference") == "hf target-only" and all(identical.values())
    for row in rows[3:]:
        assert data["methods"][row]["acceptance_rate"] > 0, row
    for name in ("cross-tli default", "cross-slem default"):
        assert {f"{name} / service target-only", f"worst prompt: {name} / service target-only",
                f"{name} / default (same-family draft)"} <= set(data["ratios"])  # fmt: skip
