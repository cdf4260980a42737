"""Regional compilation: `torch.compile` on each repeated block named by the model's plan.

Every block of a `ModuleList` in `plan.blocks` is compiled in place with `nn.Module.compile`, so module
paths, parameter names and hooks stay as they are. Blocks of one list share their code, and dynamo treats
parameters as inputs, so the 60 Pro blocks cost one compilation per input shape (diffusers'
`compile_repeated_blocks` does the same). What compilation buys here is fusion of the elementwise chains
between the GEMMs and the attention kernel: fp32 LayerNorm + AdaLN scale/shift + cast, gated residuals,
the per-head RMSNorm and the fp32 RoPE (performance.md §2.4 puts them at ~12% of a Pro block).

`fullgraph=False` by default: a kernel dynamo cannot trace (e.g. an FA3 build without a fake
implementation) becomes a graph break instead of an error.

Inductor compiles the blocks in its deterministic mode (`inductor_options`): without it, it chooses some of its
reduction kernels' configurations (the LayerNorms over the video tokens among them) by timing them on the device,
configurations that round differently, so two GPU processes gave different MP4s for the same request (fifty-eighth
session). Measured on an H100 (fifty-ninth session), the mode costs nothing beyond the spread of repeated runs: the
Pro-distill DiT forward on FA3 6.017, 6.102 and 6.116 s with it against 5.988, 6.139 and 6.070 s without (six
processes, the order alternated), Lite-distill's 1.362 against 1.363 s; on torch_sdpa, timed once each way, Pro's
6.500 against 6.428 s (1.1%) and Lite's 1.527 against 1.523 s. The super-resolution DiT's blocks, which compile here
too, cost nothing either: a VSR x2 request of 768x512x121 on an H100 took 39.884 s with the mode (its 18 DiT calls
22.11 s) against 39.963 s without (22.20 s); on an H200 the Pro-distill forward took 5.901 and 5.893 s with it
against 5.895 s without. With the mode three `k6serve generate` processes on an H100, the third with an empty
inductor cache, wrote the same MP4 byte for byte (sixtieth session).
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from k6serve.models.plan import ModelPlan


# torch's own switch. Set either way, it is the user's choice and rules the whole process: "0" lets inductor time the
# configurations again (the blocks then compile as torch's default does); unset, k6serve's blocks compile
# deterministically and the rest of the process is left as torch's default has it.
DETERMINISTIC_ENVIRONMENT_VARIABLE = "TORCHINDUCTOR_DETERMINISTIC"


def inductor_options(backend: object, mode: str | None) -> dict[str, Any] | None:
    """`torch.compile`'s `options` for a block: inductor's deterministic mode (see the module docstring), or None
    where it does not apply: another backend, an explicit mode (torch takes a mode or options, and max-autotune's
    template choice is timing, which the deterministic mode would skip), or the switch set in the environment."""
    if backend != "inductor" or mode not in (None, "default") or DETERMINISTIC_ENVIRONMENT_VARIABLE in os.environ:
        return None
    # Every supported torch (>= 2.11) has the setting; torch.compile refuses an unknown option name when it wraps.
    # As torch's switch for these graphs: the options hold while they compile, where every read of the setting is
    # (torch 2.11: the pad-mm pass, template selection, the scheduler, Triton codegen), and codegen writes it into
    # each kernel's metadata, which the runtime autotuner reads.
    return {"deterministic": True}


def is_compiled(module: nn.Module) -> bool:
    """Whether `module.compile()` has been applied to this module."""
    return getattr(module, "_compiled_call_impl", None) is not None


BLOCK_RECOMPILE_LIMIT = 64


def apply_regional_compile(
    model: nn.Module,
    plan: ModelPlan,
    *,
    backend: object = "inductor",
    mode: str | None = None,
    fullgraph: bool = False,
    dynamic: bool | None = None,
) -> int:
    """Compile every block of every `plan.blocks` list in place; returns how many blocks were compiled.

    Idempotent: blocks that are already compiled are skipped. `dynamic=None` is torch's default (static
    first, dynamic after a shape change), which suits a server that sees several resolutions.

    Dynamo's limit of graph variants per code object is raised to `BLOCK_RECOMPILE_LIMIT`: all blocks of a class
    share one code object, and a served DiT gathers variants (static, then dynamic lengths: 2-3 after the warm-up;
    one more per new set of layers a request's own LoRA adapters wrap). At the default 8 the blocks then ran eager
    for the rest of the process, silently, at eager speed: a recompile costs once, that forever.
    """
    raise_recompile_limit(BLOCK_RECOMPILE_LIMIT)
    options = inductor_options(backend, mode)
    if options is not None:
        mode = None  # "default" is no mode; torch refuses a mode beside options
    num_compiled = 0
    for path in plan.blocks:
        blocks = model.get_submodule(path)
        if not isinstance(blocks, nn.ModuleList):
            raise TypeError(
                f"plan.blocks entry {path!r} is a {type(blocks).__name__}, not a ModuleList"
            )
        for block in blocks:
            if is_compiled(block):
                continue
            block.compile(backend=backend, mode=mode, options=options, fullgraph=fullgraph, dynamic=dynamic)
            num_compiled += 1
    return num_compiled


def raise_recompile_limit(limit: int) -> None:
    """Let dynamo keep up to `limit` graph variants per code object. Past its default of 8 it silently runs the code
    eager: one block class sees many variants when its instances differ (the VAE decoders' blocks: levels, first or
    later segment; the DiT bench: bf16 and e4m3 blocks side by side)."""
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name) and getattr(dynamo_config, name) < limit:
            setattr(dynamo_config, name, limit)
