"""Expert-parallel Mixture-of-Experts: routing, dispatch and combine."""

__all__: list[str] = []
