"""The stores: the seam the engine calls, and each database behind it."""
