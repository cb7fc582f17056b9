"""WorkerCore: a job abandoned by its caller leaves no cache behind when it made one; a grammar's
compile and who waits for it; the CPU threads a worker takes."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import threading
import time
import types
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from transformers import LlamaForCausalLM

from specdec.runtime import startup
from specdec.runtime.grammar import grammar_of
from specdec.runtime.kvcache import WARM_UP_PREFIX_TOKENS, SessionCaches
from specdec.runtime.modeling import LoadOptions, load_model
from specdec.runtime.scheduler import Extend, Job
from specdec.serving.server import ServerControl
from specdec.serving.settings import ModelWorkerSettings
from specdec.serving.worker import DRAFT_GRAMMAR_WAIT_S, WorkerCore
from specdec.v1 import common_pb2
from tests.tiny_models import TinyModels


def _job(core: WorkerCore, session: str, started: threading.Event | None = None) -> Job[None]:
    """A job as the workers' jobs begin: it makes the session's cache, then runs steps."""
    entry = core.caches.sync(session, 0, 0)
    if started is not None:
        started.set()
    for token in range(3, 40):
        yield Extend(entry, [token] * 8, 1)


async def _abandon(core: WorkerCore, session: str) -> None:
    """Starts a job, waits until it has made its cache, then cancels it (its caller left)."""
    started = threading.Event()
    task = asyncio.create_task(core.run(session, lambda: _job(core, session, started)))
    assert await asyncio.to_thread(started.wait, 30)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def test_a_job_that_made_the_cache_and_was_abandoned_frees_it(tiny_models: TinyModels) -> None:
    """The coordinator releases a finished turn's caches while a late request of that turn (sent
    before, arriving after) is still to start: the late request makes a fresh cache, then its
    cancellation arrives. That cache must go too, not linger until the idle timeout."""

    async def scenario() -> tuple[bool, bool]:
        core = WorkerCore(ModelWorkerSettings(model=str(tiny_models.target), device="cpu"), ServerControl(),
                          CollectorRegistry())  # fmt: skip
        await core.load()
        try:
            await core.release("late")  # the release overtakes the request
            await _abandon(core, "late")
            # a cache that existed before the abandoned job is the session's own: it stays
            await core.run("kept", lambda: _job(core, "kept"))
            await _abandon(core, "kept")
            await core.call(lambda: None)  # the model thread has run what was queued before
            return "late" in core.caches, "kept" in core.caches
        finally:
            core.close()

    late, kept = asyncio.run(scenario())
    assert not late and kept


def test_callers_of_a_grammar_share_its_compile_and_a_draft_does_not_wait_for_it(
    tiny_models: TinyModels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large schema compiles for seconds under load (a 3,000-property one: 0.9 s on the CI host).
    A draft's proposal waited for it, past the coordinator's patience with the draft (2 s by
    default: a draft_unavailable warning, and speculation off for every session for
    --draft-retry-s). The draft now waits at most DRAFT_GRAMMAR_WAIT_S and proposes unmasked (its
    masks only raise acceptance) while the compile goes on; the target waits for it (its masks
    make the output exact), and callers asking for the same grammar meanwhile share one compile."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}
    grammar = grammar_of(common_pb2.StructuredOutput(json_schema=json.dumps(schema)))
    compiles: list[str] = []

    async def scenario() -> tuple[bool, float, list[bool], bool]:
        core = WorkerCore(ModelWorkerSettings(model=str(tiny_models.target), device="cpu"), ServerControl(),
                          CollectorRegistry())  # fmt: skip
        await core.load()
        masks = core.loaded.grammar
        assert masks is not None
        compile_once = masks.compile
        monkeypatch.setattr(masks, "compile", lambda text: compiles.append(text) or compile_once(text))
        try:
            began = time.perf_counter()
            drafted_masked = await core.prepare_grammar(grammar)  # the draft's proposal
            waited = time.perf_counter() - began
            verified = await asyncio.gather(*(core.prepare_grammar(grammar, required=True) for _ in range(2)))
            return drafted_masked, waited, verified, await core.prepare_grammar(grammar)
        finally:
            core.close()

    drafted_masked, waited, verified, next_round_masked = asyncio.run(scenario())
    assert not drafted_masked and waited < DRAFT_GRAMMAR_WAIT_S + 0.4, waited
    assert verified == [True, True] and next_round_masked
    assert compiles == [grammar]


@pytest.mark.parametrize(
    ("proc_cgroup", "files", "expected"),
    [
        ("0::/\n", {"cpu.max": "200000 100000\n"}, 2),  # cgroup v2, a container's own namespace
        ("0::/kubepods/pod1/c1\n", {"kubepods/pod1/c1/cpu.max": "150000 100000\n"}, 1),  # 1.5 CPUs: 1
        ("0::/\n", {"cpu.max": "max 100000\n"}, None),  # no limit
        ("0::/\n", {"cpu.max": "50000 100000\n"}, 1),  # half a CPU: still one thread
        (
            "3:cpu,cpuacct:/docker/c2\n",
            {"cpu/docker/c2/cpu.cfs_quota_us": "400000\n", "cpu/docker/c2/cpu.cfs_period_us": "100000\n"},
            4,
        ),
        ("3:cpu,cpuacct:/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # v1, none
        ("0::/\n", {}, None),  # nothing readable
        ("3:cpu,cpuacct:/docker/c3\n", {"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3),
    ],
)
def test_the_cpu_quota_of_a_container_is_read(
    tmp_path: Path, proc_cgroup: str, files: dict[str, str], expected: int | None
) -> None:
    """A CPU limit (a Kubernetes pod's `limits.cpu`) is a cgroup quota, which torch does not see:
    with `--torch-threads 0` a worker took torch's default, the host's cores, and a CPU worker
    on a large node ran many times more threads than its quota lets run."""
    from specdec.serving.worker import cpu_quota

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpu_quota(proc_cgroup, tmp_path) == expected


@pytest.mark.parametrize(("widths", "max_draft", "widest"), [(17, 64, 17), (17, 4, 5), (0, 64, 0)])
def test_the_worker_runs_each_block_width_once_before_it_serves(
    tiny_models: TinyModels, monkeypatch: pytest.MonkeyPatch, widths: int, max_draft: int, widest: int
) -> None:
    """A model's first pass of a width pays one-time costs (the tiny target on CPU: 4.5-6 ms, then
    2.2 ms each, from the second request on as well), and the coordinator times target-only
    decoding only by target-only rounds, with a good draft its first turn's second round alone:
    that one cost stood for a one-token pass, 2x too dear. The worker runs a pass of every width
    up to --warm-up-widths over a short cache at start-up (no wider than the widest verify pass,
    --max-draft-tokens + 1), keeping each width's rows of logits as a verify pass does, then drops
    the cache: no session, no tokens counted as computed."""
    passes: list[tuple[int, int]] = []  # (tokens in the pass, tokens in the cache before it)
    forward = LlamaForCausalLM.forward

    @functools.wraps(forward)
    def recording(self: LlamaForCausalLM, *args: object, **kwargs: object) -> object:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        before = cache.get_seq_length() if cache is not None else 0  # type: ignore[attr-defined]
        passes.append((kwargs["input_ids"].shape[-1], before))  # type: ignore[union-attr]
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "forward", recording)

    async def scenario() -> tuple[int, int]:
        settings = ModelWorkerSettings(
            model=str(tiny_models.target), device="cpu", warm_up_widths=widths, max_draft_tokens=max_draft
        )
        core = WorkerCore(settings, ServerControl(), CollectorRegistry())
        await core.load()
        try:
            return len(core.caches), core.caches.prefill_tokens_total
        finally:
            core.close()

    assert asyncio.run(scenario()) == (0, 0)
    over_a_cache = {tokens for tokens, before in passes if before > 0 and tokens <= widths}
    assert over_a_cache == set(range(1, widest + 1)), passes
    # the prefill rates' probe takes no first pass of its own after the start-up passes took it
    firsts = [tokens for tokens, before in passes if before == 0 and tokens == WARM_UP_PREFIX_TOKENS]
    assert len(firsts) == 1, passes


@pytest.mark.parametrize(
    ("first_s", "later_s", "widths_run", "width_one_passes"),
    [
        (0.30, 0.29, {1}, 2),  # slow passes, a first no dearer: width 1 timed twice, then no more
        (0.60, 0.30, set(range(1, 9)), 2),  # slow passes, a first dearer: timed twice, then every width
        (0.03, 0.03, set(range(1, 9)), 1),  # fast passes (a GPU, a small model): every width, width 1 once
        (0.006, 0.002, set(range(1, 9)), 1),  # the tiny target on CPU: every width
    ],
)
def test_the_start_up_passes_stop_where_a_first_pass_costs_no_more_than_later_ones(
    tiny_models: TinyModels,
    monkeypatch: pytest.MonkeyPatch,
    first_s: float,
    later_s: float,
    widths_run: set[int],
    width_one_passes: int,
) -> None:
    """One-time costs of a width's first pass (kernels chosen, buffers made) are a few
    milliseconds on a CPU, whatever the model: Qwen2.5-Coder 1.5B's first passes took what its
    later ones do (~300 ms), and its 17 start-up passes added 6.5-7.4 s to the target's start for
    nothing. Where a one-token pass takes 0.1 s or more, the warm-up times it a second time and,
    if the first cost no more than 1.1x that, runs no other width; faster passes, or a first pass
    dearer than that, and it runs them all. The clock here is driven by the model's passes: each
    pass of a width (by its token count) costs ``first_s`` the first time, ``later_s`` after."""
    now = [0.0]
    seen: set[int] = set()
    passes: list[tuple[int, int]] = []
    forward = LlamaForCausalLM.forward

    @functools.wraps(forward)
    def costed(self: LlamaForCausalLM, *args: object, **kwargs: object) -> object:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        tokens = kwargs["input_ids"].shape[-1]  # type: ignore[union-attr]
        passes.append((tokens, cache.get_seq_length() if cache is not None else 0))  # type: ignore[attr-defined]
        now[0] += later_s if tokens in seen else first_s
        seen.add(tokens)
        return forward(self, *args, **kwargs)

    loaded = load_model(str(tiny_models.target), LoadOptions(device="cpu", dtype="float32"))
    caches = SessionCaches(loaded, 4, 600)
    monkeypatch.setattr(LlamaForCausalLM, "forward", costed)
    monkeypatch.setattr(startup, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))  # warm_up's clock
    widest = caches.warm_up(8)
    over_a_cache = [tokens for tokens, before in passes if before > 0]
    assert set(over_a_cache) == widths_run, passes
    assert over_a_cache.count(1) == width_one_passes, passes
    assert widest == max(widths_run)
    assert (len(caches), caches.prefill_tokens_total) == (0, 0)
