"""`ddserve serve`: start Ray (or join --address), deploy the app with Serve, serve until Ctrl-C."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

log = logging.getLogger("ddserve.serve")


def config_from_args(args) -> dict:
    """The `ddserve serve` flags as ServeConfig arguments (unset flags keep the defaults)."""
    names = ("model", "drafter", "tp", "max_streams", "budget", "buckets", "budgets",
             "num_slots", "max_queue", "dtype", "device", "served_model_name", "seed",
             "batch_invariant")  # fmt: skip
    cfg = {n: getattr(args, n, None) for n in names}
    cfg["speculative"] = not args.no_speculative
    if getattr(args, "cuda_graphs", None) is not None:
        cfg["cuda_graphs"] = args.cuda_graphs
    return {k: v for k, v in cfg.items() if v is not None}


def main(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    import ray
    from ray import serve

    from ddserve.serve.deployment import ServeConfig, build_app

    config = config_from_args(args)
    ServeConfig.model_validate(config)  # bad flags fail before Ray starts
    if args.address:
        ray.init(address=args.address)
    else:
        # A private single-machine cluster: no dashboard, and no token auth to set up.
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(include_dashboard=False)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        try:  # returns once the replica is up; raises after Serve's constructor retries fail
            serve.run(build_app(config), name="ddserve", route_prefix="/", blocking=False)
        except RuntimeError as e:
            print(f"ddserve: the application failed to start:\n{e}", file=sys.stderr, flush=True)
            return 1
        gcs = ray.get_runtime_context().gcs_address
        print(
            f"ddserve: serving on http://{args.host}:{args.port}/v1 (Ray at {gcs}); Ctrl-C to stop",
            flush=True,
        )
        while not stop.is_set():
            time.sleep(0.5)
    finally:
        print("ddserve: shutting down", flush=True)
        serve.shutdown()
        ray.shutdown()
    return 0
