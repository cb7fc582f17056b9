"""Entry point: `specdec serve coordinator` (or `python -m coordinator`)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc

from coordinator.engine import Engine
from coordinator.servicer import GenerationServicer
from coordinator.settings import CoordinatorSettings
from specdec.logging import configure_logging
from specdec.server import ServiceSpec, serve
from specdec.settings import load_settings
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


async def run(settings: CoordinatorSettings) -> None:
    engine = Engine(settings)

    def register(server: grpc.aio.Server) -> None:
        coordinator_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(engine), server)

    await serve(settings, ServiceSpec([SERVICE_NAME], register, engine.start, engine.stop))


def main(argv: Sequence[str]) -> None:
    settings = load_settings(CoordinatorSettings, argv, "specdec serve coordinator")
    configure_logging(settings.log_level, settings.log_format)
    asyncio.run(run(settings))
