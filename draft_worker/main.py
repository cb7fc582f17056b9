"""Entry point: `specdec serve draft` (or `python -m draft_worker`)."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from prometheus_client import CollectorRegistry

from draft_worker.servicer import DraftServicer, Vocabulary
from draft_worker.settings import DraftSettings
from specdec.serving.logging import configure_logging
from specdec.serving.server import ServerControl, ServiceSpec, run_service, serve
from specdec.serving.settings import load_settings, log_unknown_environment
from specdec.serving.worker import WorkerCore
from specdec.v1 import draft_pb2, draft_pb2_grpc

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftWorker"].full_name


async def run(settings: DraftSettings) -> int:
    control = ServerControl()
    registry = CollectorRegistry()
    core = WorkerCore(settings, control, registry)
    vocabulary = Vocabulary()

    def register(server: grpc.aio.Server) -> None:
        draft_pb2_grpc.add_DraftWorkerServicer_to_server(DraftServicer(core, settings, vocabulary), server)

    async def start() -> None:
        await core.load()
        await core.scheduler.call(vocabulary.load, settings, core.loaded)

    async def stop() -> None:
        core.close()

    return await serve(settings, ServiceSpec([SERVICE_NAME], register, start, stop, registry), control)


def main(argv: Sequence[str]) -> None:
    settings = load_settings(DraftSettings, argv, "specdec serve draft")
    configure_logging(settings.log_level, settings.log_format)
    log_unknown_environment()
    run_service(run(settings))
