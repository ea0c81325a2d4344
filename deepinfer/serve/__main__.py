"""`python -m deepinfer.serve`: an OpenAI-compatible HTTP server for a DeepSeek-V4 checkpoint.

With no --model it serves the bundled deepinfer-tiny-v4 (deepinfer.default_model): a
small V4 trained on Python's documentation and short dialogues — it answers, if not
wisely. Endpoints: /v1/completions, /v1/chat/completions,
/v1/models, /tokenize, /detokenize, /health, /metrics (Prometheus), /debug/engine.
With --ui (on by default on a loopback address): a web page at / (chat playground + live dashboard).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from deepinfer.serve import multi_process

log = logging.getLogger("deepinfer.serve")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m deepinfer.serve", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (config.json + safetensors + tokenizer files, "
                   "HF or official naming, FP8 / FP4 included; or an orbax folder from python -m deepinfer.convert); "
                   "default: the bundled deepinfer-tiny-v4")
    p.add_argument("--served-model-name", default=None, help="the name clients use in 'model' (default: the folder name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback by default)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("DEEPINFER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 and the token endpoints (env DEEPINFER_API_KEY)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--quantized-weights", choices=("dequantize", "keep"), default="dequantize",
                   help="FP8 / FP4 checkpoints: dequantize to --dtype at load, or keep them quantized in memory "
                        "(about a quarter of bf16's bytes for FP4 experts; dequantized inside each matmul)")
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output (default: min(model limit, 4096))")
    p.add_argument("--max-num-seqs", type=int, default=16, help="sequences in the running batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=256, help="tokens per engine step (prefill chunks + decodes)")
    p.add_argument("--kv-memory", default=None,
                   help="KV cache budget, e.g. 512MiB or 2GiB (default: room for max-num-seqs requests of max-model-len)")
    p.add_argument("--max-waiting", type=int, default=256, help="sequences allowed to queue beyond the batch; more get 503")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body; larger gets 413")
    p.add_argument("--batch-invariant", action="store_true", default=os.environ.get("DEEPINFER_BATCH_INVARIANT") == "1",
                   help="outputs independent of the rest of the batch, bitwise (env DEEPINFER_BATCH_INVARIANT=1)")
    p.add_argument("--num-continuous-decode-steps", type=int, default=1,
                   help="decode steps per dispatch when every row decodes and nobody waits (SGLang's flag; "
                        "tokens then stream in groups of this many)")
    p.add_argument("--no-overlap", action="store_true", default=os.environ.get("DEEPINFER_NO_OVERLAP") == "1",
                   help="wait for each step before planning the next (comparison, debugging; env DEEPINFER_NO_OVERLAP=1)")
    p.add_argument("--speculative-config", type=_speculative_config, default=None,
                   help='speculative decoding with the model\'s MTP block, vLLM\'s JSON: '
                        '\'{"method": "mtp", "num_speculative_tokens": 3}\' (1..5 drafts per decode); '
                        'or env DEEPINFER_USE_NEXTN_DECODE=k')
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the cached state of shared prompt prefixes (on by default; --no-enable-prefix-caching)")
    p.add_argument("--prefix-checkpoint-interval", type=int, default=512,
                   help="prompt tokens between snapshots of the sliding-window state: a hit replays at most this many")
    p.add_argument("--prefix-cache-dir", default=None,
                   help="keep the prefix cache across restarts: loaded from this folder at start-up (when it fits the "
                        "model and layout) and saved there on a graceful shutdown")
    p.add_argument("--prefix-replay", choices=("snapshot", "recompute"), default="snapshot",
                   help="'snapshot': restore the per-slot state from snapshots (exact, bounded replay); 'recompute': "
                        "keep none and replay the model's exact horizon (L*(W-1)+1 tokens) from an empty state")
    p.add_argument("--prefix-snapshots", type=int, default=None,
                   help="snapshot store entries on the device (default: 4 per sequence slot)")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="'fcfs': arrival order; 'priority': by each request's 'priority' field (lower first), then "
                        "arrival; the least urgent running request is the one preempted when memory runs out")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests send their own 'chat_template' (rendered in Jinja's sandbox); refused otherwise")
    par = p.add_argument_group("parallel layout (vLLM's flags; sharding/parallel.py)")
    par.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                     help="split heads, vocabulary and MLP widths over this many devices")
    par.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                     help="attention data-parallel ranks: each its own slots, KV pools and requests; MoE over all")
    par.add_argument("--context-parallel-size", type=int, default=1,
                     help="context-parallel ranks: each step's tokens split over them (prefill chunks, larger decode steps)")
    par.add_argument("--enable-expert-parallel", action="store_true",
                     help="split the routed experts over every device (EP = DP x CP x TP)")
    par.add_argument("--enable-eplb", action="store_true",
                     help="count tokens per expert and rebalance the expert placement (hot experts replicated)")
    par.add_argument("--num-redundant-experts", type=int, default=0, help="extra expert slots per layer for replicas")
    par.add_argument("--eplb-step-interval", type=int, default=0,
                     help="rebalance every this many steps (0: never on its own)")
    p.add_argument("--token-buckets", type=_buckets, default=None,
                   help="step sizes in tokens to compile, comma-separated, e.g. 16,64,256 (the largest must be "
                        "--max-num-batched-tokens; default: 1, 2, 4, 8 as far as a decode step fills them, then "
                        "powers of two from 16); like vLLM's --cuda-graph-sizes")
    p.add_argument("--context-buckets", type=_context_buckets, default=None,
                   help="contexts (tokens, below --max-model-len) whose decode steps get block tables of their own "
                        "width, comma-separated, or 'none' for one width (default: max-model-len / 4, / 16, ... "
                        "down to 1024)")
    p.add_argument("--warmup", choices=("background", "full"), default="background",
                   help="background: compile one step program, start serving with it (prefill in chunks of its "
                        "size) and compile the rest on a worker thread, each used once ready; full: compile every "
                        "program before serving")
    p.add_argument("--warm-structured", action="store_true",
                   help="compile the structured-output step programs at start-up (twice the programs; otherwise "
                        "each compiles on the first constrained request of its shape)")
    p.add_argument("--grammar-compile-timeout", type=float, default=30.0,
                   help="seconds a structured-output grammar may take to compile; slower ones are refused with a 400")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests get to finish on SIGINT/SIGTERM; "
                   "then each gets an error event and [DONE]. New requests get 503 meanwhile")
    p.add_argument("--compile-cache", default=os.environ.get("DEEPINFER_COMPILE_CACHE", "auto"),
                   help="JAX persistent compilation cache folder ('auto': <DEEPINFER_CACHE or ~/.cache/deepinfer>/jax; "
                   "'off' to disable); a warm cache makes restarts skip compilation, and the step programs "
                   "saved in its deepinfer-programs/ skip tracing too")
    p.add_argument("--platform", default=os.environ.get("DEEPINFER_PLATFORM"),
                   help="devices to run on: cpu, gpu, or a PJRT plugin platform such as npu (Ascend; "
                   "docs/platforms.md); default: JAX's choice")
    p.add_argument("--pjrt-plugin", default=os.environ.get("DEEPINFER_PJRT_PLUGIN"),
                   help="the PJRT plugin library (.so) to register under --platform, when no installed JAX "
                   "plugin provides it")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--ui", action=argparse.BooleanOptionalAction, default=None,
                   help="serve a web page at / (chat playground + live engine dashboard); default: on when "
                        "--host is a loopback address (127.0.0.1, localhost, ::1), off otherwise")
    multi_process.add_arguments(p)
    return p.parse_args(argv)


def _speculative_config(text: str) -> dict:
    """--speculative-config JSON -> dict (checked further by EngineConfig, which names bad values)."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, like '{{\"method\": \"mtp\", \"num_speculative_tokens\": 3}}', got {text!r}")
    return value


