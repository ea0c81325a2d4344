"""sharding/collectives.py reads the collectives of a compiled program's HLO text."""

from sharding.collectives import collectives, summary


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
