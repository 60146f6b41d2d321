"""triton and triton.language when installed, else None, and `jit` (a no-op then): the twins
need no triton, and the dispatch never picks a kernel without it. Imported by the kernel
modules only, so `import mmgen.kernels` imports no triton (TRITON_INTERPRET is read then)."""

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

jit = triton.jit if triton is not None else (lambda fn: fn)