def parse_bytes(text: str) -> int:
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1, "": 1}
    t = text.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    if unit not in units or not num:
        raise ValueError(f"--kv-memory: cannot read {text!r} (examples: 512MiB, 2GiB, 1000000)")
    return int(float(num) * units[unit])


def ui_enabled(args: argparse.Namespace) -> bool:
    """--ui / --no-ui, or auto: on for a loopback bind only (a page on a public address is opt-in)."""
    if args.ui is not None:
        return args.ui
    return args.host in ("localhost", "::1") or args.host.startswith("127.")


def _buckets(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return sizes


def _context_buckets(text: str) -> tuple[int, ...]:
    return () if text.strip().lower() == "none" else _buckets(text)


def build_state(args: argparse.Namespace):
    """Load the model, build and warm the engine. Returns the ServerState."""
    import jax
    from tqdm.auto import tqdm

    from deepinfer.default_model import NAME as DEFAULT_NAME
    from deepinfer.default_model import default_model_dir
    from deepinfer.engine_config import EngineConfig
    from deepinfer.grammar.backend import GrammarBackend
    from deepinfer.load_progress import LoadProgress
    from deepinfer.model_loading import load_model
    from deepinfer.models.deepseek_v4 import model_spec
    from deepinfer.params import count_params
    from deepinfer.runtime.engine import LLMEngine
    from deepinfer.runtime.mesh_setup import load_shardings
    from deepinfer.serve.api import ServerState
    from deepinfer.serve.async_engine import AsyncEngine
    from deepinfer.serve.metrics import ServerMetrics
    from deepinfer.text.tokenizer import TextTokenizer

    programs = None  # the step programs' own store (runtime/program_store.py), inside the compile cache
    if args.compile_cache != "off":
        from deepinfer.default_model import cache_root

        path = os.path.join(cache_root(), "jax") if args.compile_cache == "auto" else args.compile_cache
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
        programs = os.path.join(path, "deepinfer-programs")
        log.info("JAX compilation cache: %s (compiled step programs: %s)", path, programs)
    model_dir = args.model or default_model_dir()
    name = args.served_model_name or (DEFAULT_NAME if args.model is None else os.path.basename(os.path.normpath(model_dir)))
    t0 = time.perf_counter()
    progress = LoadProgress(log=log)  # a bar on a terminal, log lines at each quarter otherwise
    early = EngineConfig(  # refused before the weights load: the speculation and layout flags
        speculative_config=args.speculative_config, tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size, context_parallel_size=args.context_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel, enable_eplb=args.enable_eplb,
        num_redundant_experts=args.num_redundant_experts, eplb_step_interval=args.eplb_step_interval,
        num_continuous_decode_steps=args.num_continuous_decode_steps)
    speculating = early.num_speculative_tokens() > 0
    try:
        cfg, params = load_model(model_dir, dtype=args.dtype, mtp="require" if speculating else "skip",
                                 quantized_weights=args.quantized_weights, progress=progress,
                                 shardings_for=load_shardings(early))  # straight onto the mesh
    finally:
        progress.close()
    tokenizer = TextTokenizer.from_dir(model_dir)
    n_params = count_params(model_spec(cfg, include_mtp=False))
    log.info("model %s (%s): %s parameters, %s, %d layers (%s), %s loaded in %.1f s on %s",
             name, model_dir, f"{n_params:,}", args.dtype, cfg.num_hidden_layers,
             ", ".join(sorted(set(cfg.layer_types))), progress.summary(), time.perf_counter() - t0,
             jax.devices()[0].platform)
    if tokenizer is None:
        log.warning("no tokenizer.json in %s: only token-id prompts will work", model_dir)
    max_len = args.max_model_len or min(cfg.max_position_embeddings, 4096)
    if max_len > cfg.max_position_embeddings:
        raise ValueError(f"--max-model-len {max_len} exceeds the model's max_position_embeddings {cfg.max_position_embeddings}")
    ec = EngineConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_len,
        token_buckets=args.token_buckets, context_buckets=args.context_buckets,
        kv_memory_bytes=parse_bytes(args.kv_memory) if args.kv_memory else None, overlap=not args.no_overlap,
        measure_device=True,  # device time and busy fraction for /metrics (one watcher thread)
        batch_invariant=args.batch_invariant, speculative_config=args.speculative_config,
        warm_structured=args.warm_structured, enable_prefix_caching=args.enable_prefix_caching,
        prefix_checkpoint_interval=args.prefix_checkpoint_interval, prefix_replay=args.prefix_replay,
        prefix_snapshots=args.prefix_snapshots, scheduling_policy=args.scheduling_policy,
        tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
        context_parallel_size=args.context_parallel_size, enable_expert_parallel=args.enable_expert_parallel,
        enable_eplb=args.enable_eplb, num_redundant_experts=args.num_redundant_experts,
        eplb_step_interval=args.eplb_step_interval, num_continuous_decode_steps=args.num_continuous_decode_steps,
        program_cache_dir=programs,
    )
    grammar = None
    if tokenizer is not None:
        grammar = GrammarBackend(model_dir, cfg.vocab_size, cfg.eos_token_ids, compile_timeout_s=args.grammar_compile_timeout)
    engine = LLMEngine(cfg, params, ec, grammar=grammar)
    if ec.batch_invariant:
        log.info("batch-invariant mode: on (XLA_FLAGS=%s)", os.environ.get("XLA_FLAGS", ""))
    if engine.num_drafts:
        log.info("speculative decoding: the MTP block drafts up to %d tokens per decode row", engine.num_drafts)
    background = args.warmup == "background"
    t1 = time.perf_counter()
    with tqdm(total=1 if background else len(engine.bucket_shapes()), desc="Compiling step programs",
              unit="program", leave=False, disable=None) as wbar:
        engine.warmup(progress=wbar.update, background=background, begin=False)  # the rest: once serving
    store = engine.programs.step.store
    log.info("compiled %d step programs in %.1f s%s: token buckets %s (row buckets %s)%s",
             len(engine.compiled_shapes), time.perf_counter() - t1,
             f" ({store.loaded} programs loaded from the store)" if store is not None and store.loaded else "",
             list(engine.token_buckets), list(engine.row_buckets),
             f"; still compiling in the background (tokens): {', '.join(engine.warming.describe_pending())}"
             if engine.warming else "")
    if args.prefix_cache_dir is not None:
        _load_saved_prefix_cache(engine, args.prefix_cache_dir)
    metrics = ServerMetrics(name)
    return ServerState(
        engine=AsyncEngine(engine, metrics), tokenizer=tokenizer, model_name=name, vocab_size=cfg.vocab_size,
        max_model_len=max_len, max_num_seqs=args.max_num_seqs, max_waiting=args.max_waiting, metrics=metrics,
        api_key=args.api_key, max_body_bytes=args.max_body_bytes, aliases=(model_dir,),
        eos_token_ids=tuple(cfg.eos_token_ids), grammar=grammar,
        trust_request_chat_template=args.trust_request_chat_template, ui=ui_enabled(args),
    )


