"""``python -m kernels``: build every C++ kernel this CPU runs (``make kernels``, run by
``make install``), so no request waits for a compiler.

The fused bf16 decode step where the CPU has AVX512-BF16 (kernels/fused_decode.py),
and the quantized-weights matmul, the decode-plan executor, the paged attention, the
row ops, the sampler, the logprob summaries and the token masks in their AMX, AVX-512
VNNI, AVX-512 or AVX2 variant (kernels/quant_linear.py, kernels/plan_decode.py,
kernels/paged_attention.py, kernels/row_ops.py, kernels/sampler.py,
kernels/logprob_rows.py, kernels/token_masks.py); on Linux the doorbells of the
shared-memory rings (kernels/shm_wait.py); the native answer of a ring's decode step
(kernels/ring_lane.py). Prints each library's path, or why
it was not built; a build that fails raises (native.BuildError).
"""

from __future__ import annotations

import sys

from kernels import (fused_decode, logprob_rows, native, paged_attention, plan_decode, quant_linear, row_ops, sampler,
                     ring_lane, shm_wait, token_masks)


def main() -> None:
    reason = fused_decode.cpu_unsupported_reason()
    if reason:
        print(f"{fused_decode.LIBRARY}: not built ({reason}; decode uses torch)")
    else:
        print(native.build(fused_decode.LIBRARY, native.AVX512_BF16_FLAGS))
    variant = quant_linear.host_variant()
    if variant is None:
        print(f"{quant_linear.LIBRARY}, {plan_decode.LIBRARY}, {paged_attention.LIBRARY}, {row_ops.LIBRARY}, "
              f"{sampler.LIBRARY}, {logprob_rows.LIBRARY}, {token_masks.LIBRARY}: not built (CPU lacks "
              "AVX2/FMA/F16C; GGUF weights are dequantized, random rows drawn, logprobs and masks taken in torch)")
    else:
        names = (quant_linear.LIBRARY, plan_decode.LIBRARY, paged_attention.LIBRARY, row_ops.LIBRARY,
                 sampler.LIBRARY, logprob_rows.LIBRARY, token_masks.LIBRARY)
        for path in native.build_many([(name, quant_linear.library_flags(name, variant)) for name in names]):
            print(path)
    if sys.platform.startswith("linux"):
        print(native.build(shm_wait.LIBRARY, ()))
    print(native.build(ring_lane.LIBRARY, ()))


if __name__ == "__main__":
    main()
