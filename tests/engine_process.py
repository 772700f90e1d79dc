"""Run as a script: an 'engine' that launches workers, prints their pids, and waits to die."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from kvtier.client import Client
from worker_helpers import WSPEC

if __name__ == "__main__":
    log_dir, world_size = Path(sys.argv[1]), int(sys.argv[2])
    instance = sys.argv[3]
    client = Client.launch(
        WSPEC,
        world_size,
        {"backend": "memory"},
        log_dir=log_dir,
        device_cache_mode="create",
        engine_timeout_s=2.0,
        instance_id=instance,
    )
    print(" ".join(str(p) for p in client.pids), flush=True)
    time.sleep(600)
