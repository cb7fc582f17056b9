"""Reference outputs and request helpers shared by the integration and fault tests."""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache

import grpc
import torch
from transformers import AutoModelForCausalLM

from specdec.launch import LocalCluster
from specdec.v1 import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    draft_pb2,
    draft_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)


@cache
def reference_greedy(model_dir: str, prompt: tuple[int, ...], max_new: int) -> list[int]:
    """Greedy target-only output from HF generate (fp32, CPU)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt) :].tolist()


def make_request(
    prompt: list[int], k: int = 4, max_new: int = 24, session_id: str = "", **sampling: object
) -> coordinator_pb2.GenerateRequest:
    return coordinator_pb2.GenerateRequest(
        session_id=session_id,
        prompt_token_ids=common_pb2.TokenIds(ids=prompt),
        sampling=common_pb2.SamplingParams(max_new_tokens=max_new, **sampling),
        speculation=coordinator_pb2.SpeculationParams(num_speculative_tokens=k),
    )


def coordinator_stub(cluster: LocalCluster) -> Iterator[coordinator_pb2_grpc.GenerationStub]:
    with grpc.insecure_channel(cluster.address) as channel:
        yield coordinator_pb2_grpc.GenerationStub(channel)


def worker_info(address: str, role: str) -> common_pb2.WorkerInfo:
    """Info of a draft or target worker ("target" for any target replica)."""
    with grpc.insecure_channel(address) as channel:
        if role.startswith("target"):
            return target_pb2_grpc.TargetWorkerStub(channel).Info(target_pb2.TargetInfoRequest(), timeout=5).info
        return draft_pb2_grpc.DraftWorkerStub(channel).Info(draft_pb2.DraftInfoRequest(), timeout=5).info
