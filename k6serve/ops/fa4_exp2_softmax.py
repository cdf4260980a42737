"""The CuTe DSL side of `fa4_exp2_emulation` (experimental): FA4 4.0.0b36's `Softmax.online_softmax` with each row's
exp2 split between the MUFU units and FA4's degree-3 polynomial (`utils.ex2_emulation`). Imported only when
$K6SERVE_FA4_EX2_EMULATION is set (it needs cutlass, i.e. flash-attn-4's CUDA 13 cutlass-dsl, at import).
Everything but the marked loop is the original method line for line (flash_attn/cute/softmax.py).
"""

# No `from __future__ import annotations`: the DSL reads the `cutlass.Constexpr[...]` annotations as objects.
import cutlass
from cutlass import Float32, cute
from flash_attn.cute import utils
from quack import layout_utils

# Set by `fa4_exp2_emulation.apply` before FA4 compiles a kernel: in every FREQ consecutive scores of the thread's
# share of a row (its register fragment), the last RES get the polynomial. Read while the DSL traces (compile time), so they are constants of the kernel.
FREQ = 8
RES = 3


@cute.jit
def online_softmax(
    self,
    acc_S: cute.Tensor,
    is_first: cutlass.Constexpr[bool] = False,
    check_inf: cutlass.Constexpr[bool] = True,
) -> cute.Tensor:
    acc_S_mn = layout_utils.reshape_acc_to_mn(acc_S)
    row_scale = cute.make_fragment_like(self.row_max, Float32)
    row_max = self.row_max
    row_sum = self.row_sum
    scale_log2 = self.scale_log2
    arch = self.arch
    for r in cutlass.range(cute.size(row_max), unroll_full=True):
        acc_S_row = acc_S_mn[r, None].load()
        row_max_cur = utils.fmax_reduce(
            acc_S_row,
            init_val=row_max[r] if cutlass.const_expr(not is_first) else None,
            arch=arch,
        )
        row_max_cur = cute.arch.warp_reduction_max(row_max_cur, threads_in_group=4)
        row_max_prev = row_max[r]
        row_max[r] = row_max_cur
        if cutlass.const_expr(check_inf):
            row_max_cur = 0.0 if row_max_cur == -Float32.inf else row_max_cur
        row_max_cur_scaled = row_max_cur * scale_log2
        # --- changed: the original is acc_S_row_exp = cute.math.exp2(acc_S_row * scale_log2 - row_max_cur_scaled)
        acc_S_mn[r, None].store(acc_S_row * scale_log2 - row_max_cur_scaled)
        for i in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
            if cutlass.const_expr(i % FREQ >= FREQ - RES):
                acc_S_mn[r, i] = utils.ex2_emulation(acc_S_mn[r, i])
            else:
                acc_S_mn[r, i] = cute.math.exp2(acc_S_mn[r, i], fastmath=True)
        acc_S_row_exp = acc_S_mn[r, None].load()
        # --- end of the change
        if cutlass.const_expr(is_first):
            acc_S_row_sum = utils.fadd_reduce(acc_S_row_exp, init_val=None, arch=arch)
            row_scale[r] = 1.0
        else:
            row_scale[r] = cute.math.exp2((row_max_prev - row_max_cur) * scale_log2, fastmath=True)
            acc_S_row_sum = utils.fadd_reduce(acc_S_row_exp, init_val=row_sum[r] * row_scale[r], arch=arch)
        row_sum[r] = acc_S_row_sum
    return row_scale
