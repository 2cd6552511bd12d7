"""The README's first command. For now: the bucket layout of a real model."""

from .report import main

if __name__ == "__main__":
    main()
