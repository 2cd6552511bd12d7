"""``python -m tribucket.demo`` (and ``torchrun -m tribucket.demo``, how it relaunches itself)."""

from .cli import main

if __name__ == "__main__":
    main()
