"""Run as a script: an 'engine' that launches workers, prints their pids, and waits to die.

argv: LOG_DIR|- WORLD_SIZE INSTANCE [worker-owned|engine-owned] [reaper]. Engine-owned is the
pattern the README recommends: the engine creates the device caches and the workers attach to
them. ``reaper``: the launch starts a reaper, as the vLLM connector's do.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from kvtier.engine.client import Client
from kvtier.memory.device import DeviceCache, cache_name
from worker_helpers import WSPEC

if __name__ == "__main__":
    log_dir = None if sys.argv[1] == "-" else Path(sys.argv[1])
    world_size, instance = int(sys.argv[2]), sys.argv[3]
    engine_owned = len(sys.argv) > 4 and sys.argv[4] == "engine-owned"
    caches = (
        [DeviceCache.create(WSPEC, cache_name(instance, r)) for r in range(world_size)]
        if engine_owned
        else []
    )
    client = Client.launch(
        WSPEC,
        world_size,
        {"backend": "memory"},
        log_dir=log_dir,
        device_cache_mode="attach" if engine_owned else "create",
        engine_timeout_s=2.0,
        instance_id=instance,
        reaper="reaper" in sys.argv[5:],
    )
    assert client.swap_out([1], [0]).status.value == "ok"
    print(" ".join(str(p) for p in client.pids), flush=True)
    time.sleep(600)
