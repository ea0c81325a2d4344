"""sharding/collectives.py reads the collectives of a compiled program's HLO text."""

from sharding.collectives import collectives, summary
from tests.subprocess_env import cpu_devices_env


def test_long_tuples_with_index_comments_are_read():
    """XLA writes "/*index=5*/" inside a tuple of more than five results: the "=" in it once hid such
    a collective (a combined all-reduce of 19 gathered leaves went uncounted)."""
    hlo = ("  %all-reduce.19 = (f32[8,76,64]{2,1,0}, f32[8,20]{1,0}, f32[2]{0}, f32[2]{0}, f32[2]{0}, "
           "/*index=5*/f32[4]{0}, s32[3]{0}) all-reduce(%a, %b, %c, %d, %e, /*index=5*/%f, %g), to_apply=%add\n"
           "  %ag = bf16[16,256]{1,0} all-gather-start(%x), dimensions={0}\n"
           "  %done = bf16[16,256]{1,0} all-gather-done(%ag)\n"
           "  %p = f32[4]{0} parameter(0), metadata={op_name=\"all-reduce(\"}\n")
    found = collectives(hlo)
    assert [(c.kind, len(c.shapes)) for c in found] == [("all-reduce", 7), ("all-gather", 1)]
    assert found[0].bytes == 4 * (8 * 76 * 64 + 8 * 20 + 2 + 2 + 2 + 4 + 3)
    assert summary(found) == {"all-reduce": (1, found[0].bytes), "all-gather": (1, 16 * 256 * 2)}


_LOOP_PROGRAM = """
import jax, jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
from sharding.collectives import collectives, in_control_flow
mesh = Mesh(jax.devices()[:2], ("x",))

def local(a, n, flag):
    once = jax.lax.psum(a, "x")                                               # once per call
    looped = jax.lax.fori_loop(0, n, lambda i, v: jax.lax.psum(v * 2.0, "x"), a)  # once per iteration
    branch = jax.lax.cond(flag, lambda v: jax.lax.psum(v, "x") * 3.0, lambda v: v, a)  # when taken
    return once + looped + branch

f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("x"), P(), P()), out_specs=P("x"),
                          check_vma=False))
text = f.lower(jnp.ones((4, 128)), 3, True).compile().as_text()
found = in_control_flow(text)
print(len(collectives(text)), len(found["loop"]), len(found["branch"]), sorted({c.kind for c in found["loop"]}))
"""


def test_collectives_run_by_loops_and_branches_are_told_apart():
    """``in_control_flow`` finds the psum in a while loop's body and the one in a conditional's branch,
    not the one the program runs once (a real compiled program on 2 fake CPU devices)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = cpu_devices_env(2)
    out = subprocess.run([sys.executable, "-c", _LOOP_PROGRAM], cwd=root, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["3", "1", "1", "['all-reduce']"], out.stdout
