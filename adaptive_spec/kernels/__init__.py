"""The machine's kernels and exactness: what makes a forward fast and batch-invariant on this hardware.

C++ kernels (`attention_cpu.cpp`, `linear_bf16.cpp`) built at run time (`build.py`) by their loaders,
each beside the plain-PyTorch reference its tests compare it to bitwise (`attention_cpu.py`,
`linear_bf16.py`); the faster fp32 products (`cpu_linear.py`); masked attention for a padded batch
(`attention.py`); the batch-invariance install and check (`exact.py`); and the compiled decoding step
(`compiled.py`). They plug into the plain forward of `adaptive_spec.cache` (the compiled step through
its `COMPILED` registry), which imports none of them.
"""
