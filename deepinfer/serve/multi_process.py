"""The server over several processes (hosts): SGLang's flags, JAX's distributed runtime, and the
split of roles — process 0 serves HTTP and leads the engine, the others follow it turn by turn
(runtime/lockstep.py) and serve nothing. Every process loads the model and builds the same engine
on the one mesh spanning all their devices.

    python -m deepinfer.serve --nnodes 2 --node-rank 0 --dist-init-addr 10.0.0.1:5000 -tp 16 ...
    python -m deepinfer.serve --nnodes 2 --node-rank 1 --dist-init-addr 10.0.0.1:5000 -tp 16 ...
"""

from __future__ import annotations

import argparse
import logging

log = logging.getLogger("deepinfer.serve")


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("several processes (SGLang's flags; docs/parallel.md)")
    g.add_argument("--nnodes", type=int, default=1,
                   help="processes running this server together, one per host (each sees its own devices; the "
                        "parallel layout spans all of them)")
    g.add_argument("--node-rank", type=int, default=0,
                   help="this process's rank: 0 serves HTTP and leads, the others follow it")
    g.add_argument("--dist-init-addr", default=None,
                   help="HOST:PORT of rank 0's coordination service (jax.distributed), the same on every rank")


def check(args: argparse.Namespace) -> None:
    """Refuse what cannot run over several processes, by name, before anything loads."""
    if args.nnodes < 1:
        raise ValueError(f"--nnodes must be at least 1, got {args.nnodes}")
    if args.nnodes == 1:
        return
    if not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank must be in 0..{args.nnodes - 1} with --nnodes {args.nnodes}, got {args.node_rank}")
    if not args.dist_init_addr or ":" not in args.dist_init_addr:
        raise ValueError(f"--nnodes {args.nnodes} needs --dist-init-addr HOST:PORT (rank 0's address), "
                         f"got {args.dist_init_addr!r}")
    if args.prefix_cache_dir is not None:
        raise ValueError("--prefix-cache-dir is not supported with --nnodes > 1 (each process holds only its "
                         "devices' part of the cache)")
    if args.warmup != "full":
        # a background warm-up uses each program once its compile ends, a moment that differs per process
        log.info("--nnodes %d: compiling every step program before serving (--warmup full)", args.nnodes)
        args.warmup = "full"


def initialize(args: argparse.Namespace) -> None:
    """Start JAX's distributed runtime (before anything touches a device)."""
    if args.nnodes == 1:
        return
    import jax

    try:  # CPU devices of several processes talk through gloo (JAX's CPU default has no cross-process collectives)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, ValueError):
        pass
    jax.distributed.initialize(args.dist_init_addr, num_processes=args.nnodes, process_id=args.node_rank)
    log.info("process %d of %d (coordinator %s): %d local devices of %d", args.node_rank, args.nnodes,
             args.dist_init_addr, jax.local_device_count(), jax.device_count())


def lead(state):
    """Rank 0: its engine thread publishes every turn. Returns the LeaderEngine (close() it on shutdown)."""
    from deepinfer.runtime.lockstep import LeaderEngine
    from deepinfer.runtime.turn_channel import TurnChannel

    leader = LeaderEngine(state.engine.engine, TurnChannel.from_jax())
    state.engine.engine = leader
    return leader


def follow(state) -> int:
    """Ranks 1..: repeat the leader's turns until it stops. Returns the exit status."""
    from deepinfer.runtime.lockstep import follow
    from deepinfer.runtime.turn_channel import TurnChannel

    log.info("following rank 0 (no HTTP on this rank)")
    steps = follow(state.engine.engine, TurnChannel.from_jax())
    log.info("rank 0 stopped; %d steps followed", steps)
    return 0


def shutdown(args: argparse.Namespace) -> None:
    if args.nnodes > 1:
        import jax

        log.info("process %d: leaving the distributed runtime", args.node_rank)
        jax.distributed.shutdown()
