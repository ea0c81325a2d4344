"""What the multi-process server's turns cost (runtime/turn_channel.py): two processes on loopback
(jax.distributed, CPU), process 0 publishing N turns, process 1 reading them, as the server's rank 0
and a follower do once per engine step.

    python benchmarks/lockstep_turns.py [--turns 2000] [--ops 0]

Prints and writes (benchmarks/results/lockstep_turns.json): the time rank 0's engine thread spends
queueing one turn, and the time per turn end to end (the last turn read by the follower, over N).
``--ops K`` puts K "add request" entries of a 64-token prompt in every turn (a busy server's turns).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_process(rank: int, port: int, turns: int, ops: int) -> None:
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, ROOT)
    import jax

    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank)
    from deepinfer.runtime.turn_channel import TurnChannel
    from deepinfer.scheduler.sampling_params import SamplingParams

    channel = TurnChannel.from_jax()
    entry = ("add", list(range(64)), SamplingParams(max_tokens=128, temperature=0.7, seed=1), "cmpl-0", {})
    t0 = time.perf_counter()
    if rank == 0:
        queueing = 0.0
        for _ in range(turns):
            t = time.perf_counter()
            channel.publish([entry] * ops + [("step",)])
            queueing += time.perf_counter() - t
        channel.publish([("stop",)])
        channel.wait_stopped()
        total = time.perf_counter() - t0
        print("RESULT " + json.dumps({"turns": turns, "ops_per_turn": ops, "queue_ms_per_turn": 1e3 * queueing / turns,
                                      "end_to_end_ms_per_turn": 1e3 * total / turns}), flush=True)
    else:
        while not any(op[0] == "stop" for op in channel.receive()):
            pass
        channel.acknowledge_stop()
    jax.distributed.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=2000)
    ap.add_argument("--ops", type=int, default=0, help="'add request' entries in each turn")
    ap.add_argument("--process", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.process is not None:
        one_process(args.process, args.port, args.turns, args.ops)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, os.path.abspath(__file__), "--turns", str(args.turns), "--ops", str(args.ops), "--port", str(port)]
    procs = [subprocess.Popen(cmd + ["--process", str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode:
            print(err[-3000:], file=sys.stderr)
            return 1
    record = json.loads(next(line[7:] for line in outs[0][0].splitlines() if line.startswith("RESULT ")))
    sys.path.insert(0, ROOT)
    from benchmarks.timing import write_record

    write_record({"benchmark": "lockstep_turns", **record}, os.path.join(ROOT, "benchmarks", "results", "lockstep_turns.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
