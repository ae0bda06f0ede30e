"""gemmax.engine.hlo on programs as TPU backends print them: an async op in its short form
(`custom-call-start(...)`) names no computation it runs, so its wrapped computation is called by no
instruction's text. The index still finds the entry (the first TPU device check failed here:
"cannot tell the entry computation among ['async_computation', ..., 'main']")."""

from __future__ import annotations

from gemmax.engine.hlo import HloIndex

ASYNC_MODULE = """HloModule m, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%async_computation (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %c = f32[4]{0} custom-call(%p), custom_call_target="foo"
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %start = ((f32[4]{0}), f32[4]{0}, s32[]) async-start(%x), calls=%async_computation
  ROOT %done = f32[4]{0} async-done(%start)
}
"""


def test_the_entry_of_a_module_with_short_form_async_ops():
    index = HloIndex.read(ASYNC_MODULE)
    assert index.entry == "main"
    # The module as parsed prints the async pair in its short form, which names no computation.
    assert {i.opcode for i in index.computations["main"].values()} == {"parameter", "custom-call-start",
                                                                      "custom-call-done"}
    assert index.roots["main"] == "done" and index.roots["async_computation"] == "c"
