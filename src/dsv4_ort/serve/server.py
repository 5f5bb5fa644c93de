"""``dsv4-ort serve``: load the model, start the engine thread, run uvicorn until SIGINT / SIGTERM.

On a signal the engine stops first, so every running stream ends with an error event and every waiting request
with an error; uvicorn then closes the connections and the process exits with status 0.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import uvicorn

from .app import build_app


class _Uvicorn(uvicorn.Server):
    """uvicorn that prints the address once it listens and stops the engine when asked to exit."""

    def __init__(self, config, engine, model: str):
        super().__init__(config)
        self.engine, self.model = engine, model

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.should_exit or not self.servers:
            return
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        host = f"[{host}]" if ":" in host else host
        print(f"dsv4-ort serve: {self.model} on http://{host}:{port} (OpenAI API at http://{host}:{port}/v1; "
              f"max batch {self.engine.max_batch}{', batch-invariant' if self.engine.batch_invariant else ''}"
              f"{f', speculative mtp k={self.engine.num_draft}' if self.engine.speculative else ''}, "
              f"{self.engine.session.threads} threads)", flush=True)

    def handle_exit(self, sig, frame) -> None:
        # not recorded as a captured signal: uvicorn would re-raise it after the shutdown (status 130 / 143).
        # The engine is stopped from another thread: this handler runs on the main thread, which may hold the
        # engine's lock at this moment (submit, metrics), and that lock is not reentrant.
        threading.Thread(target=self.engine.stop, args=("the server is shutting down",), kwargs={"wait": False},
                         daemon=True).start()
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True


def run(args) -> int:
    """Runs the server for the parsed ``dsv4-ort serve`` arguments; returns the exit status."""
    from ..runtime.cli import open_session
    from ..runtime.engine import Engine

    # an export in pipeline stages: its stages in this process, or one Ray actor each with --ray
    ray_address = getattr(args, "ray_address", None)
    pipeline = {"backend": "ray" if ray_address else "local", "micro_batches": getattr(args, "micro_batches", None)}
    if ray_address:
        pipeline["ray_address"] = ray_address
    speculative = getattr(args, "speculative", None)
    num_draft = getattr(args, "num_draft", 2) if speculative else 1
    # Batch invariance up to the rows of a decode call (--max-batch, times num_draft + 1 for a speculative verify
    # call): a request's tokens do not depend on what decodes beside it.
    rows = args.max_batch * (num_draft + 1 if speculative else 1)
    session = open_session(args.model_dir, threads=args.threads, isa=args.isa, need_text=False,
                           batch_invariant=rows if getattr(args, "batch_invariant", True) else 0,
                           pipeline=pipeline)
    try:
        engine = Engine(session, max_batch=args.max_batch, max_queue=args.max_queue,
                        prefill_chunk=args.prefill_chunk, speculative=speculative, num_draft=num_draft,
                        admission_window=args.admission_window / 1e3)
        engine.warmup()  # the serving shapes once, before the URL is printed (Engine.warmup)
        engine.start()
    except Exception:
        if hasattr(session, "close"):
            session.close()
        raise
    model = Path(args.model_dir).resolve().name
    app = build_app(engine, model, api_key=args.api_key)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=10, access_log=False)
    server = _Uvicorn(config, engine, model)
    try:
        server.run()
    finally:
        engine.stop("the server is shutting down")
        if hasattr(session, "close"):  # a pipeline's stages (Ray actors) stop with the server
            session.close()
    if not server.started:
        print(f"dsv4-ort serve: error: could not listen on {args.host}:{args.port}", file=sys.stderr)
        return 1
    print("dsv4-ort serve: stopped", file=sys.stderr, flush=True)
    return 0
