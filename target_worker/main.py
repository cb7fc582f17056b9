"""Entry point: `specdec serve target` (or `python -m target_worker`)."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from prometheus_client import CollectorRegistry

from specdec.serving.logging import configure_logging
from specdec.serving.server import ServerControl, ServiceSpec, run_service, serve
from specdec.serving.settings import load_settings, log_unknown_environment
from specdec.serving.worker import WorkerCore
from specdec.v1 import target_pb2, target_pb2_grpc
from target_worker.servicer import TargetServicer
from target_worker.settings import TargetSettings

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetWorker"].full_name


async def run(settings: TargetSettings) -> int:
    control = ServerControl()
    registry = CollectorRegistry()
    core = WorkerCore(settings, control, registry)

    def register(server: grpc.aio.Server) -> None:
        target_pb2_grpc.add_TargetWorkerServicer_to_server(TargetServicer(core, settings), server)

    async def stop() -> None:
        core.close()

    return await serve(settings, ServiceSpec([SERVICE_NAME], register, core.load, stop, registry), control)


def main(argv: Sequence[str]) -> None:
    settings = load_settings(TargetSettings, argv, "specdec serve target")
    configure_logging(settings.log_level, settings.log_format)
    log_unknown_environment()
    run_service(run(settings))
