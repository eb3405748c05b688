"""Offline provider simulator: validation, streaming, prefix-cache simulation and faults."""

from proxy.simulator.app import RunningSimulator, create_simulator_app, run_simulator
from proxy.simulator.config import SimConfig
from proxy.simulator.state import ReceivedRequest, Simulator

__all__ = [
    "ReceivedRequest",
    "RunningSimulator",
    "SimConfig",
    "Simulator",
    "create_simulator_app",
    "run_simulator",
]
