"""One address of a stage as the gateway sees it: its channels, its stub and the health verdict.

The owner of the list is :class:`gateway.stage_clients.StageClient`; the health monitor sets ``down``;
a :class:`gateway.stage_stream_client.StageStream` remembers which replica its call went to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc


@dataclass
class Replica:
    """One address of a stage: a request channel, a probe channel of its own, and the monitor's verdict.

    Probes go over their own channel so a probe never shares (or waits behind) the request traffic's
    connection state, and so a request channel's round-robin is not stepped by probes."""

    label: str
    target: str
    channel: grpc.aio.Channel
    stub: Any
    health: health_pb2_grpc.HealthStub
    probe_channel: grpc.aio.Channel
    down: bool = False  # set by the health monitor; picks skip a replica that is down while others serve

    def unreachable(self) -> bool:
        """Known down, or its request channel has no connection and the last attempt failed."""
        state = self.channel.get_state(try_to_connect=False)
        return self.down or state == grpc.ChannelConnectivity.TRANSIENT_FAILURE
