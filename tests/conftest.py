"""Fixtures shared by several test modules."""

import os
import shutil
import tempfile

import pytest

# every engine the suite builds checks the allocator invariant after each step (every page free,
# held by requests or by prefix-cache blocks, its reference count the number of holders); server
# processes started by the tests inherit it
os.environ.setdefault("DEEPINFER_CHECK_INVARIANTS", "1")

# compile at LLVM -O0 unless XLA_FLAGS names a level (tests/subprocess_env.py says why); before JAX starts
from tests.subprocess_env import use_suite_opt_level

use_suite_opt_level()

from tests.engine_cases import MAX_TOKENS, alone, workload
from tests.reference import load_case

XLA_CACHE = pytest.StashKey[dict]()


def pytest_configure(config):
    """One persistent XLA compilation cache for the whole run (unless JAX_COMPILATION_CACHE_DIR names
    one): modules build engines with the same step programs, and ``_release_compiled_programs`` drops
    each module's compiled programs from memory, so without it every module compiles them again. What
    it saved is printed at the end. CompileCounter counts a program read from it as a compile."""
    import jax
    import jax.monitoring

    record = {"folder": None, "hits": 0, "saved_s": 0.0}
    if not jax.config.jax_compilation_cache_dir:
        record["folder"] = tempfile.mkdtemp(prefix="deepinfer-test-xla-cache-")
        jax.config.update("jax_compilation_cache_dir", record["folder"])

    def saved(event: str, seconds: float, **kwargs) -> None:
        if event == "/jax/compilation_cache/compile_time_saved_sec":
            record["hits"] += 1
            record["saved_s"] += seconds

    jax.monitoring.register_event_duration_secs_listener(saved)
    config.stash[XLA_CACHE] = record


def pytest_terminal_summary(terminalreporter, config):
    record = config.stash.get(XLA_CACHE, None)
    if record is not None:
        terminalreporter.write_line(f"XLA compilation cache: {record['hits']} programs read instead of compiled, "
                                    f"{record['saved_s']:.0f} s of compiling saved")


def pytest_unconfigure(config):
    record = config.stash.get(XLA_CACHE, None)
    if record is not None and record["folder"]:
        shutil.rmtree(record["folder"], ignore_errors=True)


@pytest.fixture(scope="module")
def reference_streams():
    case = load_case("mixed")
    prompts = workload(case.cfg.vocab_size)
    return prompts, [alone(case, p, m) for p, m in zip(prompts, MAX_TOKENS)]


@pytest.fixture(scope="session")
def server_cache(tmp_path_factory):
    """One DEEPINFER_CACHE for every server process the suite starts: the random model is written
    once, and servers with the same step shapes reuse each other's compiled programs."""
    return str(tmp_path_factory.mktemp("deepinfer-server-cache"))


# the bundled model's server as the README's example runs it (tests/test_bundled_model.py); the
# structured-output server tests share it, so the suite starts (and compiles) it once
BUNDLED_SERVER_ARGS = ["--max-num-seqs", "2", "--max-num-batched-tokens", "64", "--token-buckets", "2,16,64"]


@pytest.fixture(scope="session")
def bundled_server(tmp_path_factory):
    from tests.server_process import ServerProcess

    root = tmp_path_factory.mktemp("bundled-server")
    srv = ServerProcess(BUNDLED_SERVER_ARGS, str(root / "cache"), str(root / "server.log"))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def bundled_client(bundled_server):
    """The official openai client on the bundled server."""
    import openai

    return openai.OpenAI(base_url=bundled_server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop each module's compiled XLA programs when it ends. XLA CPU maps ~900 memory regions per
    program; a whole suite in one process otherwise reaches vm.max_map_count (65530) and LLVM fails
    ("Cannot allocate memory", or a segfault inside compilation)."""
    yield
    import gc

    import jax

    gc.collect()
    jax.clear_caches()
