"""`python -m bench.bench_gpu`: the GPU benchmark (see the package's docstring)."""

from .cli import main

if __name__ == "__main__":  # not when a spawned client process imports this module
    main()