def _load_saved_prefix_cache(engine, directory: str) -> None:
    """A saved cache that does not fit (other weights, other layout) is skipped with a warning: the
    server starts cold rather than not at all."""
    from deepinfer.runtime.prefix_persistence import HOST_FILE, load_prefix_cache

    if not os.path.isfile(os.path.join(directory, HOST_FILE)):
        log.info("prefix cache: nothing saved in %s yet", directory)
        return
    t0 = time.perf_counter()
    try:
        got = load_prefix_cache(engine, directory)
    except (ValueError, RuntimeError) as e:
        log.warning("prefix cache: not loading %s: %s", directory, e)
        return
    log.info("prefix cache: loaded %d blocks (%d tokens, %d snapshots) from %s in %.2f s",
             got["blocks"], got["tokens"], got["snapshots"], directory, time.perf_counter() - t0)


def _save_prefix_cache(engine, directory: str) -> None:
    from deepinfer.runtime.prefix_persistence import save_prefix_cache

    t0 = time.perf_counter()
    try:
        got = save_prefix_cache(engine, directory)
    except (ValueError, RuntimeError, OSError) as e:
        log.warning("prefix cache: not saved to %s: %s", directory, e)
        return
    log.info("prefix cache: saved %d blocks (%d tokens, %d snapshots) to %s in %.2f s",
             got["blocks"], got["tokens"], got["snapshots"], directory, time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.batch_invariant:  # before JAX starts its backend (runtime/batch_invariance.py)
        from deepinfer.runtime.batch_invariance import configure_xla

        configure_xla()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import contextlib

    import uvicorn

    from deepinfer.runtime.platform import select_platform
    from deepinfer.serve.api import build_app
    from deepinfer.serve.shutdown import FLUSH_S, DrainingServer

    try:
        multi_process.check(args)
        multi_process.initialize(args)  # several processes: JAX's distributed runtime first
        select_platform(args.platform, args.pjrt_plugin)  # before anything touches a device
        state = build_state(args)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.node_rank > 0:  # a follower: no HTTP, the leader's turns
        status = multi_process.follow(state)
        multi_process.shutdown(args)
        return status
    leader = multi_process.lead(state) if args.nnodes > 1 else None

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.engine.start()
        log.info("serving %s on http://%s:%d", state.model_name, args.host, args.port)
        # work that would slow the start if run beside it (it holds the interpreter lock): the step
        # programs still to compile, then xgrammar's import and vocabulary scan (off the first
        # constrained request's path; beside the compiles it slowed the first requests)
        warm_grammar = state.grammar.warm_in_background if state.grammar is not None else None
        warming = state.engine.engine.warming
        if warming is not None:
            warming.then = warm_grammar
            warming.begin()
        elif warm_grammar is not None:
            warm_grammar()
        if state.ui:
            log.info("web page (chat playground, dashboard): http://%s:%d/ (--no-ui turns it off)", args.host, args.port)
        yield
        log.info("shutting down: stopping the engine loop")
        state.engine.stop()
        if leader is not None and not state.engine.alive:
            leader.close()  # the followers stop too
            multi_process.shutdown(args)  # here: uvicorn re-raises the signal that stopped it once it returns
        if args.prefix_cache_dir is not None and not state.engine.alive:
            _save_prefix_cache(state.engine.engine, args.prefix_cache_dir)

    app = build_app(state, lifespan=lifespan)
    # the drain (serve/shutdown.py) has ended every stream before uvicorn's own timeout starts
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=FLUSH_S, access_log=False)
    DrainingServer(config, state, args.shutdown_timeout).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
