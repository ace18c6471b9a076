"""fzero's native CPU kernels: Adam/AdamW, Lion and Adagrad on float32 master weights and state, and the gradient
statistics.

The C sources are in `native/` at the repository root; `pip install` compiles them with cffi (API mode) into
`fzero.native._kernel`. Four instruction-set paths are built into that one binary and chosen at run time from
the CPU's features: `"avx512bf16"` (AVX-512F, the bfloat16 copy-out by AVX512_BF16's `VCVTNEPS2BF16`), `"avx512"`
(AVX-512F), `"avx2"` (AVX2 + FMA + F16C) and `"scalar"` (portable C). All of them give bitwise identical optimizer
steps (the same IEEE operations per element in the same order). Where the extension
is missing (no C compiler at install time), a pure-torch twin with the same signatures runs instead (`"torch"`),
with one warning.

    >>> import torch, fzero
    >>> p, g = torch.ones(5), torch.full((5,), 0.5)
    >>> m, v = torch.zeros(5), torch.zeros(5)
    >>> fzero.native.adam_step(p, g, m, v, step=1, lr=0.1, weight_decay=0.0)   # in place
    >>> p
    tensor([0.9000, 0.9000, 0.9000, 0.9000, 0.9000])

Hyper-parameters per segment (parameter groups): `adam_step(..., segments=(ends, group))` gives each segment of
the flat buffer (elements `[ends[s-1], ends[s])`) the hyper-parameters of its group; `lr`, `betas[0]`, `betas[1]`,
`eps` and `weight_decay` may then be sequences with one value per group. One pass over the buffer, each segment
bitwise what an ungrouped call on its slice with its group's values gives.

    >>> p, g, m, v = torch.ones(4), torch.full((4,), 0.5), torch.zeros(4), torch.zeros(4)
    >>> fzero.native.adam_step(p, g, m, v, step=1, lr=[0.1, 0.2], segments=((1, 4), (0, 1)))
    >>> p
    tensor([0.9000, 0.8000, 0.8000, 0.8000])

Choosing the path: `FZERO_ISA=scalar|avx2|avx512|avx512bf16|torch|auto` in the environment (read at first use), or
`set_isa(...)` (tests use it to run every path on one machine). The kernels run on `torch.get_num_threads()`
OpenMP threads above `parallel_threshold()` elements and release the GIL.

`lion_step` and `adagrad_step` follow `adam_step`'s conventions (dtypes, `grad_scale`, `out=`, `*_out=`,
`segments=`); their twin performs the kernels' own operations, so it agrees bitwise there.

The modules: `binding` (the extension and the path's choice), `kernels` (Adam's entry points and the statistics),
`kernels_more` (Lion's and Adagrad's), `checks` (their tensor arguments), `segments` (per-group values and segment
tables), `hyper` (a step's scalars), `twin` (the pure-torch path), `ops` (the `torch.library` custom ops).

May import: nothing of fzero.
"""

from __future__ import annotations

from . import binding, ops  # noqa: F401  (ops registers the torch.library custom ops on import)
from .binding import ISAS, Extension, available, extension, isa, openmp, parallel_threshold, set_isa, supported_isas
from .hyper import AdagradHyper, AdamHyper, LionHyper, adagrad_hyper, adam_hyper, lion_hyper
from .kernels import adam_step, ceiling, grad_stats, sumsq
from .kernels_more import adagrad_step, lion_step
from .segments import PerGroup, Segments, slice_segments  # noqa: F401  (the argument types, as before the split)

_ffi, _lib = binding.ffi, binding.lib  # the raw binding, for tests that call the C entry points themselves

__all__ = [
    "ISAS",
    "AdagradHyper",
    "AdamHyper",
    "Extension",
    "LionHyper",
    "adagrad_hyper",
    "adagrad_step",
    "adam_hyper",
    "adam_step",
    "available",
    "ceiling",
    "extension",
    "grad_stats",
    "isa",
    "lion_hyper",
    "lion_step",
    "openmp",
    "parallel_threshold",
    "set_isa",
    "slice_segments",
    "sumsq",
    "supported_isas",
]
