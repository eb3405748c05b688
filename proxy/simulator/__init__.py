"""Offline provider simulator: validation, streaming, prefix-cache simulation and faults."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from proxy.simulator.config import SimConfig

if TYPE_CHECKING:
    from proxy.simulator.app import RunningSimulator, create_simulator_app, run_simulator
    from proxy.simulator.state import ReceivedRequest, Simulator

# Imported when first used: ``cachegate sessions`` builds the simulator's options (its config)
# and would otherwise import its server (starlette, the relay: ~150 ms at every start).
_LAZY = {
    "RunningSimulator": "proxy.simulator.app",
    "create_simulator_app": "proxy.simulator.app",
    "run_simulator": "proxy.simulator.app",
    "ReceivedRequest": "proxy.simulator.state",
    "Simulator": "proxy.simulator.state",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "ReceivedRequest",
    "RunningSimulator",
    "SimConfig",
    "Simulator",
    "create_simulator_app",
    "run_simulator",
]
