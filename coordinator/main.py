"""Entry point: `specdec serve coordinator` (or `python -m coordinator`)."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
import structlog
from prometheus_client import CollectorRegistry
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from coordinator.engine import Engine
from coordinator.engine_api import SERVICE_NAME as ENGINE_SERVICE_NAME
from coordinator.engine_api import VllmEngineServicer, gateway_request_id
from coordinator.servicer import GenerationServicer
from coordinator.settings import CoordinatorSettings
from coordinator.turn import cut_off_cleanup_s
from specdec.serving.logging import configure_logging
from specdec.serving.metrics import CoordinatorMetrics
from specdec.serving.server import RequestIds, ServerControl, ServiceSpec, run_service, serve
from specdec.serving.settings import load_settings, log_unknown_environment
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

log = structlog.get_logger(__name__)

SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


async def run(settings: CoordinatorSettings) -> int:
    control = ServerControl()
    registry = CollectorRegistry()
    try:
        engine = Engine(settings, CoordinatorMetrics(registry))
    except ValueError as exc:  # unreadable credentials, unsupported state URL: say what to fix
        log.error("invalid_settings", error=str(exc))
        return 2

    def register(server: grpc.aio.Server) -> None:
        coordinator_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(engine), server)
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(VllmEngineServicer(engine), server)

    services = [SERVICE_NAME, ENGINE_SERVICE_NAME]
    cut_off = cut_off_cleanup_s(settings.state_retry_s)
    ids = RequestIds(in_body=gateway_request_id)
    spec = ServiceSpec(services, register, engine.start, engine.stop, registry, cancel_wait_s=cut_off, request_ids=ids)
    return await serve(settings, spec, control)


def main(argv: Sequence[str]) -> None:
    settings = load_settings(CoordinatorSettings, argv, "specdec serve coordinator")
    configure_logging(settings.log_level, settings.log_format)
    log_unknown_environment()
    run_service(run(settings))
